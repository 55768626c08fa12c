"""The Triton kernels compiled for a real GPU target (no GPU needed) and the one-call GPU check's dry run."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from polar_vit_hf.modeling.triton_attention import TRITON_AVAILABLE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed"), pytest.mark.slow]


def test_default_launch_configurations_do_not_spill_on_sm90(tmp_path):
    """ptxas on sm_90a: no spill stores or loads for any kernel at head widths 16 and 64 (exit status 0)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "polar_vit_hf.benchmarks.triton_report",
            "--head-dims",
            "16",
            "64",
            "--arch",
            "sm_90",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "triton_report.csv")))
    assert {(row["kernel"], row["head_dim"]) for row in rows} == {
        (kernel, dim) for kernel in ("fwd", "bwd_q", "bwd_kv") for dim in ("16", "64")
    }
    for row in rows:
        assert int(row["spill_stores"]) == 0 and int(row["spill_loads"]) == 0, row
        assert 0 < int(row["registers"]) <= 255 and int(row["shared"]) <= 100 * 1024, row


def test_gpu_check_dry_run_without_a_gpu(tmp_path):
    """The GPU check parses its arguments, dry-runs the install, lists the GPU stages and compiles one kernel."""
    script = ROOT / "benchmarks" / "gpu_check.sh"
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_DIR": str(results),
        "OUT": str(out),
        "TRITON_CACHE_DIR": str(tmp_path / "c"),
    }
    bad = subprocess.run(["bash", str(script), "--fast"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown argument '--fast'" in bad.stderr
    done = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Would install polar-vit-hf" in done.stdout
    # the attention tests, the compiled GPU kernels' test, the attention timings, two training steps (+ sanitizer)
    assert done.stdout.count("skipped, no GPU:") >= 5
    assert "tests/test_gpu_kernels.py" in done.stdout and "POLAR_VIT_GPU_KERNELS=1" in done.stdout
    assert (results / "triton_report.csv").exists()
    with tarfile.open(out / "gpu_check.tar.gz") as archive:  # what the device tool brings back: one file
        assert "results/triton_report.csv" in archive.getnames()


def test_gpu_check_compile_table_lists_every_preset_precision_and_cuda_graph(tmp_path):
    """``--compile-table``: the compiled model's CUDA test, then tiny-cifar and small at batch 128, eager and
    compiled blocks under fp32 and bf16 autocast, and the compiled blocks in a CUDA graph; nothing else."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path / "results")}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--compile-table"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = [line for line in done.stdout.splitlines() if line.startswith("skipped, no GPU:")]
    assert len(listed) == 7 and "-k compiled_model" in listed[0]
    for preset in ("tiny-cifar", "small"):
        for precision in ("none", "bf16"):
            wanted = (f"--preset {preset} --batch 128", f"--autocast {precision}")
            assert any(all(part in line for part in wanted) for line in listed)
        assert any(f"--preset {preset}" in line and "--cuda-graph" in line for line in listed)
    assert "triton_report" not in done.stdout
