"""The hand-written per-row attention forward of ``benchmarks/attention_kernel_bound.py``: built with the CPU's
vector flags, it computes the package's forward (checked against float64, with keys that do not fill a vector)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from polar_vit_hf.benchmarks.attention_kernel_bound import OUTPUTS

pytestmark = pytest.mark.slow


def test_the_hand_written_kernel_matches_float64_and_is_timed_against_the_compiled_one(tmp_path):
    """One round at 2 x 2 slices of 19 tokens: both kernels within 1e-5 of the float64 forward on every output,
    both timed, the table and the CSV written."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "polar_vit_hf.benchmarks.attention_kernel_bound",
            "--samples",
            "2",
            "--heads",
            "2",
            "--tokens",
            "19",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled / hand-written:" in done.stdout
    rows = list(csv.DictReader(open(tmp_path / "attention_kernel_bound.csv")))
    assert [row["kernel"] for row in rows] == ["compiled (package)", "hand-written per row"]
    for row in rows:
        assert float(row["median_ms"]) > 0
        errors = {name: float(value) for name, value in row.items() if name.startswith("error_")}
        assert len(errors) == len(OUTPUTS) and all(error < 1e-5 for error in errors.values()), (row["kernel"], errors)
