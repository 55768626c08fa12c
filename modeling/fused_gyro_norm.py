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
    "bias_near_origin",
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


def gyroadd_backward(g_z: Tensor, u1: Tensor, parts: GyroaddParts) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dL/da, dL/du1, dL/db, dL/dv)`` of :func:`gyroadd_z` for a direction ``u1`` shared by the tokens:
    ``dL/du1`` summed over them (the shape of ``u1``), the others per token.

    With ``g_vperp = sinh b g_z``: ``g_z . v_perp = g_z . d + s h (g_z . u1)``, ``g_d = g_vperp + g_h d`` and
    ``g_u1 = g_z z_par + s h g_vperp - s g_d``, summed as products.
    """
    sinh_a, cosh_a, sinh_b, cosh_b, cosh_ab, sign, h, z_par, aligned = parts.scalars
    d = parts.d
    g_zpar = dot_tokens(g_z, u1)
    g_sinh_b = (g_z * d).sum(-1) + sign * h * g_zpar
    g_a = g_zpar * torch.where(aligned, cosh_a * cosh_b + sinh_a * sinh_b * (1.0 - h), cosh_ab + sinh_a * sinh_b * h)
    g_b = g_zpar * torch.where(aligned, sinh_a * sinh_b + cosh_a * cosh_b * (1.0 - h), cosh_a * cosh_b * h - cosh_ab)
    g_h = g_zpar * torch.where(aligned, -cosh_a * sinh_b, cosh_a * sinh_b)
    g_b = g_b + g_sinh_b * cosh_b
    g_h = g_h + sign * sinh_b * g_zpar  # v_perp = d + s h u1, h = 1/2 |d|^2, d = v - s u1
    g_d = torch.addcmul(g_z * sinh_b.unsqueeze(-1), g_h.unsqueeze(-1), d)
    g_u1 = sum_tokens(z_par + sign * sinh_b * (h - 1.0), g_z, u1) - sum_tokens(sign * g_h, d, u1)
    return g_a, g_u1, g_b, g_d


# --------------------------------------------------------------------------------------------
# the gyro layer norm
# --------------------------------------------------------------------------------------------
class BiasNear(NamedTuple):
    """The bias point added by Eq. 20 directly (``||b|| <= 1``, smooth at the origin)."""

    sinh_b: Tensor
    cosh_b: Tensor
    x_dot_u: Tensor
    denom: Tensor
    coef: Tensor


class BiasFar(NamedTuple):
    """The bias point added by the polar gyroaddition (Eq. 21) beyond the unit ball (the point itself)."""

    far_x: Tensor
    far_norm: Tensor


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
    big_x: Tensor
    x_sq: Tensor
    near: Tensor
    near_bias: BiasNear | None
    far_bias: BiasFar | None
    norm2: Tensor


class GyroNormWide(NamedTuple):
    """The token-by-coordinate intermediates of :func:`gyro_norm_forward` (rebuilt in backward): the input
    directions, their differences to the centroid direction, the centring's vectors, the centred directions, the
    output directions and the far bias point's gyroaddition."""

    u: Tensor
    diff: Tensor
    centring: GyroaddParts
    u_y: Tensor
    u_out: Tensor
    far_parts: GyroaddParts | None


def gyro_norm_forward(
    p: Tensor,
    log_gain: Tensor,
    bias: Tensor,
    k: float,
    eps: float,
    near_origin: bool | None = None,
) -> tuple[Tensor, GyroNormScalars, GyroNormWide]:
    """The gyro layer norm of ``p (B, N, n+1)`` over its tokens and the intermediates of its backward.

    ``near_origin`` says which form of Eq. 20 the bias point takes (:func:`bias_near_origin`); ``None``: both
    forms, selected by ``torch.where`` (no data-dependent branch: the host never reads a value of the device's, a
    traced graph has one form)."""
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
    big_x = bias / sk
    x_sq = big_x.square().sum()
    near = x_sq <= 1.0
    use_near, use_far = (True, True) if near_origin is None else (near_origin, not near_origin)
    near_bias: BiasNear | None = None
    far_bias: BiasFar | None = None
    far_parts: GyroaddParts | None = None
    z_near: Tensor | None = None
    z_far: Tensor | None = None
    if use_near:  # near the origin: Eq. 20 directly (smooth at b = o), as geometry.gyroadd_space
        sinh_b, cosh_b = sinh_cosh(b)
        x_dot_u = u_y @ big_x
        denom = torch.sqrt(1.0 + x_sq) + 1.0
        coef = x_dot_u * sinh_b / denom + cosh_b
        z_near = sinh_b.unsqueeze(-1) * u_y + coef.unsqueeze(-1) * big_x
        near_bias = BiasNear(sinh_b, cosh_b, x_dot_u, denom, coef)
    if use_far:  # beyond: the polar gyroaddition (Eq. 21) with the bias point in polar form
        far_x = big_x if near_origin is False else torch.where(near, torch.ones_like(big_x), big_x)
        far_norm = torch.linalg.vector_norm(far_x)
        z_far, far_parts = gyroadd_z(asinh_nonneg(far_norm), far_x / far_norm, b, u_y)
        far_bias = BiasFar(far_x, far_norm)
    z2: Tensor | None
    if z_near is not None and z_far is not None:
        z2 = torch.where(near, z_near, z_far)
    else:
        z2 = z_near if z_near is not None else z_far
    assert z2 is not None  # one branch always runs
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
        big_x,
        x_sq,
        near,
        near_bias,
        far_bias,
        norm2,
    )
    return out, scalars, GyroNormWide(u, diff, centring, u_y, u_out, far_parts)


def gyro_norm_backward(
    grad: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float, st: GyroNormScalars, wide: GyroNormWide
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/dp, dL/dlog_gain, dL/dbias)`` from the intermediates of :func:`gyro_norm_forward`."""
    sk = math.sqrt(k)
    tokens = st.a.shape[-1]
    g_z2 = polar_from_z_backward(grad[..., 0], grad[..., 1:], wide.u_out, st.norm2, sk)
    big_x, u_y, near = st.big_x, wide.u_y, st.near
    both = st.near_bias is not None and st.far_bias is not None
    g_b: Tensor | float = 0.0
    g_u_y: Tensor | float = 0.0
    g_bias: Tensor | float = 0.0
    if st.near_bias is not None:
        sinh_b, cosh_b, x_dot_u, denom, coef = st.near_bias
        g_z = torch.where(near, g_z2, 0.0) if both else g_z2
        g_coef = g_z @ big_x
        g_x_dot_u = g_coef * sinh_b / denom
        g_sinh_b = (g_z * u_y).sum(-1) + g_coef * x_dot_u / denom
        g_denom = -sum_dims(g_coef * x_dot_u * sinh_b) / denom**2
        g_big_x = sum_dims(coef.unsqueeze(-1) * g_z + g_x_dot_u.unsqueeze(-1) * u_y, keep=1)
        g_big_x = g_big_x + big_x * (g_denom / torch.sqrt(1.0 + st.x_sq))
        g_u_y = g_u_y + torch.addcmul(g_z * sinh_b.unsqueeze(-1), g_x_dot_u.unsqueeze(-1), big_x)
        g_b = g_b + g_sinh_b * cosh_b + g_coef * sinh_b
        g_bias = g_bias + (torch.where(near, g_big_x, 0.0) if both else g_big_x) / sk
    if st.far_bias is not None and wide.far_parts is not None:
        far_x, far_norm = st.far_bias
        u_bias = far_x / far_norm
        g_z = torch.where(near, 0.0, g_z2) if both else g_z2
        g_a_bias, g_u_bias, g_b_far, g_u_far = gyroadd_backward(g_z, u_bias, wide.far_parts)
        g_a_bias = sum_dims(g_a_bias)
        g_far_x = (g_a_bias / torch.sqrt(1.0 + far_norm**2)) * u_bias + (
            g_u_bias - (g_u_bias @ u_bias) * u_bias
        ) / far_norm
        g_b, g_u_y = g_b + g_b_far, g_u_y + g_u_far
        g_bias = g_bias + (torch.where(near, 0.0, g_far_x) if both else g_far_x) / sk
    # radius scaling r_y -> factor r_y, factor = e^{log_gain} / sqrt(variance + eps)
    g_b = torch.as_tensor(g_b)  # at least one branch ran: a tensor
    g_u_y = torch.as_tensor(g_u_y)
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
    return torch.cat([(g_a / sk).unsqueeze(-1), g_u], dim=-1), g_log_gain, torch.as_tensor(g_bias)


def rebuild_wide(p: Tensor, out: Tensor, st: GyroNormScalars) -> GyroNormWide:
    """The token-wide intermediates of :func:`gyro_norm_forward` from its input, output and per-token scalars,
    recomputed with the same operations (a few passes) instead of saved or recomputed with the whole forward.

    The centred directions ``u_y = z1 / ||z1||`` take the saved norm ``st.norm1`` rather than summing ``z1``'s
    squares again: one pass over the coordinates and a square root per token fewer."""
    u, u_hat = p[..., 1:], st.u_hat
    d, v_perp, z1 = gyroadd_vectors(-u_hat.unsqueeze(-2), u, st.centring)
    u_y = safe_normalize(z1, st.norm1)
    far = st.far_bias
    far_parts = None if far is None else gyroadd_z(asinh_nonneg(far.far_norm), far.far_x / far.far_norm, st.b, u_y)[1]
    return GyroNormWide(u, u - u_hat.unsqueeze(-2), GyroaddParts(st.centring, d, v_perp), u_y, out[..., 1:], far_parts)


def bias_near_origin(bias: Tensor, k: float) -> bool | None:
    """Whether the bias point ``b = bias / sqrt(k)`` lies within ``||b|| <= 1``, where Eq. 20 is used directly (else
    the polar gyroaddition, Eq. 21): read from host memory, eagerly on the CPU; ``None`` off the CPU (reading it
    would make the host wait for the device, and no such wait may happen while a CUDA graph is captured) and
    inside ``torch.compile`` (the value is data): :func:`gyro_norm_forward` then carries both forms.

    Known before a compiled kernel runs, it specialises the kernel to the one form in use: a kernel traced without
    it computes both forms for every token (the layer norm's forward about 3x, its backward about 2x the time)."""
    if torch.compiler.is_compiling() or bias.device.type != "cpu":
        return None
    return bool((bias / math.sqrt(k)).square().sum() <= 1.0)


def _saved_forward(
    p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float, near_origin: bool | None
) -> tuple[Tensor, GyroNormScalars]:
    """The output of :func:`gyro_norm_forward` and the scalars its backward keeps."""
    out, scalars, _ = gyro_norm_forward(p, log_gain, bias, k, eps, near_origin)
    return out, scalars


def _gradients(
    grad: Tensor, p: Tensor, out: Tensor, log_gain: Tensor, bias: Tensor, st: GyroNormScalars, k: float, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients from the input, output and saved scalars (:func:`rebuild_wide`, :func:`gyro_norm_backward`)."""
    return gyro_norm_backward(grad, log_gain, bias, k, eps, st, rebuild_wide(p, out, st))


@registered_operators()
class FusedGyroLayerNorm(torch.autograd.Function):
    r"""Gyro layer normalisation (Sec. 4.4) as one function (see the module docstring).  Saved: the input, the
    output, ``log_gain``, the bias point and the per-token / per-sample :class:`GyroNormScalars`."""

    @staticmethod
    def forward(
        ctx: Any,
        p: Tensor,
        log_gain: Tensor,
        bias: Tensor,
        k: float,
        eps: float,  # noqa: D102
        near_origin: bool | None,
    ) -> Tensor:
        out, small = run_maybe_compiled(_saved_forward, p, p, log_gain, bias, k, eps, near_origin)
        save_with_record(ctx, small, p, log_gain, bias, out)
        ctx.k, ctx.eps = k, eps
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        (p, log_gain, bias, out), small = saved_with_record(ctx)
        g_p, g_log_gain, g_bias = run_maybe_compiled(
            _gradients, p, grad.contiguous(), p, out, log_gain, bias, small, ctx.k, ctx.eps
        )
        return g_p, g_log_gain, g_bias, None, None, None


def fused_gyro_layer_norm(p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> Tensor:
    """Gyro layer norm of ``p (B, N, n+1)`` over its tokens; see :class:`FusedGyroLayerNorm` (its bias point's form
    known on the CPU, :func:`bias_near_origin`)."""
    return fused_apply(FusedGyroLayerNorm, p, log_gain, bias, float(k), float(eps), bias_near_origin(bias, k))
