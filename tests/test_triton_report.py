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
    """ptxas on sm_90a: no spill stores or loads for any kernel of the Gram design at head widths 16 and 64 (exit
    status 0), within the shared memory of an A100's block (163 KiB)."""
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
            "--chords",
            "gram",
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
        (kernel, dim) for kernel in ("fwd", "bwd_dq", "bwd_dkdv") for dim in ("16", "64")
    }
    for row in rows:
        assert int(row["spill_stores"]) == 0 and int(row["spill_loads"]) == 0, row
        assert 0 < int(row["registers"]) <= 255 and int(row["shared"]) <= 163 * 1024, row


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


def dry_run_stages(tmp_path: Path, *flags: str) -> tuple[str, list[str]]:
    """``gpu_check.sh --dry-run`` with ``flags``: its output and the commands it lists for a GPU."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path / "results")}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, [line for line in done.stdout.splitlines() if line.startswith("skipped, no GPU:")]


def test_gpu_check_compile_table_lists_every_preset_precision_and_cuda_graph(tmp_path):
    """``--compile-table``: the compiled model's CUDA test, then tiny-cifar and small at batch 128, eager and
    compiled blocks under fp32 and bf16 autocast, and the compiled blocks in a CUDA graph; nothing else."""
    stdout, listed = dry_run_stages(tmp_path, "--compile-table")
    assert len(listed) == 7 and "-k compiled_model" in listed[0]
    for preset in ("tiny-cifar", "small"):
        for precision in ("none", "bf16"):
            wanted = (f"--preset {preset} --batch 128", f"--autocast {precision}")
            assert any(all(part in line for part in wanted) for line in listed)
        assert any(f"--preset {preset}" in line and "--cuda-graph" in line for line in listed)
    assert "triton_report" not in stdout


SYNTHETIC_PTX = """
$L__BB0_1:                              // =>This Loop Header: Depth=1
\tld.global.v4.b32 \t{ %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
\tmov.b64 \t%rd9, 0;
$L__BB0_2:                              //   Parent Loop BB0_1 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
\tfma.rn.f32 \t%r5, %r1, %r2, %r5;
\t@%p1 ld.global.b32 { %r6 }, [ %rd2 + 0 ];
\tadd.s64 \t%rd9, %rd9, 4;
\tsetp.ne.b64 \t%p2, %rd9, 256;
\t@%p2 bra \t$L__BB0_2;
\tex2.approx.f32 \t%r7, %r5;
\tmma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%fd1, %fd2}, {%fd3}, {%fd4}, {%fd5, %fd6};
\tdiv.full.f32 \t%r8, %r7, %r5;
\tsetp.lt.f32 \t%p4, %r8, 0f358637BD;
\t@%p4 bra \t$L__BB0_4;
\tbra.uni \t$L__BB0_5;
$L__BB0_4:                              //   in Loop: Header=BB0_1 Depth=1
\tmov.b64 \t%rd10, 0;
$L__BB0_3:                              //   Parent Loop BB0_1 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
\tsub.f32 \t%r11, %r1, %r2;
\tadd.s64 \t%rd10, %rd10, 4;
\tsetp.ne.b64 \t%p5, %rd10, 64;
\t@%p5 bra \t$L__BB0_3;
$L__BB0_5:                              //   in Loop: Header=BB0_1 Depth=1
\tshfl.sync.bfly.b32 \t%r9, %r8, 1, 31, -1;
\tadd.f64 \t%fd7, %fd1, %fd2;
\tsetp.lt.s32 \t%p3, %r10, %r11;
\t@%p3 bra \t$L__BB0_1;
\tret;
"""


def test_per_pair_counts_walk_the_main_loop_s_common_path():
    """``attention_kernel.main_loop_counts``: one iteration of the outermost loop, an inner ``range(D)`` loop counted
    its trip count (64) times, the rarely taken branch into a second inner loop (a tile's near-equal chords) left
    out; each instruction in its columns (a predicated load, a float64 add, an SFU division)."""
    from polar_vit_hf.benchmarks.attention_kernel import Loop, loop_headers, main_loop_counts, trip_count

    lines = SYNTHETIC_PTX.splitlines()
    outer, inner = loop_headers(lines)
    assert outer == ["$L__BB0_1"] and inner == {"$L__BB0_2", "$L__BB0_3"}
    assert trip_count(lines, Loop(4, 9)) == 64
    counts = main_loop_counts(SYNTHETIC_PTX)
    assert counts["fp32"] == 64 + 3  # the inner FMA 64 times, ex2, div and setp.lt.f32; no sub of the rare loop
    assert counts["loads"] == 1 + 64 and counts["sfu"] == 2 and counts["mma"] == 1
    assert counts["fp64"] == 1 and counts["shuffles"] == 1


def test_attention_kernel_ptx_table_without_a_gpu(tmp_path):
    """``benchmarks/attention_kernel.py`` on a machine without a GPU: the per-pair PTX table of the baseline and the
    Gram design (sm_90, D = 16), its goals line, the CSV and the plot; the new kernels use the tensor cores (TF32 and
    FP64 ``mma``) and spill nothing, the baseline has no tensor-core instruction."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-m", "polar_vit_hf.benchmarks.attention_kernel", "--designs", "baseline", "gram"]
        + ["--head-dim", "16", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "goals (gram;" in done.stdout and "no CUDA device" in done.stdout
    rows = {(row["design"], row["kernel"]): row for row in csv.DictReader(open(tmp_path / "attention_kernel_ptx.csv"))}
    assert set(rows) == {
        *((design, kernel) for design in ("baseline", "gram") for kernel in ("fwd", "total")),
        ("baseline", "bwd_q"),
        ("baseline", "bwd_kv"),
        ("gram", "bwd_dq"),
        ("gram", "bwd_dkdv"),
    }
    gram, baseline = rows["gram", "total"], rows["baseline", "total"]
    assert float(gram["mma"]) > 0 and float(gram["fp64"]) > 0 and int(gram["spills"]) == 0
    assert float(baseline["mma"]) == 0
    assert float(gram["loads"]) < float(baseline["loads"]) and float(gram["sfu"]) < float(baseline["sfu"])
    assert (tmp_path / "attention_kernel.png").stat().st_size > 0


def test_gpu_check_kernel_table_lists_the_attention_kernels_stages(tmp_path):
    """``--kernel-table``: the attention tests on CUDA, the per-pair PTX and time table at N = 196 ... 8192 and the
    timed tuning sweep; nothing of the training step."""
    _, listed = dry_run_stages(tmp_path, "--kernel-table")
    assert any("tests/test_attention.py -k triton" in line for line in listed)
    assert any("attention_kernel.py --sizes 196 256 1024 4096 8192" in line for line in listed)
    assert any("attention_tune.py --dim 64" in line for line in listed)
    assert not any("step_time.py" in line for line in listed)
