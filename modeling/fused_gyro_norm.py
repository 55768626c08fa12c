"""The fused gyro layer norm (Sec. 4.4): ``b (+) (gamma / sqrt(sigma^2 + eps) (x) ((-)m (+) x))`` in one autograd
Function with a hand-derived backward.

``m`` is the polar centroid of the sample's tokens (Eq. 22), ``sigma^2`` their mean squared distance to it
(Eq. 5, the chords shared with the centroid's ``S``), the centring uses the gyroaddition of Eq. 21 and the bias
point Eq. 20 (:func:`geometry.gyroadd_space`).  The forward keeps its input, its output and per-token /
per-sample scalars (:class:`GyroNormScalars`); the backward rebuilds the token-wide intermediates
(:class:`GyroNormWide`) from them in a few passes (:func:`rebuild_wide`) and differentiates by hand.  Forward and
backward are each one compiled kernel in float32 on the CPU (:mod:`cpu_kernels`).

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and sibling modules.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .cpu_kernels import (
    first_order,
    run_maybe_compiled,
    save_with_record,
    saved_with_record,
    sum_dims,
)
from .fused_attention import centroid_row_gradients
from .geometry import centroid_radius
from .operators import fused_apply, registered_operators
from .stable_math import (
    asinh_nonneg,
    asinh_sqrt_half,
    cosh_minus_one,
    distance_slope,
    inverse_or_zero,
    safe_normalize,
    sinh_cosh,
)

__all__ = [
    "FusedGyroLayerNorm",
    "GyroNormScalars",
    "GyroNormWide",
    "BiasStep",
    "bias_step",
    "fused_gyro_layer_norm",
    "gyro_norm_forward",
]


# --------------------------------------------------------------------------------------------
# gyroaddition with a direction shared by the tokens (Eq. 20, 21)
# --------------------------------------------------------------------------------------------
class GyroaddScalars(NamedTuple):
    """The per-token intermediates of :func:`gyroadd_z`: hyperbolic functions of ``a``, ``b`` and ``a - b``,
    ``s = sign(u1.v)``, ``h = 1/2 ||d||^2``, ``z_par`` and which branch (``s > 0``)."""

    sinh_a: Tensor
    cosh_a: Tensor
    sinh_b: Tensor
    cosh_b: Tensor
    cosh_ab: Tensor
    sign: Tensor
    h: Tensor
    z_par: Tensor
    aligned: Tensor


class GyroaddParts(NamedTuple):
    """All intermediates of :func:`gyroadd_z`: the scalars and the token-wide ``d = v - s u1``, ``v_perp = d + s h
    u1``."""

    scalars: GyroaddScalars
    d: Tensor
    v_perp: Tensor


def polar_from_z(z: Tensor, sqrt_k: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(r, u, ||z||)`` of the point with space coordinates ``sqrt(k) z``: ``r = sqrt(k) asinh ||z||``,
    ``u = z/||z||`` (``e_0`` at the origin)."""
    norm = torch.linalg.vector_norm(z, dim=-1)
    return sqrt_k * asinh_nonneg(norm), safe_normalize(z, norm), norm


def polar_from_z_backward(g_r: Tensor, g_u: Tensor, u: Tensor, norm: Tensor, sqrt_k: float) -> Tensor:
    """``dL/dz`` of :func:`polar_from_z`: ``sqrt(k) g_r / sqrt(1 + |z|^2) u + (g_u - (g_u.u) u) / |z|``, 0 at
    ``z = 0``."""
    nonzero = norm > 0
    inv = inverse_or_zero(norm)
    radial = torch.where(nonzero, sqrt_k * g_r / torch.sqrt(1.0 + norm * norm), torch.zeros_like(norm))
    coef = radial - (g_u * u).sum(-1) * inv
    return torch.addcmul(g_u * inv.unsqueeze(-1), coef.unsqueeze(-1), u)


def dot_tokens(x: Tensor, c: Tensor) -> Tensor:
    """``x . c`` per token for ``x (..., N, n)`` and a direction shared by the tokens, ``c (n,)`` or ``(..., 1, n)``:
    one matrix product."""
    return x @ c if c.dim() == 1 else (x @ c.transpose(-1, -2)).squeeze(-1)


def sum_tokens(w: Tensor, x: Tensor, like: Tensor) -> Tensor:
    """``sum_tokens w x`` for ``w (..., N)``, ``x (..., N, n)``, summed to the shape of a shared direction ``like``
    (``(n,)``: over every token; ``(..., 1, n)``: over each sample's)."""
    if like.dim() == 1:
        return w.reshape(-1) @ x.reshape(-1, x.shape[-1])
    return w.unsqueeze(-2) @ x


def gyroadd_z(a: Tensor, u1: Tensor, b: Tensor, v: Tensor) -> tuple[Tensor, GyroaddParts]:
    """``z`` of ``x (+) y`` (Eq. 20, 21; :func:`geometry.gyroadd`), ``x = (a, u1)``, ``y = (b, v)``, radii /
    ``sqrt(k)``, with the direction ``u1`` shared by the tokens of ``v (..., N, n)``: ``(n,)`` or ``(..., 1, n)``.

    ``z_par = sinh a cosh b + cosh a sinh b (1 - h)`` (``s > 0``) or ``sinh(a - b) + cosh a sinh b h``;
    ``z = z_par u1 + sinh b v_perp`` (the stable ``v_perp`` of :func:`stable_math.perp_parts`).
    """
    sinh_a, cosh_a = sinh_cosh(a)
    sinh_b, cosh_b = sinh_cosh(b)
    sign = torch.where(dot_tokens(v, u1) >= 0, 1.0, -1.0).to(v.dtype)
    d = torch.addcmul(v, sign.unsqueeze(-1), u1, value=-1.0)
    h = 0.5 * d.square().sum(-1)
    sinh_ab, cosh_ab = sinh_cosh(a - b)
    aligned = sign > 0
    z_par = torch.where(aligned, sinh_a * cosh_b + cosh_a * sinh_b * (1.0 - h), sinh_ab + cosh_a * sinh_b * h)
    scalars = GyroaddScalars(sinh_a, cosh_a, sinh_b, cosh_b, cosh_ab, sign, h, z_par, aligned)
    d, v_perp, z = gyroadd_vectors(u1, v, scalars, d)
    return z, GyroaddParts(scalars, d, v_perp)


def gyroadd_vectors(
    u1: Tensor,
    v: Tensor,
    scalars: GyroaddScalars,
    d: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(d, v_perp, z)`` of :func:`gyroadd_z` from its per-token scalars (``d`` rebuilt when not given)."""
    d = torch.addcmul(v, scalars.sign.unsqueeze(-1), u1, value=-1.0) if d is None else d
    v_perp = torch.addcmul(d, (scalars.sign * scalars.h).unsqueeze(-1), u1)
    return d, v_perp, torch.addcmul(scalars.z_par.unsqueeze(-1) * u1, scalars.sinh_b.unsqueeze(-1), v_perp)


def gyroadd_scalar_gradients(
    g_zpar: Tensor, g_sinh_b: Tensor, scalars: GyroaddScalars
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/da, dL/db, dL/dh)`` of :func:`gyroadd_z`'s per-token scalars from ``dL/dz_par`` and the direct
    ``dL/dsinh b`` (of ``sinh b`` times the vector part): ``h`` enters ``z_par`` and ``v_perp = d + s h u1``."""
    sinh_a, cosh_a, sinh_b, cosh_b, cosh_ab, sign, h, z_par, aligned = scalars
    g_a = g_zpar * torch.where(aligned, cosh_a * cosh_b + sinh_a * sinh_b * (1.0 - h), cosh_ab + sinh_a * sinh_b * h)
    g_b = g_zpar * torch.where(aligned, sinh_a * sinh_b + cosh_a * cosh_b * (1.0 - h), cosh_a * cosh_b * h - cosh_ab)
    g_h = g_zpar * torch.where(aligned, -cosh_a * sinh_b, cosh_a * sinh_b) + sign * sinh_b * g_zpar
    return g_a, g_b + g_sinh_b * cosh_b, g_h


def gyroadd_backward(g_z: Tensor, u1: Tensor, parts: GyroaddParts) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dL/da, dL/du1, dL/db, dL/dv)`` of :func:`gyroadd_z` for a direction ``u1`` shared by the tokens:
    ``dL/du1`` summed over them (the shape of ``u1``), the others per token.

    With ``g_vperp = sinh b g_z``: ``g_z . v_perp = g_z . d + s h (g_z . u1)``, ``g_d = g_vperp + g_h d`` and
    ``g_u1 = g_z z_par + s h g_vperp - s g_d``, summed as products.
    """
    scalars, d = parts.scalars, parts.d
    sign, h, sinh_b, z_par = scalars.sign, scalars.h, scalars.sinh_b, scalars.z_par
    g_zpar = dot_tokens(g_z, u1)
    g_a, g_b, g_h = gyroadd_scalar_gradients(g_zpar, (g_z * d).sum(-1) + sign * h * g_zpar, scalars)
    g_d = torch.addcmul(g_z * sinh_b.unsqueeze(-1), g_h.unsqueeze(-1), d)
    g_u1 = sum_tokens(z_par + sign * sinh_b * (h - 1.0), g_z, u1) - sum_tokens(sign * g_h, d, u1)
    return g_a, g_u1, g_b, g_d


# --------------------------------------------------------------------------------------------
# the gyro layer norm
# --------------------------------------------------------------------------------------------
class BiasStep(NamedTuple):
    """The intermediates of the bias point's gyroaddition ``X (+) y`` (Eq. 20, 21; :func:`bias_step`), per call
    (``X``, ``|X|^2``, which form, ``u1``, ``|X|``) and per token (the rest).

    Both forms write ``z = A u1 + sinh b d`` with ``d = u_y - s u1``, ``s = sign(u_y . u1)``: near the origin
    (``|X| <= 1``, Eq. 20 directly, smooth at ``X = 0``) ``A = s sinh b + coef |X|``; beyond, the polar gyroaddition
    (Eq. 21) with the bias point ``(asinh |X|, u1)``, ``A = z_par + s h sinh b``.  Only the per-token ``A`` depends on
    the form: the token-wide passes are shared and the host never reads which form applies."""

    big_x: Tensor  # X = bias / sqrt(k)
    x_sq: Tensor  # |X|^2
    near: Tensor  # |X| <= 1
    u1: Tensor  # X / |X|; at X = 0 the unit vector (1, ..., 1) / sqrt(n)
    norm: Tensor  # |X|; at X = 0 sqrt(n), the norm of that stand-in (never a division by 0)
    x_norm: Tensor  # |X|
    far: GyroaddScalars  # Eq. 21's per-token scalars, a = asinh |X|
    x_dot_u: Tensor  # X . u_y
    denom: Tensor  # sqrt(1 + |X|^2) + 1
    coef: Tensor  # Eq. 20's coefficient of X: (X . u_y) sinh b / denom + cosh b
    along: Tensor  # A


def bias_step(bias: Tensor, b: Tensor, u_y: Tensor, sqrt_k: float) -> tuple[Tensor, Tensor, BiasStep]:
    """``(z, d, record)`` of ``X (+) y`` for the bias point ``X = bias / sqrt(k)`` (space coordinates over
    ``sqrt(k)``) and the tokens ``y = (b, u_y)``, radii over ``sqrt(k)``, in both forms (:class:`BiasStep`)."""
    big_x = bias / sqrt_k
    x_sq = big_x.square().sum()
    present = x_sq > 0
    stand_in = torch.where(present, big_x, 1.0)
    norm = torch.linalg.vector_norm(stand_in)
    u1 = stand_in / norm
    x_norm = torch.where(present, norm, 0.0)
    sinh_b, cosh_b = sinh_cosh(b)
    dot = u_y @ u1
    sign = torch.where(dot >= 0, 1.0, -1.0).to(b.dtype)
    d = torch.addcmul(u_y, sign.unsqueeze(-1), u1, value=-1.0)
    h = 0.5 * d.square().sum(-1)
    # near the origin: z = sinh b u_y + coef X (Eq. 20)
    x_dot_u = dot * x_norm
    denom = torch.sqrt(1.0 + x_sq) + 1.0
    coef = x_dot_u * sinh_b / denom + cosh_b
    # beyond: the polar gyroaddition (Eq. 21), z = z_par u1 + sinh b (d + s h u1)
    a = asinh_nonneg(norm)
    sinh_a, cosh_a = sinh_cosh(a)
    sinh_ab, cosh_ab = sinh_cosh(a - b)
    aligned = sign > 0
    z_par = torch.where(aligned, sinh_a * cosh_b + cosh_a * sinh_b * (1.0 - h), sinh_ab + cosh_a * sinh_b * h)
    near = x_sq <= 1.0
    along = torch.where(near, sign * sinh_b + coef * x_norm, z_par + sign * h * sinh_b)
    z = torch.addcmul(along.unsqueeze(-1) * u1, sinh_b.unsqueeze(-1), d)
    far = GyroaddScalars(sinh_a, cosh_a, sinh_b, cosh_b, cosh_ab, sign, h, z_par, aligned)
    return z, d, BiasStep(big_x, x_sq, near, u1, norm, x_norm, far, x_dot_u, denom, coef, along)


def bias_step_backward(
    g_z: Tensor, u_y: Tensor, d: Tensor, step: BiasStep, sqrt_k: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/db, dL/du_y, dL/dbias)`` of :func:`bias_step`: the form's per-token gradients selected per value, one
    token-wide pass for ``dL/du_y`` and one token sum for the bias point.

    Near: ``dL/dX = sum (coef g_z + g_{X.u} u_y) + X g_denom / sqrt(1 + |X|^2)``.  Beyond: ``dL/du1 = sum (z_par + s
    sinh b (h - 1)) g_z - s g_h d`` (:func:`gyroadd_backward`) and ``dL/dX = (sum g_a) u1 / sqrt(1 + |X|^2) +
    (dL/du1 - (dL/du1 . u1) u1) / |X|``."""
    far, near, u1 = step.far, step.near, step.u1
    sinh_b, cosh_b, sign, h = far.sinh_b, far.cosh_b, far.sign, far.h
    g_along = g_z @ u1
    g_sinh_b = (g_z * d).sum(-1)
    # near the origin
    g_coef = g_along * step.x_norm
    g_x_dot_u = g_coef * sinh_b / step.denom
    g_b_near = (g_sinh_b + sign * g_along + g_coef * step.x_dot_u / step.denom) * cosh_b + g_coef * sinh_b
    g_denom = -sum_dims(g_coef * step.x_dot_u * sinh_b) / step.denom**2
    # beyond
    g_a, g_b_far, g_h = gyroadd_scalar_gradients(g_along, g_sinh_b + sign * h * g_along, far)
    g_b = torch.where(near, g_b_near, g_b_far)
    g_h = torch.where(near, 0.0, g_h)
    g_x_dot_u = torch.where(near, g_x_dot_u, 0.0)
    g_u_y = sinh_b.unsqueeze(-1) * g_z + g_h.unsqueeze(-1) * d + g_x_dot_u.unsqueeze(-1) * step.big_x
    on_g_z = torch.where(near, step.coef, far.z_par + sign * sinh_b * (h - 1.0))
    summed = sum_dims(on_g_z.unsqueeze(-1) * g_z + g_x_dot_u.unsqueeze(-1) * u_y - (sign * g_h).unsqueeze(-1) * d, 1)
    g_x_near = summed + step.big_x * (g_denom / torch.sqrt(1.0 + step.x_sq))
    g_x_far = (
        sum_dims(torch.where(near, 0.0, g_a)) / torch.sqrt(1.0 + step.norm**2) * u1
        + (summed - (summed @ u1) * u1) / step.norm
    )
    return g_b, g_u_y, torch.where(near, g_x_near, g_x_far) / sqrt_k


class GyroNormScalars(NamedTuple):
    """The per-token and per-sample intermediates of :func:`gyro_norm_forward` (what the Function saves)."""

    a: Tensor
    sinh_a: Tensor
    cosh_a: Tensor
    exp_a: Tensor
    big_t: Tensor
    big_e: Tensor
    big_s: Tensor
    v_norm: Tensor
    u_hat: Tensor
    chord: Tensor
    a_m: Tensor
    sinh_m: Tensor
    cosh_m: Tensor
    c: Tensor
    sinh_x: Tensor
    asinh_s: Tensor
    root: Tensor
    variance: Tensor
    centring: GyroaddScalars
    r_y: Tensor
    norm1: Tensor
    factor: Tensor
    b: Tensor
    bias: BiasStep
    norm2: Tensor


class GyroNormWide(NamedTuple):
    """The token-by-coordinate intermediates of :func:`gyro_norm_forward` (rebuilt in backward): the input
    directions, their differences to the centroid direction, the centring's vectors, the centred directions, the
    output directions and the bias step's ``d = u_y - s u1`` (:func:`bias_step`)."""

    u: Tensor
    diff: Tensor
    centring: GyroaddParts
    u_y: Tensor
    u_out: Tensor
    bias_d: Tensor


def gyro_norm_forward(
    p: Tensor,
    log_gain: Tensor,
    bias: Tensor,
    k: float,
    eps: float,
) -> tuple[Tensor, GyroNormScalars, GyroNormWide]:
    """The gyro layer norm of ``p (B, N, n+1)`` over its tokens and the intermediates of its backward."""
    sk = math.sqrt(k)
    u = p[..., 1:]
    a = p[..., 0] / sk
    tokens = a.shape[-1]
    sinh_a, cosh_a = sinh_cosh(a)
    exp_a = torch.exp(-a)
    # centroid of the sample's tokens with weights 1/N (Eq. 6, 7, 22)
    big_t, big_e = cosh_a.mean(-1), exp_a.mean(-1)
    big_v = (sinh_a.unsqueeze(-2) @ u).squeeze(-2) / tokens  # (B, n)
    v_norm = torch.linalg.vector_norm(big_v, dim=-1)
    u_hat = safe_normalize(big_v, v_norm)
    diff = u - u_hat.unsqueeze(-2)  # exact differences for the chords (App. D.1)
    chord = 0.5 * diff.square().sum(-1)  # (B, N)
    big_s = (sinh_a * chord).mean(-1)
    a_m = centroid_radius(big_t, big_e, big_s, v_norm, v_norm <= 0)
    sinh_m, cosh_m = sinh_cosh(a_m)
    # dispersion: mean squared distance to the centroid (Eq. 5)
    c, sinh_x = cosh_minus_one(a - a_m.unsqueeze(-1))
    c += sinh_a * sinh_m.unsqueeze(-1) * chord
    asinh_s, root = asinh_sqrt_half(c)
    variance = asinh_s.square().mean(-1) * (4.0 * k)
    # centring (-)m (+) x (Eq. 21), radius scaling, bias point b (+) . (Eq. 20)
    z1, centring = gyroadd_z(a_m.unsqueeze(-1), -u_hat.unsqueeze(-2), a, u)
    r_y, u_y, norm1 = polar_from_z(z1, sk)
    factor = torch.exp(log_gain) / torch.sqrt(variance + eps)  # (B,)
    b = r_y * factor.unsqueeze(-1) / sk
    z2, bias_d, step = bias_step(bias, b, u_y, sk)
    r_out, u_out, norm2 = polar_from_z(z2, sk)
    out = torch.cat([r_out.unsqueeze(-1), u_out], dim=-1)
    scalars = GyroNormScalars(
        a,
        sinh_a,
        cosh_a,
        exp_a,
        big_t,
        big_e,
        big_s,
        v_norm,
        u_hat,
        chord,
        a_m,
        sinh_m,
        cosh_m,
        c,
        sinh_x,
        asinh_s,
        root,
        variance,
        centring.scalars,
        r_y,
        norm1,
        factor,
        b,
        step,
        norm2,
    )
    return out, scalars, GyroNormWide(u, diff, centring, u_y, u_out, bias_d)


def gyro_norm_backward(
    grad: Tensor, k: float, eps: float, st: GyroNormScalars, wide: GyroNormWide
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/dp, dL/dlog_gain, dL/dbias)`` from the intermediates of :func:`gyro_norm_forward`."""
    sk = math.sqrt(k)
    tokens = st.a.shape[-1]
    g_z2 = polar_from_z_backward(grad[..., 0], grad[..., 1:], wide.u_out, st.norm2, sk)
    u_y = wide.u_y
    g_b, g_u_y, g_bias = bias_step_backward(g_z2, u_y, wide.bias_d, st.bias, sk)
    # radius scaling r_y -> factor r_y, factor = e^{log_gain} / sqrt(variance + eps)
    g_r_y = g_b * st.factor.unsqueeze(-1) / sk
    g_factor = (g_b * st.r_y).sum(-1) / sk
    g_log_gain = sum_dims(g_factor * st.factor)
    g_variance = -0.5 * g_factor * st.factor / (st.variance + eps)
    # centring
    g_z1 = polar_from_z_backward(g_r_y, g_u_y, u_y, st.norm1, sk)
    u_hat = st.u_hat
    g_a_m, g_u1, g_a, g_u = gyroadd_backward(g_z1, -u_hat.unsqueeze(-2), wide.centring)
    g_a_m = g_a_m.sum(-1)
    g_u_hat = -g_u1.squeeze(-2)
    # dispersion
    g_c = (g_variance * (k / tokens)).unsqueeze(-1) * distance_slope(0.5 * st.c, st.asinh_s, st.root)
    sinh_a, cosh_a, chord = st.sinh_a, st.cosh_a, st.chord
    g_a = g_a + g_c * (st.sinh_x + cosh_a * st.sinh_m.unsqueeze(-1) * chord)
    g_a_m = g_a_m + (g_c * (sinh_a * st.cosh_m.unsqueeze(-1) * chord - st.sinh_x)).sum(-1)
    g_chord = g_c * sinh_a * st.sinh_m.unsqueeze(-1)
    g_u_hat = g_u_hat - (g_chord.unsqueeze(-2) @ wide.diff).squeeze(-2)
    # centroid (Eq. 22): T, E, S with weights 1/N; S is stationary in u_hat
    g_t, g_e, g_v, _ = centroid_row_gradients(
        g_a_m / sk, g_u_hat, st.big_t, st.big_e, st.big_s, st.v_norm, st.a_m, u_hat, k
    )
    g_chord = g_chord + (g_e / tokens).unsqueeze(-1) * sinh_a
    g_a = (
        g_a
        + (
            g_t.unsqueeze(-1) * sinh_a
            - g_e.unsqueeze(-1) * st.exp_a
            + g_e.unsqueeze(-1) * cosh_a * chord
            + cosh_a * (wide.u @ g_v.unsqueeze(-1)).squeeze(-1)
        )
        / tokens
    )
    g_u = g_u + g_chord.unsqueeze(-1) * wide.diff + sinh_a.unsqueeze(-1) * g_v.unsqueeze(-2) / tokens
    return torch.cat([(g_a / sk).unsqueeze(-1), g_u], dim=-1), g_log_gain, g_bias


def rebuild_wide(p: Tensor, out: Tensor, st: GyroNormScalars) -> GyroNormWide:
    """The token-wide intermediates of :func:`gyro_norm_forward` from its input, output and per-token scalars,
    recomputed with the same operations (a few passes) instead of saved or recomputed with the whole forward.

    The centred directions ``u_y = z1 / ||z1||`` take the saved norm ``st.norm1`` rather than summing ``z1``'s
    squares again: one pass over the coordinates and a square root per token fewer."""
    u, u_hat = p[..., 1:], st.u_hat
    d, v_perp, z1 = gyroadd_vectors(-u_hat.unsqueeze(-2), u, st.centring)
    u_y = safe_normalize(z1, st.norm1)
    bias_d = torch.addcmul(u_y, st.bias.far.sign.unsqueeze(-1), st.bias.u1, value=-1.0)
    return GyroNormWide(u, u - u_hat.unsqueeze(-2), GyroaddParts(st.centring, d, v_perp), u_y, out[..., 1:], bias_d)


def _saved_forward(p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> tuple[Tensor, GyroNormScalars]:
    """The output of :func:`gyro_norm_forward` and the scalars its backward keeps."""
    out, scalars, _ = gyro_norm_forward(p, log_gain, bias, k, eps)
    return out, scalars


def _gradients(
    grad: Tensor, p: Tensor, out: Tensor, st: GyroNormScalars, k: float, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients from the input, output and saved scalars (:func:`rebuild_wide`, :func:`gyro_norm_backward`)."""
    return gyro_norm_backward(grad, k, eps, st, rebuild_wide(p, out, st))


@registered_operators()
class FusedGyroLayerNorm(torch.autograd.Function):
    r"""Gyro layer normalisation (Sec. 4.4) as one function (see the module docstring).  Saved: the input, the
    output and the per-call / per-token / per-sample :class:`GyroNormScalars` (the bias step's among them)."""

    @staticmethod
    def forward(
        ctx: Any,
        p: Tensor,
        log_gain: Tensor,
        bias: Tensor,
        k: float,
        eps: float,  # noqa: D102
    ) -> Tensor:
        out, small = run_maybe_compiled(_saved_forward, p, p, log_gain, bias, k, eps)
        save_with_record(ctx, small, p, out)
        ctx.k, ctx.eps = k, eps
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        (p, out), small = saved_with_record(ctx)
        g_p, g_log_gain, g_bias = run_maybe_compiled(_gradients, p, grad.contiguous(), p, out, small, ctx.k, ctx.eps)
        return g_p, g_log_gain, g_bias, None, None


def fused_gyro_layer_norm(p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> Tensor:
    """Gyro layer norm of ``p (B, N, n+1)`` over its tokens; see :class:`FusedGyroLayerNorm`."""
    return fused_apply(FusedGyroLayerNorm, p, log_gain, bias, float(k), float(eps))
