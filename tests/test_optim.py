"""Riemannian AdamW in polar form: float64 agreement, manifold weight decay, convergence, groups."""

from __future__ import annotations

import math

import pytest
import torch

import polar_vit_hf as P
from polar_vit_hf import geometry as G
from polar_vit_hf.benchmarks.mpmath_reference import mp_centroid, mp_point, mp_radius
from polar_vit_hf.optim import RiemannianAdamW, param_groups

F64 = torch.float64


def targets(radius: float, n: int = 8, dim: int = 5, seed: int = 0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(dim, generator=gen, dtype=F64), dim=0)
    xi = 0.3 * torch.randn(n, dim, generator=gen, dtype=F64)
    xi_r = xi @ u
    xi_perp = xi - xi_r[:, None] * u
    r, v = G.expmap(torch.full((n,), radius, dtype=F64), u.expand(n, dim), xi_r, xi_perp)
    return r.to(dtype), v.to(dtype)


def frechet_run(dtype, steps: int, radius: float = 6.0, lr: float = 0.05, wd: float = 0.0):
    tr, tu = targets(radius, dtype=dtype)
    start = G.space(
        torch.tensor(radius - 2.0, dtype=F64), torch.nn.functional.normalize(torch.ones(5, dtype=F64), dim=0)
    ).to(dtype)
    point = torch.nn.Parameter(start.clone())
    opt = RiemannianAdamW([dict(params=[point], manifold=True, k=1.0)], lr=lr, weight_decay=wd)
    losses = []
    for _ in range(steps):
        r, u = G.from_space(point)
        loss = G.sq_distance(r, u, tr, tu).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return point.detach(), losses


def test_float32_follows_float64_on_a_toy_problem():
    p64, l64 = frechet_run(F64, 40)
    p32, l32 = frechet_run(torch.float32, 40)
    r64, u64 = G.from_space(p64)
    r32, u32 = G.from_space(p32.double())
    assert G.distance(r32, u32, r64, u64) < 1e-4
    assert max(abs(a - b) / b for a, b in zip(l32, l64)) < 1e-4


def test_hyperbolic_regression_converges():
    point, losses = frechet_run(F64, 400, radius=10.0, lr=0.2)
    assert losses[-1] < 0.05 * losses[0]
    r, u = G.from_space(point.requires_grad_(True))
    tr, tu = targets(10.0)
    loss = G.sq_distance(r, u, tr, tu).mean()
    (grad,) = torch.autograd.grad(loss, point)
    xi_r, xi_perp = G.project_grad(r.detach(), u.detach(), torch.zeros(()), grad)
    assert G.tangent_inner(xi_r, xi_perp, xi_r, xi_perp).sqrt() < 1e-3  # a stationary point


@pytest.mark.parametrize("radius", [12.0, 16.0])
def test_manifold_weight_decay_moves_a_far_parameter_inward_exactly(radius):
    u = torch.nn.functional.normalize(torch.arange(1.0, 6.0), dim=0)
    point = torch.nn.Parameter(G.space(torch.tensor(radius), u))
    lr, wd = 1e-3, 1e-2  # decay weight lr * wd = 1e-5 per step
    opt = RiemannianAdamW([dict(params=[point], manifold=True, k=1.0)], lr=lr, weight_decay=wd)
    expected = radius
    for _ in range(3):
        point.grad = torch.zeros_like(point)
        opt.step()
        ref = mp_centroid([mp_point(expected, u.tolist()), mp_point(0.0, u.tolist())], [1 - lr * wd, lr * wd])
        new_expected = float(mp_radius(ref))
        r, direction = G.from_space(point.detach())
        step = expected - new_expected
        assert step > 0 and float(r) < expected
        assert abs(float(r) - new_expected) < 2e-3 * step + 1e-5  # float32 storage of sinh(r) u
        assert torch.allclose(direction, u, atol=1e-6)
        expected = float(r)


def test_param_groups_follow_the_paper_rules():
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", readout="cls"))
    groups = {
        (
            "manifold"
            if g.get("manifold")
            else "radius"
            if g.get("decay_to")
            else "no_decay"
            if g["weight_decay"] == 0
            else "decay"
        ): g
        for g in param_groups(model, 0.05)
    }
    names = {key: set(g["names"]) for key, g in groups.items()}
    assert "polar_vit.embeddings.cls_token" in names["manifold"]
    assert "polar_vit.norm.bias_point" in names["manifold"]
    assert groups["manifold"]["k"] == model.config.k
    for suffix in ("log_gain", "log_temperature", "alpha", "rates"):
        assert any(n.endswith(suffix) for n in names["no_decay"]), suffix
        assert not any(n.endswith(suffix) for n in names["decay"] | names["radius"])
    assert all(
        n.rsplit(".", 1)[-1] in ("norm_power", "radius_weight", "klein_weight", "radius_bias") for n in names["radius"]
    )
    assert (
        dict(zip(groups["radius"]["names"], groups["radius"]["decay_to"]))["polar_vit.layers.0.mlp.fc1.norm_power"]
        == 1.0
    )
    assert "polar_vit.layers.0.mlp.fc1.weight" in names["decay"]
    total = sum(len(g["params"]) for g in groups.values())
    assert total == len(list(model.parameters()))


def test_radius_parameters_decay_towards_their_anchor():
    layer = torch.nn.Parameter(torch.full((3,), 2.0))
    opt = RiemannianAdamW([dict(params=[layer], decay_to=[1.0])], lr=0.1, weight_decay=0.5)
    layer.grad = torch.zeros(3)
    opt.step()
    assert torch.allclose(layer.detach(), torch.full((3,), 2.0 - 0.1 * 0.5 * 1.0))


def test_trains_the_model_and_round_trips_its_state():
    torch.manual_seed(0)
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", readout="cls"))
    opt = RiemannianAdamW(param_groups(model, 0.05), lr=3e-3)
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    first = None
    for _ in range(5):
        loss = model(x, labels=y).loss
        first = first if first is not None else float(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(model(x, labels=y).loss) < first
    state = opt.state_dict()
    fresh = RiemannianAdamW(param_groups(model, 0.05), lr=3e-3)
    fresh.load_state_dict(state)
    for group_a, group_b in zip(opt.param_groups, fresh.param_groups):
        for pa, pb in zip(group_a["params"], group_b["params"]):
            for key, value in opt.state[pa].items():
                assert torch.equal(value, fresh.state[pb][key])


def test_invalid_hyper_parameters():
    with pytest.raises(ValueError, match="hyper-parameters"):
        RiemannianAdamW([torch.nn.Parameter(torch.zeros(2))], lr=-1.0)
    assert math.isfinite(1.0)


def test_decoupled_decay_is_big_visions_per_step_formula():
    """big_vision (optax.py): update = -s(t) (lr adam + wd p), so with zero gradients p_t = p_{t-1} (1 - wd s(t)) with
    s the schedule multiplier; PyTorch's convention decays by lr(t) wd instead.  Manifold points decay to the
    Lorentzian centroid of {x, o} with weights (1 - c, c), c = wd s(t) (B.7): in ambient coordinates
    m = (1 - c) x + c o, normalised onto the hyperboloid."""
    from polar_vit_hf.training.pretrain import cosine_with_warmup

    wd, lr, warmup, total = 0.1, 1e-3, 3, 10
    weight = torch.nn.Parameter(torch.ones(4, 3, dtype=F64))
    point = torch.nn.Parameter(G.space(torch.tensor(2.0, dtype=F64), torch.tensor([0.6, 0.8], dtype=F64)))
    groups = [dict(params=[weight]), dict(params=[point], manifold=True, k=1.0)]
    opt = RiemannianAdamW(groups, lr=lr, weight_decay=wd, decoupled_wd=True)
    coupled_weight = torch.nn.Parameter(torch.ones(4, 3, dtype=F64))
    coupled = RiemannianAdamW([coupled_weight], lr=lr, weight_decay=wd)
    schedule, coupled_schedule = cosine_with_warmup(opt, warmup, total), cosine_with_warmup(coupled, warmup, total)
    expected_weight, expected_radius, expected_coupled = 1.0, 2.0, 1.0
    for _ in range(total):
        s = opt.param_groups[0]["lr"] / lr  # the schedule multiplier of this step
        for p in (weight, point, coupled_weight):
            p.grad = torch.zeros_like(p)
        opt.step()
        coupled.step()
        c = wd * s
        expected_weight *= 1.0 - c
        time, space = (1.0 - c) * math.cosh(expected_radius) + c, (1.0 - c) * math.sinh(expected_radius)
        expected_radius = math.asinh(space / math.sqrt(time**2 - space**2))
        expected_coupled *= 1.0 - lr * s * wd
        assert torch.allclose(weight, torch.full_like(weight, expected_weight), rtol=1e-14, atol=0)
        radius, direction = G.from_space(point.detach())
        assert abs(float(radius) - expected_radius) < 1e-12
        assert torch.allclose(direction, torch.tensor([0.6, 0.8], dtype=F64), atol=1e-14)
        assert torch.allclose(coupled_weight, torch.full_like(weight, expected_coupled), rtol=1e-14, atol=0)
        schedule.step()
        coupled_schedule.step()
    assert expected_weight < 0.6 and expected_coupled > 0.999  # decoupled: 1000x the decay of lr wd at lr 1e-3


def test_the_euclidean_baseline_decays_weight_matrices_only():
    from polar_vit_hf.baselines import euclidean_vit
    from polar_vit_hf.optim import euclidean_param_groups

    vit = euclidean_vit(P.PolarViTConfig.from_preset("demo"))
    decayed, plain = euclidean_param_groups(vit, 0.1)
    names = {id(p): n for n, p in vit.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(n.endswith("weight") for n in decayed_names)
    assert not any("position_embeddings" in n or "cls_token" in n or "layernorm" in n for n in decayed_names)
    assert "vit.embeddings.patch_embeddings.projection.weight" in decayed_names
    assert len(decayed["params"]) + len(plain["params"]) == len(list(vit.parameters()))
