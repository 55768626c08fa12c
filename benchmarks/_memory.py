"""CPU peak-memory measurement for the benchmarks: resident set sampled by a background thread.

``ru_maxrss`` only knows the process-wide peak (imports included), which hides small workloads;
this samples ``/proc/self/statm`` every half millisecond while the workload runs (torch releases
the GIL in its kernels) and reports the growth over the resident set just before it started.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE_MIB


@contextmanager
def peak_rss_growth(interval: float = 5e-4) -> Iterator[dict]:
    """``with peak_rss_growth() as result: work()`` then ``result["mib"]`` is the peak growth."""
    result = {"mib": 0.0}
    base = rss_mib()
    peak = [base]
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
        result["mib"] = peak[0] - base
