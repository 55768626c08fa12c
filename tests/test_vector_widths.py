"""The compiled CPU kernels' precision under every vector width this CPU runs, not only its widest.

Eager ATen and inductor's C++ kernels both follow ``ATEN_CPU_CAPABILITY`` (``avx512``: 512-bit vectors, ``avx2``:
256-bit, ``default``: scalar code): a process started with it computes what a CPU of that width computes, its
reductions in that order and its vector functions from that width's library.  The suite runs the
``kernel_precision`` tests at the machine's own width; this file runs them again in a fresh process for each
narrower width and for scalar code, so a developer on one CPU sees what another CPU would compute.  Each width's
kernels compile into their own folder of the kernel cache (:func:`cpu_kernels.kernel_cache_dir` names the
capability).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
X86_WIDTHS = ("AVX512", "AVX2", "DEFAULT")  # widest first, as torch.backends.cpu.get_cpu_capability() names them


def narrower_widths(native: str) -> list[str]:
    """The ``ATEN_CPU_CAPABILITY`` values below ``native``: the narrower x86 widths and scalar code (``default``);
    on other CPUs, scalar code."""
    widths = X86_WIDTHS[X86_WIDTHS.index(native) + 1 :] if native in X86_WIDTHS else ("DEFAULT",)
    return [width.lower() for width in widths if width != native]


def test_narrower_widths_reach_down_to_scalar_code():
    assert narrower_widths("AVX512") == ["avx2", "default"]
    assert narrower_widths("AVX2") == ["default"]
    assert narrower_widths("DEFAULT") == []
    assert narrower_widths("SVE256") == ["default"]


@pytest.mark.parametrize("capability", narrower_widths(torch.backends.cpu.get_cpu_capability()))
def test_kernel_precision_holds_at_every_narrower_vector_width(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "kernel_precision"]
    result = subprocess.run(
        [*command, "tests/test_cpu_kernels.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    report = "\n".join(result.stdout.splitlines()[-40:])
    assert result.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}:\n{report}"
    assert " passed" in report and " failed" not in report
