"""``benchmarks/peers.py``: the side-by-side benchmark with the public Lorentz ViTs runs and reports what it claims
(the peers themselves need their checkouts, which the suite does not have; their loaders refuse other folders)."""

from __future__ import annotations

import csv

import pytest
import torch

from polar_vit_hf.benchmarks import peers, step_time


def test_the_distance_table_shows_polar_exact_and_ambient_off_at_every_radius():
    rows = peers.distance_rows([1.0, 4.0, 12.0], {}, angle=1e-3, pairs=8)
    for row in rows:
        assert set(row.errors) == {"Polar-ViT polar", "Polar-ViT ambient"}
        assert row.errors["Polar-ViT polar"] < 1e-6  # float32 polar: a few ulp at every radius
        assert row.errors["Polar-ViT ambient"] > 1e-3  # ambient coordinates cannot resolve 1e-3 rad


def test_a_peer_classifier_trains_like_a_transformers_model():
    network = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))
    model = peers.PeerClassifier(network)
    out = model(pixel_values=torch.randn(2, 3, 4, 4), labels=torch.tensor([0, 3]))
    out.loss.backward()
    assert out.logits.shape == (2, 5) and network[1].weight.grad is not None
    assert model(pixel_values=torch.randn(1, 3, 4, 4)).loss is None


def test_peer_loaders_refuse_a_folder_that_is_not_their_checkout(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a HyperCore checkout"):
        peers.hypercore_modules(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a HexFormer checkout"):
        peers.hexformer_modules(tmp_path)
    with pytest.raises(ValueError, match="unknown peer"):
        peers.peer_distance("lvit", tmp_path)


def test_step_time_asks_for_the_checkout_of_a_peer(capsys):
    assert step_time.main(["--models", "euclidean", "hypercore"]) == 2
    assert "--models hypercore needs --hypercore DIR" in capsys.readouterr().err


def test_profile_step_asks_for_the_checkout_of_a_peer(capsys, tmp_path):
    from polar_vit_hf.benchmarks import profile_step

    assert profile_step.main(["--model", "hexformer", "--out", str(tmp_path)]) == 2
    assert "--model hexformer needs --hexformer DIR" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not a HyperCore checkout"):
        profile_step.main(["--model", "hypercore", "--hypercore", str(tmp_path), "--out", str(tmp_path)])


@pytest.mark.slow
def test_peers_without_checkouts_times_the_three_own_models_and_writes_its_tables(tmp_path, capsys):
    code = peers.main(
        ["--batches", "2", "--repeats", "1", "--threads", "1", "--radii", "1", "8", "--out", str(tmp_path)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "b2: ms, x ViT" in out and "float32 distance between two points" in out
    with open(tmp_path / "peers.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [row["model"] for row in table] == ["euclidean", "polar", "ambient"]
    assert float(table[0]["vs_vit"]) == 1.0 and all(float(row["median_s"]) > 0 for row in table)
    assert all(float(row["peak_tensor_mib"]) > 0 for row in table)
    assert "peak memory x ViT: RSS, tensors" in out
    with open(tmp_path / "distance_error.csv") as handle:
        assert [float(row["radius"]) for row in csv.DictReader(handle)] == [1.0, 8.0]
    assert (tmp_path / "peers.png").stat().st_size > 0
