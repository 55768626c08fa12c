"""``benchmarks/step_time.py`` and ``benchmarks/profile_step.py``: the training-step benchmarks run and report what
they claim (not timed)."""

from __future__ import annotations

import csv
import re

import pytest

pytestmark = pytest.mark.slow  # processes, training runs or compiles: `make test-fast` skips them


def test_interleaved_step_time_reports_paired_ratios_memory_and_saved_bytes(tmp_path, capsys):
    from polar_vit_hf.benchmarks import step_time

    code = step_time.main(
        [
            "--models",
            "euclidean",
            "polar",
            "--batch",
            "2",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--interleave",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line for line in out.splitlines() if line.startswith(("Euclidean", "Polar-ViT"))}
    assert set(rows) == {"Euclidean ViT (transformers)", "Polar-ViT, polar, fused (default)"}
    assert re.search(r"ms\s+1\.00x", rows["Euclidean ViT (transformers)"])
    # the per-round times printed are the ones the paired time ratio is the median of
    rounds = re.search(r"euclidean ([\d ]+); polar ([\d ]+)\)", out)
    euclid, polar = ([float(v) for v in group.split()] for group in rounds.groups())
    assert len(euclid) == len(polar) == 2
    shown = float(re.search(r"ms\s+([\d.]+)x", rows["Polar-ViT, polar, fused (default)"]).group(1))
    # the printed times are rounded to whole milliseconds: the shown ratio lies within the rounded rounds' range
    assert min((p - 0.5) / (e + 0.5) for p, e in zip(polar, euclid)) - 0.005 <= shown
    assert shown <= max((p + 0.5) / max(e - 0.5, 1e-3) for p, e in zip(polar, euclid)) + 0.005
    with open(tmp_path / "step_time.csv") as handle:
        table = {row["model"]: row for row in csv.DictReader(handle)}
    assert set(table) == {"euclidean", "polar"}
    assert all(float(row["saved_mib"]) > 0 and float(row["median_s"]) > 0 for row in table.values())
    assert (tmp_path / "step_time.png").stat().st_size > 0


def test_inference_times_forward_passes_and_saves_nothing_for_backward(tmp_path, capsys):
    from polar_vit_hf.benchmarks import step_time

    argv = ["--models", "euclidean", "polar", "--batch", "2", "--repeats", "1", "--warmup", "1", "--threads", "1"]
    assert step_time.main([*argv, "--inference", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "batch 2, inference (eval, no_grad)" in out
    with open(tmp_path / "step_time.csv") as handle:
        table = {row["model"]: row for row in csv.DictReader(handle)}
    assert set(table) == {"euclidean", "polar"}
    assert all(float(row["saved_mib"]) == 0 and float(row["median_s"]) > 0 for row in table.values())


def test_the_step_profile_prints_operators_and_layer_kinds(tmp_path, capsys):
    from polar_vit_hf.benchmarks import profile_step

    arguments = ["--preset", "demo", "--batch", "4", "--threads", "1", "--top", "60", "--out", str(tmp_path)]
    assert profile_step.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "aten::mm" in printed and "Polar-FC" in printed and "gyro layer norm" in printed
    with open(tmp_path / "layers.csv") as handle:
        kinds = {row["layer_kind"]: float(row["forward_ms"]) for row in csv.DictReader(handle)}
    assert {"Polar-FC", "attention (scores, softmax, centroid, projections)", "residual"} <= set(kinds)
    assert all(ms > 0 for ms in kinds.values())
    assert (tmp_path / "trace.json").stat().st_size > 0 and (tmp_path / "layers.png").stat().st_size > 0
    assert (tmp_path / "kernels.csv").read_text().startswith("fused_layer,kernel_ms,calls")


def test_the_step_profile_attributes_compiled_kernels_to_their_fused_layer():
    """``kernel_table`` charges each compiled kernel call to the fused layer Function that ran it, forward and
    backward apart (a boost residual with its compiled kernels on)."""
    import torch
    from torch.profiler import profile

    from polar_vit_hf.benchmarks import profile_step
    from polar_vit_hf.modeling import fused_layers
    from polar_vit_hf.modeling.runtime import use_runtime_options

    torch.manual_seed(0)
    x = torch.cat([torch.rand(2, 9, 1) * 3, torch.nn.functional.normalize(torch.randn(2, 9, 16), dim=-1)], -1)
    f = torch.cat([torch.rand(2, 9, 1) * 3, torch.nn.functional.normalize(torch.randn(2, 9, 16), dim=-1)], -1)
    x.requires_grad_(True)
    with use_runtime_options(cpu_kernels=True, kernel_min_elements=0):
        for _ in range(2):  # the first call compiles (or loads) the kernels
            with profile() as prof:
                fused_layers.fused_boost_residual(x, f, torch.tensor(0.7), None, 1.0).sum().backward()
    table = profile_step.kernel_table(prof.events())
    assert {"FusedBoostResidual", "FusedBoostResidualBackward"} <= set(table)
    assert all(ms > 0 and calls >= 1 for ms, calls in table.values())
