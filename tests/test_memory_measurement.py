"""``benchmarks/_memory.py``: the two peak-memory measurements count what they say they count."""

from __future__ import annotations

import mmap
import subprocess
import sys

import pytest
import torch

from polar_vit_hf.benchmarks import _memory
from polar_vit_hf.benchmarks._memory import MemoryGrowth, peak_rss_growth, peak_tensor_growth

MIB = 2**20 // 4  # float32 elements per MiB


def test_peak_tensor_growth_is_the_most_bytes_allocated_in_the_block_alive_at_once():
    before = torch.empty(4 * MIB)
    with peak_tensor_growth() as growth:
        first = torch.empty(8 * MIB)
        del before  # allocated before the block: its release does not lower the count
        second = torch.empty(4 * MIB)  # 12 MiB alive: the peak
        del first
        third = torch.empty(2 * MIB)  # 6 MiB alive
    assert isinstance(growth, MemoryGrowth)
    assert abs(growth.mib - 12.0) < 0.01
    del second, third
    with peak_tensor_growth() as nothing:
        pass
    assert nothing.mib == 0.0


@pytest.mark.parametrize("high_water_mark", [True, False], ids=["kernel-mark", "sampled"])
def test_peak_rss_growth_sees_the_pages_a_block_touches(monkeypatch: pytest.MonkeyPatch, high_water_mark: bool):
    """Pages new to the process: an anonymous mapping written page by page (a tensor may reuse pages that the
    allocator kept resident from earlier tests of the same worker, which the resident set already counts); by the
    kernel's reset peak mark and by the sampling thread that serves where the mark cannot be reset."""
    if not high_water_mark:
        monkeypatch.setattr(_memory, "reset_high_water", lambda: False)
    with peak_rss_growth() as growth:
        block = mmap.mmap(-1, 64 * 2**20)
        for offset in range(0, len(block), mmap.PAGESIZE):
            block[offset] = 1
    assert 60.0 < growth.mib < 80.0
    block.close()


def test_the_kernel_peak_mark_is_reset_to_the_present_resident_set():
    """The mark the measurement reads starts at the resident set, not at an earlier peak of the process."""
    transient = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(transient), mmap.PAGESIZE):
        transient[offset] = 1
    transient.close()
    assert _memory.reset_high_water()
    assert _memory.vm_high_water_mib() < _memory.rss_mib() + 8.0


@pytest.mark.parametrize("high_water_mark", [True, False], ids=["kernel-mark", "sampled"])
def test_peak_rss_growth_counts_a_peak_the_sampling_thread_cannot_see(high_water_mark: bool):
    """A peak reached and released inside one call that holds the GIL (as a compiled kernel's call may): the
    sampling thread does not run during it; the kernel's reset mark counts it, and so does the process's
    high-water mark where the sampling thread serves (a fresh bare Python process that loads only the module,
    started by another small one: no earlier test, import or parent raised its high-water mark)."""
    code = (
        "import importlib.util\nimport sys\n"
        f"spec = importlib.util.spec_from_file_location('memory', {_memory.__file__!r})\n"
        "memory = sys.modules['memory'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(memory)\n"
        + ("" if high_water_mark else "memory.reset_high_water = lambda: False\n")
        + "with memory.peak_rss_growth() as growth:\n"
        "    transient = b'\\x01' * (256 * 2**20)\n"  # written and freed while the GIL is held
        "    del transient\n"
        "print(growth.mib)\n"
    )
    # run by a small Python process: on Linux a process started by a large one inherits its high-water mark
    outer = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}], check=True)"
    done = subprocess.run([sys.executable, "-c", outer], capture_output=True, text=True, check=True)
    assert 250.0 < float(done.stdout.strip().splitlines()[-1]) < 300.0
