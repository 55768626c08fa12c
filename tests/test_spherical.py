"""Spherical inputs: icosphere tokenisation, SO(3)-RoPE in Polar-ViT and in the Euclidean baseline (float64)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import LEVEL, PATCH_LEVEL, spherical_config
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification, pipeline
from transformers.dynamic_module_utils import get_imports

import polar_vit_hf as P
from polar_vit_hf.baselines import euclidean_spherical_vit, so3_sdpa_attention
from polar_vit_hf.geometry import distance
from polar_vit_hf.modeling import spherical as S
from polar_vit_hf.modeling.spherical import random_rotations


# ---------------------------------------------------------------------------------------------------- tokenisation
@pytest.mark.parametrize("level", range(5))
def test_icosphere_has_10_4s_plus_2_unit_vertices_and_every_one_is_in_a_patch(level):
    for patch_level in range(level + 1):
        vertices, index, corners = S.icosphere_patches(level, patch_level)
        side = 2 ** (level - patch_level)
        assert vertices.shape == (10 * 4**level + 2, 3)
        assert torch.allclose(vertices.norm(dim=-1), torch.ones(()).double(), atol=1e-15)
        assert index.shape == (3 * 20 * 4**patch_level, (side + 1) * (side + 2) // 2)
        assert index.unique().numel() == vertices.shape[0]
        assert torch.equal(index[:, 0], corners[:, 0])  # slot (n, 0, 0) is the orientation's first corner
        assert torch.equal(vertices, S.icosphere(level))  # one vertex order whatever the patch level


def test_icosahedral_group_has_60_rotations_closed_under_products():
    group = S.icosahedral_rotations()
    assert group.shape == (60, 3, 3)
    eye = torch.eye(3, dtype=torch.float64)
    assert (group @ group.transpose(1, 2) - eye).abs().max() < 1e-14
    assert (torch.det(group) - 1).abs().max() < 1e-14
    flat = group.reshape(60, 9)
    assert torch.cdist(flat, flat).add(eye.new_ones(60).diag() * 9).min() > 0.1  # distinct
    products = (group[:, None] @ group[None]).reshape(-1, 9)
    assert torch.cdist(products, flat, compute_mode="donot_use_mm_for_euclid_dist").min(-1).values.max() < 1e-12


@pytest.mark.parametrize("level,patch_level", [(2, 0), (3, 1)])
def test_icosahedral_rotations_permute_tokens_and_their_poses_exactly(level, patch_level):
    vertices, index, _ = S.icosphere_patches(level, patch_level)
    poses = S.token_poses(level, patch_level)
    assert (poses.transpose(1, 2) @ poses - torch.eye(3, dtype=torch.float64)).abs().max() < 1e-14
    for rotation in S.icosahedral_rotations():
        moved = S.vertex_permutation(rotation, vertices)
        rotated = (rotation @ poses).reshape(-1, 9)
        error, token = torch.cdist(rotated, poses.reshape(-1, 9), compute_mode="donot_use_mm_for_euclid_dist").min(-1)
        assert error.max() < 1e-13  # R_{G t} = G R_t
        assert token.unique().numel() == poses.shape[0]
        assert torch.equal(moved[index], index[token])  # slot j of token t lands on slot j of token G t


def test_a_rotation_that_is_not_a_symmetry_is_refused():
    with pytest.raises(ValueError, match="does not map the icosphere onto itself"):
        S.vertex_permutation(random_rotations(1)[0], S.icosphere(1))


def test_euler_zyz_round_trip():
    rotations = torch.cat([random_rotations(50), S.token_poses(2, 0)])
    assert (S.matrix_zyz(S.euler_zyz(rotations)) - rotations).abs().max() < 1e-13


# -------------------------------------------------------------------------------------------------- representation
@pytest.mark.parametrize("head_dim", [4, 8, 9, 16, 25])
def test_wigner_representation_is_orthogonal_and_a_homomorphism(head_dim):
    u, v = random_rotations(20, seed=1), random_rotations(20, seed=2)
    pi_u, pi_v, pi_uv = (S.so3_representation(r, head_dim) for r in (u, v, u @ v))
    m = (S.wigner_degree(head_dim) + 1) ** 2
    assert m <= head_dim < (S.wigner_degree(head_dim) + 2) ** 2
    assert pi_u.shape == (20, m, m)
    eye = torch.eye(m, dtype=torch.float64)
    assert (pi_u.transpose(1, 2) @ pi_u - eye).abs().max() < 1e-12
    assert (pi_u @ pi_v - pi_uv).abs().max() < 1e-12
    assert (pi_u[:, 0, 0] - 1).abs().max() < 1e-15  # D^0 is trivial
    assert (S.so3_representation(torch.eye(3, dtype=torch.float64)[None], head_dim) - eye).abs().max() < 1e-13


def rope_inputs(head_dim: int, heads: int = 2, tokens: int = 7, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 3, tokens, heads, head_dim, dtype=torch.float64, generator=generator)
    return q, k, random_rotations(tokens, seed), random_rotations(1, seed + 100)[0]


@pytest.mark.parametrize("head_dim", [4, 11, 16])
def test_euclidean_scores_depend_on_relative_poses_only(head_dim):
    q, k, poses, g = rope_inputs(head_dim)

    def scores(poses):
        rope = S.so3_representation(poses, head_dim)
        return torch.einsum("bnhd,bmhd->bhnm", S.apply_so3_rope(q, rope), S.apply_so3_rope(k, rope))

    assert (scores(g @ poses) - scores(poses)).abs().max() < 1e-12
    assert (scores(random_rotations(7, seed=9)) - scores(poses)).abs().max() > 1e-2  # poses do matter


@pytest.mark.parametrize("head_dim", [4, 11, 16])
@pytest.mark.parametrize("radius", [0.0, 0.5, 4.0, 8.0, 12.0])
def test_polar_distances_depend_on_relative_poses_only(head_dim, radius):
    q, k, poses, g = rope_inputs(head_dim)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    rq = torch.full(q.shape[:-1], radius, dtype=torch.float64)
    rk = rq + torch.linspace(0, 1, k.shape[1], dtype=torch.float64)[:, None]

    def distances(poses):
        rope = S.so3_representation(poses, head_dim)
        qu, ku = S.apply_so3_rope(q, rope), S.apply_so3_rope(k, rope)
        return distance(rq[:, :, None], qu[:, :, None], rk[:, None], ku[:, None])

    base = distances(poses)
    assert (distances(g @ poses) - base).abs().max() <= 1e-12 * (1 + base.abs().max())
    # pi(U)^T pi(V) = pi(U^-1 V): d(pi(U) q, pi(V) k) = d(q, pi(U^-1 V) k)
    rope = S.so3_representation(poses, head_dim)
    relative = S.so3_representation(poses[:, None].transpose(-1, -2) @ poses[None], head_dim)  # (N, N, m, m)
    m = rope.shape[-1]
    moved = torch.einsum("nmij,bmhj->bnmhi", relative, k[..., :m])
    moved = torch.cat([moved, k[..., m:].unsqueeze(1).expand(-1, k.shape[1], -1, -1, -1)], dim=-1)
    direct = distance(rq[:, :, None], q[:, :, None], rk[:, None], moved)
    assert (direct - base).abs().max() <= 1e-12 * (1 + base.abs().max())


def test_rope_keeps_directions_unit_and_has_the_identity_gradient_structure():
    q, _, poses, _ = rope_inputs(16, tokens=5)
    q = q / q.norm(dim=-1, keepdim=True)
    rope = S.so3_representation(poses, 16)
    assert (S.apply_so3_rope(q, rope).norm(dim=-1) - 1).abs().max() < 1e-14
    assert torch.autograd.gradcheck(lambda x: S.apply_so3_rope(x, rope), (q.clone().requires_grad_(),))
    layer = P.modeling.modeling_polar_vit.SO3RotaryEncoding()
    points = torch.cat(
        [torch.tensor([0.0, 0.5, 4.0, 8.0, 12.0], dtype=torch.float64).repeat(6)[:30].reshape(3, 5, 2, 1), q], dim=-1
    ).requires_grad_()
    ops = P.modeling.manifold_ops.make_ops("polar", 1.0, False)
    assert torch.autograd.gradcheck(lambda p: layer(p, rope[1:], 1, ops), (points,))
    moved = layer(points, rope[1:], 1, ops)
    assert torch.equal(moved[:, 0], points[:, 0])  # the prefix (class) token is not moved
    assert torch.equal(moved[..., 0], points[..., 0])  # radii untouched


def test_so3_sdpa_attention_rotates_queries_and_keys_before_sdpa():
    q, k, poses, g = rope_inputs(16, tokens=6)
    value = torch.eye(6, dtype=torch.float64).expand(3, 2, 6, 6)  # (B, H, N, N): the output is the attention matrix
    module = torch.nn.Module()
    module.is_causal = False

    def probs(poses):
        rope = S.so3_representation(poses, 16)
        out, _ = so3_sdpa_attention(
            module, q.transpose(1, 2), k.transpose(1, 2), value, None, so3_rope=rope, scaling=0.25, dropout=0.0
        )
        return out

    reference = torch.softmax(
        torch.einsum("bnhd,bmhd->bhnm", *(S.apply_so3_rope(t, S.so3_representation(poses, 16)) for t in (q, k)))
        * 0.25,
        -1,
    )
    assert (probs(poses) - reference.transpose(1, 2)).abs().max() < 1e-12
    assert (probs(g @ poses) - probs(poses)).abs().max() < 1e-12


# ------------------------------------------------------------------------------------------------------ the models
def polar_model(**overrides) -> P.PolarViTSphericalForImageClassification:
    return P.PolarViTSphericalForImageClassification(spherical_config(**overrides)).double().eval()


def signal(config, batch: int = 2, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.num_channels, config.num_vertices, dtype=torch.float64, generator=generator)


def all_rotations_of(x: torch.Tensor, level: int) -> torch.Tensor:
    """``(60 B, C, V)``: the signal under every icosahedral rotation."""
    return torch.cat([S.rotate_signal(x, rotation, level) for rotation in S.icosahedral_rotations()])


@pytest.mark.parametrize("kind", ["polar", "polar_reference", "polar_ambient", "euclidean"])
def test_logits_are_invariant_under_the_60_icosahedral_rotations(kind):
    config = spherical_config()
    if kind == "euclidean":
        model = euclidean_spherical_vit(config).double().eval()
    else:
        model = polar_model(fused_ops=kind != "polar_reference")
        if kind == "polar_ambient":
            model.set_arithmetic("ambient")
    x = signal(config)
    with torch.no_grad():
        logits = model(pixel_values=x).logits
        rotated = model(pixel_values=all_rotations_of(x, LEVEL)).logits.reshape(60, *logits.shape)
    assert (rotated - logits).abs().max() < 1e-10
    assert logits.std() > 1e-4  # not a constant model


def test_without_so3_rope_or_with_absolute_positions_the_rotations_change_the_logits():
    config = spherical_config()
    x = signal(config)
    rotation = S.icosahedral_rotations()[7]
    for overrides in (dict(position_embedding="learned"), dict(longitude_encoding=3)):
        model = polar_model(**overrides)
        with torch.no_grad():
            change = model(pixel_values=S.rotate_signal(x, rotation, LEVEL)).logits - model(pixel_values=x).logits
        assert change.abs().max() > 1e-6, overrides


def test_longitude_encoding_keeps_the_rotations_about_the_z_axis():
    group = S.icosahedral_rotations()
    about_z = [g for g in group if abs(g[2, 2] - 1) < 1e-12 and not torch.allclose(g, torch.eye(3).double())]
    assert about_z  # the half turn about z is a symmetry of this icosahedron
    model = polar_model(longitude_encoding=4)
    x = signal(model.config)
    with torch.no_grad():
        logits = model(pixel_values=x).logits
        for rotation in about_z:
            assert (model(pixel_values=S.rotate_signal(x, rotation, LEVEL)).logits - logits).abs().max() < 1e-10


def test_a_global_rotation_of_every_pose_leaves_every_attention_score_unchanged(monkeypatch):
    model = polar_model(num_hidden_layers=1)
    euclid = euclidean_spherical_vit(model.config).double().eval()
    x = signal(model.config)
    with torch.no_grad():
        attentions = model(pixel_values=x, output_attentions=True).attentions[0]
        logits = euclid(pixel_values=x).logits
    for g in random_rotations(3, seed=5):
        rope = S.so3_representation(g @ S.token_poses(LEVEL, PATCH_LEVEL), model.config.head_dim)
        monkeypatch.setattr(type(model.polar_vit.embeddings), "rope", lambda self, dtype, rope=rope: rope)
        monkeypatch.setattr(type(euclid), "rope", lambda self, dtype, rope=rope: rope)
        with torch.no_grad():
            assert (model(pixel_values=x, output_attentions=True).attentions[0] - attentions).abs().max() < 1e-12
            assert (euclid(pixel_values=x).logits - logits).abs().max() < 1e-12


def test_polar_and_ambient_arithmetic_agree_with_so3_rope():
    model = polar_model()
    x = signal(model.config)
    polar = model(pixel_values=x, labels=torch.tensor([1, 3]))
    polar.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.set_arithmetic("ambient")
    ambient = model(pixel_values=x, labels=torch.tensor([1, 3]))
    ambient.loss.backward()
    assert (ambient.logits - polar.logits).abs().max() <= 1e-10 * polar.logits.abs().max()
    for name, p in model.named_parameters():
        assert (p.grad - grads[name]).abs().max() <= 1e-10 * (1 + grads[name].abs().max()), name


def test_fused_and_reference_layers_agree_with_so3_rope():
    reference = polar_model(fused_ops=False, readout="cls")
    fused = polar_model(fused_ops=True, readout="cls")
    fused.load_state_dict(reference.state_dict())
    x = signal(reference.config)
    outputs = [m(pixel_values=x, labels=torch.tensor([0, 4])) for m in (reference, fused)]
    for output in outputs:
        output.loss.backward()
    assert (outputs[0].logits - outputs[1].logits).abs().max() <= 1e-10 * outputs[0].logits.abs().max()
    for (name, a), b in zip(reference.named_parameters(), fused.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-10 * (1 + a.grad.abs().max()), name


@pytest.mark.parametrize("kind", ["polar", "euclidean"])
def test_spherical_models_learn(kind):
    torch.manual_seed(0)
    config = spherical_config(num_labels=2, num_channels=1)
    model = (
        P.PolarViTSphericalForImageClassification(config) if kind == "polar" else euclidean_spherical_vit(config)
    ).train()
    z = S.icosphere(LEVEL)[:, 2].float()
    # a dipole vs a quadrupole (not rotations of each other: an invariant model can tell them apart)
    x = torch.stack([z, 1.5 * z**2 - 0.5])[:, None].repeat(4, 1, 1) + 0.1 * torch.randn(8, 1, z.numel())
    labels = torch.tensor([0, 1]).repeat(4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = model(pixel_values=x, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ----------------------------------------------------------------------------------------------- config and checks
@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(relative_position="horoshift"), "planar patch grid"),
        (dict(position_embedding="sincos"), "planar patch grid"),
        (dict(patch_level=3), "patch_level=3 must be <= icosphere_level=2"),
        (dict(icosphere_level=-1), "icosphere_level must be an integer >= 0"),
        (dict(longitude_encoding=1.5), "longitude_encoding must be an integer"),
        (dict(hidden_size=6, num_attention_heads=2), "Wigner blocks D\\^0 and D\\^1"),
    ],
)
def test_invalid_spherical_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        spherical_config(**overrides)


def test_planar_configs_refuse_so3():
    with pytest.raises(ValueError, match="needs spherical inputs, use PolarViTSphericalConfig"):
        P.PolarViTConfig.from_preset("demo", relative_position="so3")


@pytest.mark.parametrize(
    "shape,message",
    [
        ((2, 2, 16, 16), "must have shape \\(batch, channels, vertices\\)"),
        ((2, 3, 162), "3 channels but the model expects num_channels=2"),
        ((2, 2, 642), "642 values per channel but icosphere_level=2 has 162 vertices"),
    ],
)
def test_wrong_inputs_get_a_clear_error(shape, message):
    model = polar_model()
    with pytest.raises(ValueError, match=message):
        model(pixel_values=torch.zeros(shape, dtype=torch.float64))


def test_non_finite_and_unnormalised_signals_are_refused():
    model = polar_model()
    x = signal(model.config)
    x[0, 0, 5] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        model(pixel_values=x)
    with pytest.raises(ValueError, match="look unnormalised"):
        model(pixel_values=signal(model.config) * 255)


# ------------------------------------------------------------------------------------- processor and Auto classes
def test_processor_resamples_an_equirectangular_image_at_the_vertices():
    height = 128
    rows = (torch.arange(height, dtype=torch.float64) + 0.5) * math.pi / height
    cols = (torch.arange(2 * height, dtype=torch.float64) + 0.5) * math.pi / height - math.pi
    theta, phi = torch.meshgrid(rows, cols, indexing="ij")
    field = lambda x, y, z: 0.5 + 0.3 * x * z - 0.2 * y  # noqa: E731  (smooth on the sphere)
    image = field(theta.sin() * phi.cos(), theta.sin() * phi.sin(), theta.cos())
    processor = P.PolarViTSphericalImageProcessor(icosphere_level=3, num_channels=1, do_normalize=False)
    values = processor(image.numpy(), return_tensors="pt")["pixel_values"]
    vertices = S.icosphere(3)
    assert values.shape == (1, 1, 642)
    error = (values[0, 0].double() - field(*vertices.unbind(-1))).abs()
    assert error[vertices[:, 2].abs() < 0.99].max() < 1e-3  # bilinear: O(pixel^2)
    assert error.max() < 5e-3  # the polar caps lie beyond the first / last pixel row's centre


def test_processor_takes_pil_images_and_icosphere_signals_and_normalises():
    processor = P.PolarViTSphericalImageProcessor(icosphere_level=1)
    rgb = Image.fromarray(np.full((16, 32, 3), 255, dtype=np.uint8))
    grey = Image.fromarray(np.zeros((10, 20), dtype=np.uint8))
    batch = processor([rgb, grey], return_tensors="pt")["pixel_values"]
    assert batch.shape == (2, 3, 42)
    assert torch.allclose(batch[0], torch.ones(()))  # (1 - 0.5) / 0.5
    assert torch.allclose(batch[1], -torch.ones(()))
    direct = torch.linspace(0, 1, 42, dtype=torch.float64).expand(3, 42)
    out = processor(direct.numpy(), return_tensors="pt", do_normalize=False)["pixel_values"]
    assert torch.allclose(out[0].double(), direct, atol=1e-7)
    with pytest.raises(ValueError, match="equirectangular image .* or an icosphere signal of 42 values"):
        processor(np.zeros((2, 3, 4, 5)), return_tensors="pt")


def test_auto_classes_pipeline_and_remote_code_imports(tmp_path):
    model = polar_model(num_channels=1).float()
    model.config.id2label = {i: f"class {i}" for i in range(5)}
    model.save_pretrained(tmp_path)
    P.PolarViTSphericalImageProcessor(icosphere_level=LEVEL, num_channels=1).save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), P.PolarViTSphericalConfig)
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, P.PolarViTSphericalForImageClassification)
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    assert isinstance(processor, P.PolarViTSphericalImageProcessor) and processor.icosphere_level == LEVEL
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForImageClassification"] == "modeling_polar_vit.PolarViTSphericalForImageClassification"
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 48), dtype=np.uint8))
    classify = pipeline("image-classification", model=str(tmp_path), trust_remote_code=False)
    result = classify(image, top_k=5)
    assert len(result) == 5 and abs(sum(item["score"] for item in result) - 1) < 1e-4
    expected = loaded(**processor(image, return_tensors="pt")).logits.softmax(-1).max().item()
    assert abs(result[0]["score"] - expected) < 1e-6
    # the remote-code copy must not require e3nn where only planar models are used (its import is guarded)
    assert "e3nn" not in get_imports(str(tmp_path / "spherical.py"))
    image.save(tmp_path / "panorama.png")
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["polar_vit_hf"] = None  # the package is not importable: remote code only
        from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline
        folder = {str(tmp_path)!r}
        model = AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=True)
        processor = AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)
        remote = type(model).__module__.startswith("transformers_modules")
        print(type(model).__name__, type(processor).__name__, remote)
        classify = pipeline("image-classification", model=folder, trust_remote_code=True)
        print(classify(folder + "/panorama.png")[0]["score"])
        """
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    names, score = run.stdout.strip().splitlines()[-2:]
    assert names == "PolarViTSphericalForImageClassification PolarViTSphericalImageProcessor True"
    assert abs(float(score) - expected) < 1e-6


def test_spherical_benchmark_runs_end_to_end(tmp_path, capsys):
    from polar_vit_hf.benchmarks import spherical_accuracy as bench

    points = S.icosphere(3)
    digit = torch.zeros(1, 8, 8, dtype=torch.float64)
    digit[0, 2:6, 3:5] = 1.0
    north = bench.project(digit, points, None, cap=100.0)
    assert north[0, points[:, 2] < 0].abs().max() == 0  # the digit sits on the northern cap
    assert north.max() > 0.5
    flip = torch.diag(torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64))[None]  # half turn about x
    south = bench.project(digit, points, flip, cap=100.0)
    assert torch.allclose(south[0], north[0, S.vertex_permutation(flip[0], points)], atol=1e-12)
    assert bench.main(["--quick", "--steps", "2", "--level", "2", "--no_progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in bench.MODELS:
        assert name in out
    assert (tmp_path / "spherical.png").stat().st_size > 0
    rows = (tmp_path / "spherical.csv").read_text().splitlines()
    assert len(rows) == 1 + len(bench.MODELS)
    errors = bench.equivariance_errors(2)
    assert max(v for k, v in errors.items() if "float64" in k) < 1e-12
    assert max(v for k, v in errors.items() if "float32" in k) < 1e-4
