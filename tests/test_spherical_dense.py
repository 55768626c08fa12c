"""Dense prediction on the sphere: the projection convolution (SO(3)-RoPE Def. 5), the dense Polar-ViT and its
Euclidean twin, their equivariance, saving and loading (float64 where exactness is tested)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import LEVEL, spherical_config
from transformers import AutoModelForImageToImage

import polar_vit_hf as P
from polar_vit_hf.baselines import euclidean_spherical_dense_vit, euclidean_spherical_vit
from polar_vit_hf.modeling import spherical as S


def dense_config(**overrides) -> P.PolarViTSphericalConfig:
    return spherical_config(**{"num_channels": 3, "num_output_channels": 2, **overrides})


def fields(channels: int, batch: int = 2, seed: int = 0, level: int = LEVEL) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, 10 * 4**level + 2, dtype=torch.float64, generator=generator)


# ------------------------------------------------------------------------------------------ the projection (Def. 5)
@pytest.mark.parametrize("level,patch_level", [(1, 0), (2, 0), (3, 1), (3, 3)])
def test_projection_is_the_adjoint_of_the_lifting_in_the_multiplicity_weighted_inner_product(level, patch_level):
    channels = 3
    f = fields(channels, level=level)
    lifted = S.lift_patches(f, level, patch_level)
    g = torch.randn(lifted.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    projected = S.project_patches(g, level, patch_level)
    weight = S.vertex_multiplicity(level, patch_level)
    assert projected.shape == f.shape
    left, right = (lifted * g).sum(), (f * weight * projected).sum()
    assert abs(left - right) <= 1e-12 * abs(left).clamp_min(1)


def test_projection_of_the_lifting_returns_the_signal_and_every_vertex_is_read():
    f = fields(2, level=3)
    for patch_level in range(4):
        recovered = S.project_patches(S.lift_patches(f, 3, patch_level), 3, patch_level)
        assert (recovered - f).abs().max() <= 4e-16 * f.abs().max()  # a mean of equal values, to rounding
        multiplicity = S.vertex_multiplicity(3, patch_level)
        assert multiplicity.min() >= 3 and (multiplicity % 3 == 0).all()  # three orientations of every patch


def token_permutation(rotation: torch.Tensor, level: int, patch_level: int) -> torch.Tensor:
    """``perm`` with ``R_{perm[t]} = G R_t``: where the rotation moves each token."""
    poses = S.token_poses(level, patch_level).reshape(-1, 9)
    rotated = (rotation @ S.token_poses(level, patch_level)).reshape(-1, 9)
    error, perm = torch.cdist(rotated, poses, compute_mode="donot_use_mm_for_euclid_dist").min(-1)
    assert error.max() < 1e-13
    return perm


def test_projection_rotates_with_the_tokens():
    level, patch_level = 3, 1
    tokens = 60 * 4**patch_level
    g = torch.randn(2, tokens, 2 * 15, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for rotation in S.icosahedral_rotations():
        rotated_tokens = torch.empty_like(g)
        rotated_tokens[:, token_permutation(rotation, level, patch_level)] = g
        expected = S.rotate_signal(S.project_patches(g, level, patch_level), rotation, level)
        assert (S.project_patches(rotated_tokens, level, patch_level) - expected).abs().max() < 1e-14


def test_quadrature_weights_sum_to_one_and_integrate_low_degree_polynomials():
    for level in (1, 3):
        weights = S.vertex_areas(level)
        z = S.icosphere(level)[:, 2]
        assert abs(weights.sum() - 1) < 1e-14 and weights.min() > 0
        assert abs((weights * z).sum()) < 1e-14  # odd in z (the icosphere is symmetric under x -> -x)
        assert abs((weights * z**2).sum() - 1 / 3) < 0.02 / 4**level  # the sphere's mean of z^2


# ------------------------------------------------------------------------------------------------ the dense models
def dense_model(kind: str = "polar", **overrides) -> torch.nn.Module:
    config = dense_config(**overrides)
    if kind == "euclidean":
        return euclidean_spherical_dense_vit(config).double().eval()
    model = P.PolarViTSphericalForDensePrediction(config).double().eval()
    if kind == "polar_ambient":
        model.set_arithmetic("ambient")
    return model


@pytest.mark.parametrize("kind", ["polar", "polar_reference", "polar_ambient", "euclidean"])
def test_predicted_fields_rotate_with_the_input_under_the_60_icosahedral_rotations(kind):
    model = dense_model(kind, **({"fused_ops": False} if kind == "polar_reference" else {}))
    x = fields(3)
    with torch.no_grad():
        out = model(pixel_values=x).logits
        assert out.shape == (2, 2, 162) and out.std() > 1e-4  # C_out fields per vertex, not a constant
        for rotation in S.icosahedral_rotations():
            rotated = model(pixel_values=S.rotate_signal(x, rotation, LEVEL)).logits
            assert (rotated - S.rotate_signal(out, rotation, LEVEL)).abs().max() < 1e-12


@pytest.mark.parametrize("kind", ["polar", "euclidean"])
def test_longitude_encoding_keeps_only_the_rotations_about_the_z_axis(kind):
    model = dense_model(kind, longitude_encoding=4)
    about_z = [g for g in S.icosahedral_rotations() if abs(g[2, 2] - 1) < 1e-12]
    assert len(about_z) == 2  # the identity and the half turn about z
    x = fields(3)
    with torch.no_grad():
        out = model(pixel_values=x).logits
        for rotation in about_z:
            rotated = model(pixel_values=S.rotate_signal(x, rotation, LEVEL)).logits
            assert (rotated - S.rotate_signal(out, rotation, LEVEL)).abs().max() < 1e-12
        tilted = S.icosahedral_rotations()[7]
        assert abs(tilted[2, 2] - 1) > 0.1
        change = model(pixel_values=S.rotate_signal(x, tilted, LEVEL)).logits - S.rotate_signal(out, tilted, LEVEL)
        assert change.abs().max() > 1e-6  # the encoding breaks the other rotations


def test_errors_and_loss_are_the_quadrature_weighted_l1_and_l2():
    model = dense_model()
    x, target = fields(3), fields(2, seed=1)
    with torch.no_grad():
        out = model(pixel_values=x, labels=target)
    weights = S.vertex_areas(LEVEL)
    difference = out.logits - target
    l1, l2 = S.sphere_errors(out.logits, target, LEVEL)
    assert torch.allclose(l1, (difference.abs() * weights).sum(-1).mean(), rtol=1e-14)
    assert torch.allclose(l2, (difference.square() * weights).sum(-1).sqrt().mean(), rtol=1e-14)
    assert torch.allclose(out.loss, (difference.square() * weights).sum(-1).mean(), rtol=1e-14)


def test_wrong_targets_get_a_clear_error():
    model = dense_model()
    with pytest.raises(ValueError, match=r"labels must be target fields \(batch, 2, 162\), got \(2, 3, 162\)"):
        model(pixel_values=fields(3), labels=fields(3))


@pytest.mark.parametrize("kind", ["polar", "euclidean"])
def test_gradients_reach_every_parameter_and_a_few_steps_fit_a_map(kind):
    torch.manual_seed(0)
    model = dense_model(kind).train()
    x = fields(3, batch=4)
    target = torch.stack([x[:, 0] - x[:, 2], 0.5 * x[:, 1]], dim=1)  # a vertex-wise map of the input
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = model(pixel_values=x, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        if not losses:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_saved_dense_model_reloads_by_auto_class_and_as_remote_code(tmp_path):
    model = dense_model().float()
    model.save_pretrained(tmp_path)
    x = fields(3).float()
    with torch.no_grad():
        expected = model(pixel_values=x).logits
    loaded = AutoModelForImageToImage.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, P.PolarViTSphericalForDensePrediction)
    with torch.no_grad():
        assert (loaded(pixel_values=x).logits - expected).abs().max() < 1e-6
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForImageToImage"] == "modeling_polar_vit.PolarViTSphericalForDensePrediction"
    torch.save({"x": x, "expected": expected}, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        sys.modules["polar_vit_hf"] = None  # the package is not importable: remote code only
        from transformers import AutoModelForImageToImage
        folder = {str(tmp_path)!r}
        model = AutoModelForImageToImage.from_pretrained(folder, trust_remote_code=True).eval()
        data = torch.load(folder + "/expected.pt")
        with torch.no_grad():
            error = (model(pixel_values=data["x"]).logits - data["expected"]).abs().max().item()
        print(type(model).__name__, type(model).__module__.startswith("transformers_modules"), error)
        """
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    name, remote, error = run.stdout.strip().splitlines()[-1].split()
    assert (name, remote) == ("PolarViTSphericalForDensePrediction", "True") and float(error) < 1e-6


def test_the_euclidean_twin_has_the_polar_models_shape():
    polar, euclidean = dense_model(), dense_model("euclidean")
    assert euclidean.projection.out_features == polar.projection.kernel.out_features == 2 * 15
    with torch.no_grad():
        assert euclidean(pixel_values=fields(3)).logits.shape == (2, 2, 162)
    vit = euclidean_spherical_vit(dense_config(position_embedding="learned", relative_position="none"))
    assert vit.position_embeddings is not None


@pytest.mark.parametrize("build", [euclidean_spherical_dense_vit, euclidean_spherical_vit])
def test_the_euclidean_models_reload_with_their_so3_attention(build, tmp_path):
    model = build(dense_config(num_labels=3)).eval()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == "so3_sdpa"
    x = fields(3).float()
    with torch.no_grad():
        assert (loaded(pixel_values=x).logits - model(pixel_values=x).logits).abs().max() < 1e-6


@pytest.mark.slow
def test_the_dense_model_exports_with_a_dynamic_batch_to_torch_export_and_onnx(tmp_path):
    from polar_vit_hf import deploy

    model = dense_model(longitude_encoding=2).float()
    program = deploy.export_program(model, deploy.ExportSpec(max_batch=8))
    torch.export.save(program, tmp_path / "fields.pt2")
    loaded = torch.export.load(tmp_path / "fields.pt2").module()
    onnx_path = deploy.save_onnx(program, tmp_path / "model.onnx")
    for batch in (1, 5):
        x = deploy.example_pixels(model.config, batch=batch, seed=batch)
        with torch.no_grad():
            expected = model(pixel_values=x).logits
        scale = expected.abs().max()
        assert (loaded(x) - expected).abs().max() <= 1e-5 * scale
        assert abs(deploy.onnx_logits(onnx_path, x) - expected.numpy()).max() <= 1e-5 * scale
