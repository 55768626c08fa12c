"""CPU peak-memory measurements for the benchmarks: the resident set, and the bytes of live tensors.

``ru_maxrss`` only knows the process-wide peak (imports included), which hides small workloads.
:func:`peak_rss_growth` reports the resident set's peak growth over a block: everything the process maps for it,
code it imports and compiled kernel libraries it loads included.  On Linux it resets the kernel's own peak mark
(``5`` into ``/proc/self/clear_refs``, which sets ``VmHWM`` to the present resident set) and reads ``VmHWM`` after
the block: exact, and nothing runs beside the block.  Where that file cannot be written it samples
``/proc/self/statm`` from a thread every half millisecond.  That thread needs the GIL, which it takes from the
block's Python code on every wake (a first training step, which loads its compiled kernels, measured 0.3-0.9 s
slower beside it) and which a compiled kernel's call may hold for its whole run: where the process-wide peak rose
during the block, the block reached it, and that peak counts too (on Linux a process starts at the mark of the
process that started it, so only peaks above that one show there).
:func:`peak_tensor_growth` counts tensors only, the CPU counterpart of CUDA's ``max_memory_allocated``: the peak of
the bytes allocated inside the block and not yet freed, from the profiler's allocation events.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class MemoryGrowth:
    """The peak growth a measurement found, in MiB (set when its block ends)."""

    mib: float = 0.0


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE_MIB


def high_water_mib() -> float:
    """The process's peak resident set so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_high_water() -> bool:
    """Set the kernel's peak resident-set mark (``VmHWM``) to the present resident set (``5`` into
    ``/proc/self/clear_refs``, Linux 4.0 and later); ``False`` where that file cannot be written."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def vm_high_water_mib() -> float:
    """The kernel's peak resident-set mark (``VmHWM`` in ``/proc/self/status``) in MiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


@contextmanager
def peak_rss_growth(interval: float = 5e-4) -> Iterator[MemoryGrowth]:
    """``with peak_rss_growth() as growth: work()`` then ``growth.mib`` is the resident set's peak growth: from the
    kernel's peak mark where it can be reset (:func:`reset_high_water`), else sampled every ``interval`` seconds."""
    base = rss_mib()
    if not reset_high_water():
        with _sampled_rss_growth(base, interval) as sampled:
            yield sampled
        return
    result = MemoryGrowth()
    try:
        yield result
    finally:
        result.mib = max(vm_high_water_mib(), rss_mib()) - base


@contextmanager
def _sampled_rss_growth(base: float, interval: float) -> Iterator[MemoryGrowth]:
    """:func:`peak_rss_growth` by a thread that samples the resident set, and the process-wide peak where the
    block raised it."""
    result = MemoryGrowth()
    peak = [base]
    high_water = high_water_mib()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], rss_mib())
        if high_water_mib() > high_water:  # the process-wide peak, reached inside the block
            peak[0] = max(peak[0], high_water_mib())
        result.mib = peak[0] - base


@contextmanager
def peak_tensor_growth() -> Iterator[MemoryGrowth]:
    """``with peak_tensor_growth() as growth: work()`` then ``growth.mib`` is the peak of the CPU tensor bytes
    allocated inside the block and still alive: the running sum of the profiler's allocation events (``+bytes``
    for each allocation, ``-bytes`` when it is freed; memory allocated before the block and freed inside it is not
    counted), in the order they happened.  Independent of what the allocator keeps or returns to the system and of
    the code the block loads; the profiler slows the block down, so time it separately."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    result = MemoryGrowth()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorder:
        yield result
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in recorder.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    result.mib = peak / 2**20
