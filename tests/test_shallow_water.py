"""The shallow-water task: torch-harmonics' simulations on the icosphere, the training script and its benchmark."""

from __future__ import annotations

import json
import math

import pytest
import torch

from polar_vit_hf.benchmarks import shallow_water as bench
from polar_vit_hf.modeling import spherical as S
from polar_vit_hf.training import shallow_water as sw

TINY = ["--num_train", "16", "--num_eval", "8", "--width", "16", "--heads", "2", "--layers", "2", "--no_progress"]


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    """Simulations go to a folder of the test (``$POLAR_VIT_DATA``), as they would to the user's cache."""
    monkeypatch.setenv("POLAR_VIT_DATA", str(tmp_path / "data"))
    return tmp_path / "data" / "shallow-water"


def test_bilinear_resampling_is_exact_on_fields_bilinear_in_colatitude_and_longitude():
    nlat, nlon = 9, 16
    colatitude = torch.linspace(0, math.pi, nlat, dtype=torch.float64)
    longitude = torch.arange(nlon, dtype=torch.float64) * 2 * math.pi / nlon
    grid = (2.0 + 3.0 * colatitude)[:, None].expand(nlat, nlon)  # linear in colatitude
    vertices = S.icosphere(3)
    theta = torch.arccos(vertices[:, 2].clamp(-1, 1))
    assert (sw.grid_to_icosphere(grid, colatitude, vertices) - (2.0 + 3.0 * theta)).abs().max() < 1e-12
    zonal = torch.cos(longitude)[None].expand(nlat, nlon)
    phi = torch.atan2(vertices[:, 1], vertices[:, 0])
    sampled = sw.grid_to_icosphere(zonal, colatitude, vertices)
    assert (sampled - torch.cos(phi)).abs().max() < (2 * math.pi / nlon) ** 2 / 8 + 1e-12  # linear interpolation
    on_nodes = sw.grid_to_icosphere(grid, colatitude, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]]))
    assert torch.allclose(on_nodes, torch.tensor([2.0, 2.0 + 3.0 * math.pi], dtype=torch.float64))


def test_simulations_are_seeded_finite_and_move(data_cache):
    simulation = sw.Simulation(icosphere_level=1)
    first = sw.trajectories(simulation, 2, seed=3, length=2, progress=False)
    assert first.shape == (2, 3, 3, 42) and first.dtype == torch.float32 and torch.isfinite(first).all()
    assert torch.equal(first, sw.trajectories(simulation, 2, seed=3, length=2, progress=False))
    assert not torch.equal(first, sw.trajectories(simulation, 2, seed=4, length=2, progress=False))
    assert (first[:, 1] - first[:, 0]).abs().amax((0, 2)).min() > 0  # every channel changes in an hour
    inputs, targets = sw.load_split(simulation, "train", 2, seed=3)
    assert torch.equal(inputs, first[:, 0]) and torch.equal(targets, first[:, 1])
    assert [path.suffix for path in data_cache.iterdir()] == [".safetensors"]


def test_cached_simulations_are_read_not_generated_again(data_cache, monkeypatch):
    simulation = sw.Simulation(icosphere_level=1)
    inputs, _ = sw.load_split(simulation, "eval", 2, seed=0)
    monkeypatch.setattr(sw, "simulate", lambda *args: pytest.fail("generated again"))
    assert torch.equal(sw.load_split(simulation, "eval", 2, seed=0)[0], inputs)
    other = sw.Simulation(icosphere_level=1, dt=1800.0)
    assert other.key("eval", 2, 0) != simulation.key("eval", 2, 0)


def test_normalisation_maps_the_training_inputs_to_zero_mean_unit_variance():
    scale, offset = torch.tensor([1e2, 8e-7, 9e-7]), torch.tensor([9.8e4, 2e-8, 1e-7])  # phi, vorticity, divergence
    inputs = torch.randn(10, 3, 42, dtype=torch.float64) * scale[:, None] + offset[:, None]
    normalization = sw.Normalization.of(inputs)
    mapped = normalization(inputs).transpose(0, 1).flatten(1)
    assert mapped.mean(1).abs().max() < 1e-12 and (mapped.std(1) - 1).abs().max() < 1e-12


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--width", "30", "--heads", "4"], "--width 30 must be a multiple of --heads 4"),
        (["--patch_level", "3"], "need 0 <= --patch_level <= --icosphere_level <= 6"),
        (["--max_steps", "0"], "--max_steps must be >= 1"),
        (["--dt", "1000"], "--dt must be a positive multiple of the solver's step 150 s"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, tmp_path, capsys):
    assert sw.main(["--output_dir", str(tmp_path / "run"), *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("shallow_water: error: ") and message in error and "\n" not in error


@pytest.mark.slow
def test_a_20_step_run_writes_its_folder_reloads_and_resumes_exactly(tmp_path, capsys):
    from transformers import AutoModelForImageToImage

    import polar_vit_hf as P

    out = tmp_path / "run"
    argv = ["--model", "polar", "--output_dir", str(out), "--max_steps", "20", "--save_steps", "10", *TINY]
    assert sw.main(argv) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_l2"] > 0 and results["eval_l1"] > 0
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,epoch,loss") and len(rows) >= 20
    model = AutoModelForImageToImage.from_pretrained(out).eval()
    assert isinstance(model, P.PolarViTSphericalForDensePrediction)
    normalization = sw.Normalization(**json.loads((out / "normalization.json").read_text()))
    inputs, targets = sw.load_split(sw.Simulation(), "eval", 8, seed=1)  # the script's held-out simulations
    with torch.no_grad():
        predicted = model(pixel_values=normalization(inputs)).logits
    l1, l2 = S.sphere_errors(predicted, normalization(targets), 2)
    assert abs(float(l2) - results["eval_l2"]) < 1e-5 and abs(float(l1) - results["eval_l1"]) < 1e-5
    assert sw.main(argv) == 2  # a finished run is not overwritten
    assert "pass --resume_from_checkpoint" in capsys.readouterr().err
    assert sw.main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-10")]) == 0
    resumed = json.loads((out / "eval_results.json").read_text())
    assert abs(resumed["eval_l2"] - results["eval_l2"]) < 1e-6


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end(tmp_path, capsys):
    argv = ["--quick", "--steps", "3", "--num_train", "16", "--num_eval", "8", "--width", "16", "--heads", "2"]
    assert bench.main([*argv, "--layers", "1", "--rollout", "2", "--repeats", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in bench.MODELS.values():
        assert name in out
    rows = (tmp_path / "shallow_water.csv").read_text().splitlines()
    assert len(rows) == 1 + len(bench.MODELS)
    assert all(float(row.split(",")[-1]) < 1e-6 for row in rows[1:])  # the reloaded models predict the same
    for image in ("error_maps.png", "rollout.png"):
        assert (tmp_path / image).stat().st_size > 0
