"""Shared test helpers: random polar points, attention inputs and their float64 check, the model switches."""

from __future__ import annotations

import math

import torch
from torch import Tensor

import polar_vit_hf as P
from polar_vit_hf.geometry import distance
from polar_vit_hf.modeling.attention import eager_polar_attention

F64 = torch.float64

# one config override per ablation switch of the paper (Tables 5, 6) and the neighbouring systems
SWITCHES = [
    dict(relative_position="horoshift"),
    dict(relative_position="boost"),
    dict(relative_position="rotation"),
    dict(relative_position="none"),
    dict(residual="space"),
    dict(residual="lorentz_midpoint"),
    dict(linear="lorentz"),
    dict(readout="cls"),
    dict(head="poincare_mlr"),
    dict(head="tangent_linear"),
    dict(position_embedding="sincos"),
    dict(position_embedding="none"),
    dict(position_embedding="hypformer"),
    dict(head_merge="beta_concat"),
    dict(k=0.5),
]


def unit(v: Tensor) -> Tensor:
    return v / v.norm(dim=-1, keepdim=True)


def random_points(
    *shape: int, dim: int = 8, rmax: float = 5.0, dtype=torch.float64, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Radii uniform in [0, rmax) and uniformly random directions."""
    r = torch.rand(*shape, dtype=dtype, generator=generator) * rmax
    u = unit(torch.randn(*shape, dim, dtype=dtype, generator=generator))
    return r, u


def near(u: Tensor, angle: float, generator: torch.Generator | None = None) -> Tensor:
    """Directions at (about) ``angle`` from ``u``."""
    noise = torch.randn(u.shape, dtype=u.dtype, generator=generator)
    noise = noise - (noise * u).sum(-1, keepdim=True) * u
    return unit(u + angle * unit(noise))


def directions(*shape: int, case: str = "generic", seed: int = 0) -> torch.Tensor:
    """Unit directions; ``aligned``: all equal; ``identical`` is handled by the callers (radii too)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(*shape, generator=gen, dtype=F64), dim=-1)
    if case == "aligned":
        u[:] = u.reshape(-1, shape[-1])[:1]
    return u


def radii(*shape: int, rmax: float, seed: int = 0) -> torch.Tensor:
    """Radii spread over ``[0.7 rmax, rmax]`` (exactly ``rmax = 0`` gives the origin)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return rmax * (0.7 + 0.3 * torch.rand(*shape, generator=gen, dtype=F64))


# attention: stored float32 inputs, their float64 reference, and the accuracy check every core must pass
def make_inputs(batch=2, heads=2, n_q=20, n_k=20, dim=16, rmax=4.0, seed=0, case="generic"):
    gen = torch.Generator().manual_seed(seed)

    def points(n, low, high):
        r = low + (high - low) * torch.rand(batch, heads, n, generator=gen, dtype=F64)
        u = torch.nn.functional.normalize(torch.randn(batch, heads, n, dim, generator=gen, dtype=F64), dim=-1)
        return r, u

    rq, uq = points(n_q, 0.0, rmax)
    rk, uk = points(n_k, 0.0, rmax)
    rv, uv = points(n_k, 0.0, rmax)
    rq[..., 0] = 0.0  # a query at the origin
    if case == "dominant":  # one key right on top of each query's first neighbour: the softmax is one-hot
        rk[..., 3], uk[..., 3, :] = rq[..., 0].clone() + 0.01, uq[..., 0, :].clone()
    elif case == "identical":  # all keys and values the same point
        rk[:] = rk[..., :1]
        uk[:] = uk[..., :1, :]
        rv[:] = rv[..., :1]
        uv[:] = uv[..., :1, :]
    elif case == "aligned":  # every direction the same
        for u in (uq, uk, uv):
            u[:] = uq[:, :, :1, :]
    scale = 0.3 + torch.rand(heads, generator=gen, dtype=F64)
    if case == "dominant":
        scale = scale * 50.0
    # the float32 inputs every implementation sees, and their exact float64 copies
    stored = [t.float() for t in (rq, uq, rk, uk, rv, uv, scale)]
    return stored


def reference(stored, k=1.0):
    leaves = [t.double().requires_grad_(True) for t in stored]
    r, u, _ = eager_polar_attention(*leaves[:6], leaves[6], k)
    return leaves, r, u


def check(stored, run, k=1.0, seed=0):
    leaves, r_ref, u_ref = reference(stored, k)
    gen = torch.Generator().manual_seed(seed + 100)
    w_r, w_u = torch.randn(r_ref.shape, generator=gen, dtype=F64), torch.randn(u_ref.shape, generator=gen, dtype=F64)
    grads_ref = torch.autograd.grad((r_ref * w_r).sum() + (u_ref * w_u).sum(), leaves)
    inputs = [t.clone().requires_grad_(True) for t in stored]
    r, u = run(*inputs[:6], inputs[6], k)
    assert r.dtype == torch.float32 and torch.isfinite(r).all() and torch.isfinite(u).all()
    err = distance(r.double(), u.double(), r_ref.detach(), u_ref.detach(), k)
    limit = torch.sinh(r_ref.detach() / math.sqrt(k)) * 2.0**-24
    d2 = P.geometry.pairwise_sq_distance(*[t.detach() for t in leaves[:4]], k)
    conditioning = 4 * 2.0**-24 * float(leaves[6].max()) * float(d2.max()) * 2 * float(leaves[4].max())
    assert (err <= 2e-5 + 8 * limit + conditioning).all(), float(err.max())
    grads = torch.autograd.grad((r * w_r.float()).sum() + (u * w_u.float()).sum(), inputs)
    overall = max(float(g.abs().max()) for g in grads_ref)  # for inputs whose exact gradient is 0
    # float32 eager autograd on the same inputs: what float32 itself allows
    eager_in = [t.clone().requires_grad_(True) for t in stored]
    r32, u32, _ = eager_polar_attention(*eager_in[:6], eager_in[6], k)
    grads32 = torch.autograd.grad((r32 * w_r.float()).sum() + (u32 * w_u.float()).sum(), eager_in)
    for name, got, want, eager32 in zip(("rq", "uq", "rk", "uk", "rv", "uv", "scale"), grads, grads_ref, grads32):
        # scale sums all N*M pairs, each carrying the softmax row constant's rounding ~ eps cosh(b_max)
        growth = max(1.0, math.cosh(float(leaves[4].max())) / 100)
        summed = 1e-4 * overall * growth if name == "scale" else 1e-5 * overall
        tol = max(2e-4 * want.abs().max() + summed + 1e-7, 4 * (eager32.double() - want).abs().max())
        error = got.double() - want
        if name == "uv":  # the component along v_j (off the sphere) has its own conditioning
            along = (error * leaves[5].detach()).sum(-1)
            error = error - along.unsqueeze(-1) * leaves[5].detach()
            bound = tol + 8 * 2.0**-24 * value_normal_amplification(leaves, r_ref.detach(), u_ref.detach(), w_r, k)
            assert (along.abs() <= bound).all(), ("uv along v", float(along.abs().max()), float(bound.max()))
        assert error.abs().max() <= tol, (name, float(error.abs().max()), float(tol))


def value_normal_amplification(leaves, r_ref, u_ref, w_r, k):
    """``A_j = sum_i |g_S,i| p_ij sinh b_j``: how much the rounding of the centroid directions ``u_hat_i`` (a few
    float32 ulps) moves the gradient's component along the value direction ``v_j``.

    That component is the derivative of the angular sum ``S_i = sum_j p_ij sinh b_j 1/2 ||v_j - u_hat_i||^2``
    (Eq. 22) along ``v_j``, ``g_S,i p_ij sinh b_j v_j . (v_j - u_hat_i)``, whose exact value vanishes for clustered
    values while ``g_S = -1/2 tanh(a_mu) sqrt(k) dL/dr / (E + S)`` grows without bound as ``E + S -> 0``; any
    float32 ``u_hat`` carries an error of order ``eps``, so ``eps A_j`` is what float32 itself allows there.
    """
    rv, uv = (t.detach() for t in leaves[4:6])
    sqrt_k = math.sqrt(k)
    _, _, probs = eager_polar_attention(*(t.detach() for t in leaves[:6]), leaves[6].detach(), k)
    sinh_b = torch.sinh(rv / sqrt_k).unsqueeze(-2)
    big_e = (probs * torch.exp(-rv / sqrt_k).unsqueeze(-2)).sum(-1)
    big_s = (probs * sinh_b * P.geometry.pairwise_chord(u_ref, uv)).sum(-1)
    g_s = 0.5 * w_r.abs() * sqrt_k * torch.tanh(r_ref / sqrt_k) / (big_e + big_s)
    return (g_s.unsqueeze(-1) * probs * sinh_b).sum(-2)


EDGE_CASES = [(case, rmax) for case in ("dominant", "identical", "aligned") for rmax in (0.0, 4.0, 8.0)] + [
    ("generic", rmax) for rmax in (0.0, 4.0, 8.0, 12.0)
]


LEVEL, PATCH_LEVEL = 2, 0  # the spherical tests' icosphere: 162 vertices, 60 tokens of 15 vertices


def spherical_config(**overrides) -> P.PolarViTSphericalConfig:
    kwargs = dict(
        icosphere_level=LEVEL,
        patch_level=PATCH_LEVEL,
        hidden_size=32,
        num_attention_heads=2,
        num_hidden_layers=2,
        intermediate_size=32,
        num_channels=2,
        num_labels=5,
    )
    return P.PolarViTSphericalConfig(**{**kwargs, **overrides})
