"""The launch-configuration sweep of the Triton attention kernels, without a GPU: registers and spills for sm_90 by
ptxas, and a dry run of the timed sweep through Triton's interpreter."""

from __future__ import annotations

import copy
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polar_vit_hf.modeling.triton_attention import LAUNCH_CONFIGS, TRITON_AVAILABLE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "attention_tune.py"
pytestmark = [pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed"), pytest.mark.slow]


def run(tmp_path: Path, *args: str, interpret: bool) -> tuple[str, list[dict]]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, list(csv.DictReader(open(tmp_path / "attention_tune.csv")))


def test_ptxas_figures_drop_spilling_configurations(tmp_path):
    """The default forward configuration at D = 64 and one with blocks twice as tall (64 x 16, 8 warps): every row
    has ptxas' registers, a row is marked ``spills`` exactly where ptxas reports spill bytes, and the default (the
    first row) does not spill; the launch table is left as it was."""
    before = copy.deepcopy(LAUNCH_CONFIGS)
    out, rows = run(
        tmp_path,
        *("--ptxas-only", "--dim", "64", "--kernels", "fwd", "--blocks-m", "64", "--blocks-n", "16"),
        *("--warps", "8", "--stages", "1", "--workers", "1", "--arch", "sm_90"),
        interpret=False,
    )
    assert len(rows) == 2 and rows[0]["default"] == "True"
    assert (rows[1]["block_m"], rows[1]["block_n"]) == ("64", "16")
    assert int(rows[0]["spill_bytes"]) == 0
    for row in rows:
        assert 0 < int(row["registers"]) <= 255
        assert (row["status"] == "spills") == (int(row["spill_bytes"]) > 0), row
    assert "fwd, D = 64" in out
    assert LAUNCH_CONFIGS == before


def test_dry_run_times_and_checks_every_candidate(tmp_path):
    """Under Triton's interpreter: every kernel's default and the other candidate are timed and checked against the
    float64 reference (within 4x the default's error), and the fastest is printed as a launch-table entry."""
    out, rows = run(
        tmp_path,
        *("--dim", "16", "--size", "16", "--batch", "1", "--heads", "2", "--blocks-m", "16", "--blocks-n", "16"),
        *("--warps", "4", "--stages", "1", "--arch", "none", "--repeats", "1"),
        interpret=True,
    )
    assert [row["kernel"] for row in rows] == ["fwd", "fwd", "bwd_dq", "bwd_dq", "bwd_dkdv", "bwd_dkdv"]
    for row in rows:
        assert row["status"] == "ok" and float(row["ms"]) > 0 and float(row["error"]) < 1e-5, row
    assert out.count("best: LAUNCH_CONFIGS[") == 3
    assert (tmp_path / "attention_tune.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_needs_a_gpu_or_the_interpreter(tmp_path):
    """Without CUDA and without the interpreter, the timed sweep refuses in one line."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "none", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "attention_tune.py needs a CUDA GPU with triton (or TRITON_INTERPRET=1 for a dry run)"
    )
