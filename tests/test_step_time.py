"""``benchmarks/step_time.py`` and ``benchmarks/profile_step.py``: the training-step benchmarks run and report what
they claim (not timed)."""

from __future__ import annotations

import csv
import re

import pytest
import torch

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
            "--image_size",
            "16",  # 16 patches: every worker builds the models at the size asked for
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "tiny-cifar at 16 px, batch 2" in out
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
    assert all(row["tokens"] == "16" for row in table.values())
    assert all(float(row["saved_mib"]) > 0 and float(row["median_s"]) > 0 for row in table.values())
    # a step's live tensors include what it saves for backward
    assert all(float(row["peak_tensor_mib"]) >= float(row["saved_mib"]) for row in table.values())
    assert (tmp_path / "step_time.png").stat().st_size > 0


def test_base_times_each_polar_model_from_the_other_source_tree_side_by_side(tmp_path, capsys):
    """``--base``: each Polar-ViT model runs a second time from the base source (a folder, or a git revision in a
    temporary worktree that is removed afterwards), interleaved with this tree's, and the change's ratio is printed."""
    import shutil
    import subprocess
    from pathlib import Path

    from polar_vit_hf.benchmarks import step_time

    repo = Path(step_time.__file__).resolve().parents[1]
    base = tmp_path / "base-tree"
    for folder in ("polar_vit_hf", *step_time.PACKAGE_FOLDERS):
        shutil.copytree(repo / folder, base / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (base / "benchmarks" / "_memory.py").unlink()  # an older tree: the measurements come from the measuring tree
    argv = ["--models", "polar-eager", "--batch", "2", "--repeats", "2", "--warmup", "1"]
    argv += ["--threads", "1", "--interleave", "--out", str(tmp_path / "out")]
    assert step_time.main([*argv, "--base", str(base)]) == 0
    out = capsys.readouterr().out
    assert f"Polar-ViT, fused, no compiled kernels @ {base}" in out
    line = next(line for line in out.splitlines() if "x the time of" in line)
    ratio, head_source, base_source, rounds = re.search(
        r"([\d.]+)x the time of .* \((\S+) against (\S+); per-round ratios ([\d. ]+)\)", line
    ).groups()
    assert Path(head_source) == repo and Path(base_source) == base.resolve()
    per_round = [float(r) for r in rounds.split()]
    assert len(per_round) == 2 and abs(float(ratio) - sorted(per_round)[0] / 2 - sorted(per_round)[1] / 2) < 2e-3
    with open(tmp_path / "out" / "step_time.csv") as handle:
        assert [row["model"] for row in csv.DictReader(handle)] == ["polar-eager", "polar-eager@base"]

    worktrees = ["git", "-C", str(repo), "worktree", "list"]
    before = subprocess.run(worktrees, capture_output=True, text=True).stdout
    assert step_time.main([*argv[:-2], "--out", str(tmp_path / "git"), "--base", "HEAD"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "x the time of HEAD" in line)
    worktree = Path(re.search(r"against (\S+);", line).group(1))
    assert worktree != repo and not worktree.exists()  # checked out for the run, removed after it
    assert subprocess.run(worktrees, capture_output=True, text=True).stdout == before
    assert step_time.main([*argv, "--base", "no-such-revision"]) == 2
    assert "--base no-such-revision: not a source tree" in capsys.readouterr().err


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
    assert all(float(row["peak_tensor_mib"]) > 0 for row in table.values())


def test_inference_times_the_onnx_export_per_batch_size_and_the_first_call(tmp_path, capsys):
    """``--inference`` with several ``--batch`` sizes: a table each (with the first call over the median), one CSV
    row per size and model, a plot per size; ``polar-onnx`` exports once and runs ONNX Runtime; the inference-only
    models are refused for training steps."""
    from polar_vit_hf.benchmarks import step_time

    argv = ["--preset", "demo", "--models", "euclidean", "polar-onnx", "--repeats", "1", "--warmup", "1"]
    argv += ["--threads", "1", "--inference", "--batch", "1", "3", "--out", str(tmp_path)]
    assert step_time.main(argv) == 0
    out = capsys.readouterr().out
    assert "batch 1, inference" in out and "batch 3, inference" in out and "Polar-ViT, ONNX Runtime" in out
    with open(tmp_path / "step_time.csv") as handle:
        rows = [(row["batch"], row["model"]) for row in csv.DictReader(handle)]
    assert rows == [("1", "euclidean"), ("1", "polar-onnx"), ("3", "euclidean"), ("3", "polar-onnx")]
    assert len(list((tmp_path / "onnx").glob("*.onnx"))) == 1  # exported once, by the first worker
    assert all((tmp_path / f"step_time_b{batch}.png").stat().st_size > 0 for batch in (1, 3))
    for model in step_time.INFERENCE_ONLY:
        assert step_time.main(["--models", model]) == 2
        assert "is an inference model: add --inference" in capsys.readouterr().err


def test_cuda_graph_replays_are_refused_without_a_gpu_and_reach_every_worker(capsys):
    from polar_vit_hf.benchmarks import step_time

    assert step_time.main(["--cuda-graph"]) == 2
    assert "--cuda-graph needs --device cuda" in capsys.readouterr().err
    args = step_time.parser().parse_args(["--device", "cuda", "--cuda-graph"])
    assert "--cuda-graph" in step_time.worker_command(args, "polar")


def test_the_step_profile_prints_operators_and_layer_kinds(tmp_path, capsys):
    from polar_vit_hf.benchmarks import profile_step

    threads = str(torch.get_num_threads())  # (set in this process: the suite's own count)
    arguments = ["--preset", "demo", "--batch", "4", "--threads", threads, "--top", "60", "--out", str(tmp_path)]
    assert profile_step.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "aten::mm" in printed and "Polar-FC" in printed and "gyro layer norm" in printed
    with open(tmp_path / "layers.csv") as handle:
        kinds = {row["layer_kind"]: float(row["forward_ms"]) for row in csv.DictReader(handle)}
    assert {"Polar-FC", "attention (scores, softmax, centroid, projections)", "residual"} <= set(kinds)
    assert all(ms > 0 for ms in kinds.values())
    assert (tmp_path / "trace.json").stat().st_size > 0 and (tmp_path / "layers.png").stat().st_size > 0
    assert (tmp_path / "kernels.csv").read_text().startswith("fused_layer,kernel_ms,calls")
    # the wall clock without the profiler: every fused Function's time, its Polar-FC products inside it
    assert "wall clock without the profiler" in printed and "outside the fused Functions" in printed
    with open(tmp_path / "wall.csv") as handle:
        wall = {row["function"]: row for row in csv.DictReader(handle)}
    fused = {"FusedPolarFC", "FusedPolarFCBackward", "FusedPolarAttentionHeads", "FusedPolarAttentionHeadsBackward"}
    assert fused <= set(wall)
    for name in ("FusedPolarFC", "FusedPolarFCBackward"):
        assert float(wall[name]["wall_ms"]) > float(wall[name]["product_ms"]) > 0


def test_the_layer_labels_leave_what_runs_unchanged(monkeypatch):
    """The profile's layer ranges change nothing that runs (the attention's three projections stay one stacked
    Polar-FC), they appear in the profile, and undoing them leaves the modules as they were."""
    import torch
    from torch.profiler import profile

    import polar_vit_hf as P
    from polar_vit_hf.benchmarks import profile_step
    from polar_vit_hf.modeling import fused_layers

    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", num_labels=3)).eval()
    pixels = torch.randn(2, model.config.num_channels, model.config.image_size, model.config.image_size)
    calls: list[tuple[int, ...]] = []
    apply = fused_layers.FusedPolarFC.apply
    monkeypatch.setattr(fused_layers.FusedPolarFC, "apply", lambda *a: calls.append(tuple(a[1].shape)) or apply(*a))

    def polar_fc_calls() -> list[tuple[int, ...]]:
        calls.clear()
        with torch.no_grad():
            model(pixel_values=pixels)
        return list(calls)

    plain = polar_fc_calls()
    undo = profile_step.label_modules(model)
    with profile() as prof:
        labelled = polar_fc_calls()
    for restore in undo:
        restore()
    assert labelled == plain
    assert {"layer::Polar-FC", "layer::gyro layer norm"} <= {event.name for event in prof.events()}
    assert not any("forward" in vars(module) for module in model.modules())


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


def test_layer_ab_times_every_fused_function_of_both_trees_in_turns(tmp_path, capsys):
    """``layer_ab.py``: the base tree's ``modeling/`` runs beside this one in one process, with this model's weights;
    a base whose direct concatenation sleeps 10 ms per forward reads as that row's change, and the gradients as the
    same bit for bit."""
    import shutil
    from pathlib import Path

    from polar_vit_hf.benchmarks import layer_ab

    repo = Path(layer_ab.__file__).resolve().parents[1]
    base = tmp_path / "base-tree"
    shutil.copytree(repo / "modeling", base / "modeling", ignore=shutil.ignore_patterns("__pycache__"))
    with open(base / "modeling" / "fused_layers.py", "a") as handle:
        handle.write(
            "\n\nimport time as _time\n_forward = FusedDirectConcat.forward\n\n\n"
            "def _slow(ctx, *args):\n    _time.sleep(0.01)\n    return _forward(ctx, *args)\n\n\n"
            "FusedDirectConcat.forward = staticmethod(_slow)\n"
        )
    argv = ["--base", str(base), "--batch", "2", "--rounds", "2", "--steps", "1", "--threads", "1"]
    assert layer_ab.main([*argv, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "gradients: bit for bit the same as the base's, every parameter" in out
    with open(tmp_path / "out" / "layer_ab.csv") as handle:
        table = {row["row"]: row for row in csv.DictReader(handle)}
    assert {"whole step", "FusedPolarFC", "FusedPolarFCBackward", "FusedDirectConcat", "FusedGyroLayerNorm"} <= set(
        table
    )
    concat = table["FusedDirectConcat"]
    layers = 9  # tiny-cifar: one concatenation of the heads per layer
    assert float(concat["base_ms"]) >= 10 * layers and float(concat["ratio_median"]) < 0.5
    # (the whole step's difference is not asserted: two single-step rounds on a busy machine spread by more)
    assert float(table["whole step"]["base_ms"]) > float(concat["base_ms"])
    assert float(table["FusedPolarFC"]["kernel_ms"]) == 0.0  # the compiled kernels are off in the tests
    assert (tmp_path / "out" / "layer_ab.png").stat().st_size > 0
    assert layer_ab.main(["--base", "no-such-revision"]) == 2
    assert "--base no-such-revision: not a source tree" in capsys.readouterr().err


def test_layer_ab_names_the_parameter_whose_gradients_differ_most():
    """``gradient_gap``: zero for a twin with the same weights (same random state for stochastic depth), else the
    largest relative difference and where it is."""
    import torch

    import polar_vit_hf as P
    from polar_vit_hf.benchmarks import layer_ab

    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset("tiny-cifar", num_labels=10)
    model = P.PolarViTForImageClassification(config).train()
    same = layer_ab.twin(model, P.modeling)
    batch = layer_ab.Batch(torch.randn(2, 3, 32, 32), torch.tensor([1, 2]), seed=3)
    assert layer_ab.gradient_gap((model, same), batch) == (0.0, "")
    with torch.no_grad():
        next(same.classifier.parameters()).mul_(1.5)  # the twin is a copy: the model keeps its weights
    gap, name = layer_ab.gradient_gap((model, same), batch)
    assert gap > 1e-3 and name in dict(model.named_parameters())


def test_the_wall_clock_names_each_generic_kernel_function_by_what_it_runs():
    """``timed_functions``: the ambient position encodings run through the generic ``LeadingColumnsFunction``;
    their rows carry the function each call runs, forward and backward."""
    import torch

    import polar_vit_hf as P
    from polar_vit_hf.benchmarks import profile_step

    config = P.PolarViTConfig.from_preset("tiny-cifar", num_labels=10)
    config.arithmetic = "ambient"
    model = P.PolarViTForImageClassification(config).train()
    totals: dict[str, list[float]] = {}
    with profile_step.timed_functions(totals):
        model(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([1, 2])).loss.backward()
    assert {
        "FusedAmbientGyroLayerNorm",
        "FusedAmbientGyroLayerNormBackward",
        "FusedBoostResidual",
        "FusedBoostResidualBackward",
        "LeadingColumnsFunction[ambient_relative_position]",
        "LeadingColumnsFunctionBackward[ambient_relative_position]",
        "FusedAmbientFCOutput",
        "FusedAmbientFCOutputBackward",
        "FusedAmbientAttentionHeads",
    } <= set(totals)
    assert not any(name.startswith("LeadingColumnsFunction") and "[" not in name for name in totals)


def test_the_group_size_benchmark_steps_each_setting_with_its_blocks(tmp_path, capsys, monkeypatch):
    """``benchmarks/attention_groups.py`` runs every setting on the model (the fused core cuts its slices into as
    many blocks as the setting asks: 4 heads of 12 per block at 2^10 score elements, a whole sample at 2^12) and
    reports each setting's ratio to the first."""
    from polar_vit_hf.benchmarks import attention_groups
    from polar_vit_hf.modeling import fused_attention

    blocks_per_call: list[int] = []
    real_blocks = fused_attention._blocks

    def counted(queries, keys):
        pairs, blocks = real_blocks(queries, keys)
        blocks_per_call.append(len(blocks))
        return pairs, blocks

    monkeypatch.setattr(fused_attention, "_blocks", counted)
    threads = str(torch.get_num_threads())  # (set in this process: the suite's own count)
    arguments = ["--shapes", "16x2", "--exponents", "10", "12", "--rounds", "1", "--threads", threads]
    assert attention_groups.main([*arguments, "--out", str(tmp_path)]) == 0
    assert set(blocks_per_call) == {2 * 3, 2}  # 2 samples of 12 heads of 16 x 16 pairs: 3 blocks each, or 1
    printed = capsys.readouterr().out
    assert re.search(r"\s16\s+2\s+2\^10\s+\d+\s+1\.000x", printed) and re.search(r"\s16\s+2\s+2\^12\s", printed)
    with open(tmp_path / "attention_groups.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["tokens"], row["exponent"]) for row in rows] == [("16", "10"), ("16", "12")]
    assert (tmp_path / "attention_groups.png").stat().st_size > 0
