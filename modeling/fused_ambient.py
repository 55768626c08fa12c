"""The ambient twin's layers with hand-derived backward passes: the gyro layer norm
(:meth:`ManifoldOps.gyro_layer_norm` in ambient coordinates, :class:`FusedAmbientGyroLayerNorm`), the Polar-FC's
output points (Eq. 8 in ambient coordinates, :class:`FusedAmbientFCOutput`), the boost residual (Eq. 12,
:func:`fused_ambient_boost_residual`) and the relative position encodings on the time and the four reserved
coordinates (:func:`ambient_relative_position`), each with the formulas of :class:`manifold_ops.AmbientOps` (the
textbook Lorentz formulas of :mod:`ambient`).

The gyro layer norm, for the tokens ``x_i = (x_i0, x_is) (B, N, n+1)`` of a sample:

* centroid, Eq. 4 with weights ``1/N``: ``s = mean_i x_i``, ``mu = sqrt(k) s / sqrt(|<s, s>_L|)``;
* dispersion, Eq. 1: ``sigma^2 = mean_i k arcosh(alpha_i)^2``, ``alpha_i = -<x_i, mu>_L / k`` (clamped at
  ``1 + 1e-8``);
* centring ``(-)mu (+) x_i``, Eq. 20 with ``(-)mu = (mu_0, -mu_s)``: ``z_i = x_is - c_i mu_s``,
  ``c_i = -(x_is . mu_s) / (sqrt(k) (mu_0 + sqrt(k))) + x_i0 / sqrt(k)``, the point ``(sqrt(k + |z_i|^2), z_i)``;
* radius scaling: ``r_i = sqrt(k) arcosh(sqrt(k + |z_i|^2) / sqrt(k))`` (from the time coordinate, as ambient
  models read it), ``u_i = z_i / |z_i|``, ``y_i = (sqrt(k) cosh a_i, sqrt(k) sinh a_i u_i)`` with
  ``a_i = gamma r_i / (sqrt(k) sqrt(sigma^2 + eps))``;
* bias point ``b (+) y_i``, Eq. 20 with ``b = (sqrt(k + |b_s|^2), b_s)``: ``w_i = y_is + e_i b_s``,
  ``e_i = (b_s . y_is) / (sqrt(k) (b_0 + sqrt(k))) + y_i0 / sqrt(k)``, the output ``(sqrt(k + |w_i|^2), w_i)``.

The backward differentiates these expressions as autograd would (``arcosh'(x) = 1 / sqrt(x^2 - 1)``, the clamps
passing the gradient where the argument is at or above the bound), so in float64 its gradients are the
reference's to rounding.  Where a centred token's time coordinate rounds to ``sqrt(k)`` (the token at the
centroid, to rounding), ``arcosh``'s slope is infinite: its radius passes no gradient there, where autograd's is
infinite or ``NaN``.  The forward keeps its input, its output, the centroid and per-token scalars
(:class:`AmbientNormSaved`); the backward rebuilds the token-wide ``z_i``, ``u_i`` and ``y_is`` from them in a few
passes.  Forward and backward are each one compiled kernel in
float32 on the CPU (:mod:`cpu_kernels`), with the ambient twin's inductor options (:data:`AMBIENT_KERNELS`).

The boost residual reads ``x = (a, u)`` and ``f(x) = (b, v)`` as :meth:`manifold_ops.AmbientOps.polar` does
(``a = arcosh(x_0 / sqrt(k))``, ``u = x_s / |x_s|``) and takes the polar step per token, as the polar
:class:`fused_layers.FusedBoostResidual` (:func:`fused_layers.boost_tokens`, :func:`fused_layers.boost_gradients`):
two passes of sums and one that writes, forward and backward.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and sibling modules.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .ambient import (
    klein as ambient_klein,
    lorentz_normalize,
    lorentz_normalize_backward,
    norm_floor,
    radius as ambient_radius,
)
from .configuration_polar_vit import POSITION_AXES
from .cpu_kernels import (
    first_order,
    inductor_options,
    leading_cat,
    run_maybe_compiled,
    save_with_record,
    saved_with_record,
    sum_dims,
)
from .fused_layers import (
    BoostCoefficients,
    BoostDots,
    BoostKernels,
    BoostTokens,
    CotangentDots,
    FusedBoostResidual,
    boost_direction,
    boost_dots,
    boost_gradients,
    boost_tokens,
    heads_to_coordinates,
    polar_fc_log_radius,
    radius_offset,
    radius_rule_gradients,
    token_outer_sum,
)
from .operators import fused_apply, registered_operators
from .stable_math import inverse_or_zero, safe_normalize, sinh_cosh

__all__ = [
    "AMBIENT_BOOST",
    "AMBIENT_KERNELS",
    "AmbientBoostParts",
    "AmbientNormSaved",
    "FusedAmbientFCOutput",
    "FusedAmbientGyroLayerNorm",
    "ambient_boost_parts",
    "ambient_boost_residual_backward",
    "ambient_boost_residual_forward",
    "ambient_fc_backward",
    "ambient_fc_forward",
    "ambient_relative_position",
    "ambient_relative_position_backward",
    "fused_ambient_boost_residual",
    "fused_ambient_fc_output",
    "fused_ambient_gyro_layer_norm",
]

# the ambient twin's kernels store every value read more than once: inductor otherwise evaluates each per-token
# sinh / cosh / arcosh again in every loop over the coordinates that reads it (``benchmarks/step_time.py``)
AMBIENT_KERNELS = inductor_options(realize_reads_threshold=1)


class AmbientNormSaved(NamedTuple):
    """What :class:`FusedAmbientGyroLayerNorm` keeps besides its input and output: the centroid ``s`` before
    normalising and ``mu`` ``(B, 1, n+1)``, ``sigma^2`` and the scale ``gamma / sqrt(sigma^2 + eps)`` ``(B, 1)``, and
    per token ``x_is . mu_s``, ``arcosh alpha_i``, ``|z_i|``, the time coordinate ``sqrt(k + |z_i|^2)``,
    ``r_i``, ``sinh a_i``, ``cosh a_i`` and ``e_i`` ``(B, N)``."""

    s: Tensor
    mu: Tensor
    variance: Tensor
    factor: Tensor
    dot: Tensor
    acosh_alpha: Tensor
    z_norm: Tensor
    z_time: Tensor
    r: Tensor
    sinh_a: Tensor
    cosh_a: Tensor
    e: Tensor


def _centring_coef(p: Tensor, dot: Tensor, mu: Tensor, sk: float) -> Tensor:
    """``c_i = -(x_is . mu_s) / (sqrt(k) (mu_0 + sqrt(k))) + x_i0 / sqrt(k)`` ``(B, N)`` of the centring (Eq. 20)."""
    return -dot / (sk * (mu[..., 0] + sk)) + p[..., 0] / sk


def _bias_time(bias: Tensor, k: float) -> Tensor:
    """The bias point's time coordinate ``b_0 = sqrt(k + |b_s|^2)``."""
    return torch.sqrt(k + bias.square().sum())


@AMBIENT_KERNELS
def ambient_norm_forward(
    p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float
) -> tuple[Tensor, AmbientNormSaved]:
    """The ambient gyro layer norm of ``p (B, N, n+1)`` (the module docstring's steps) and what its backward
    keeps."""
    sk = math.sqrt(k)
    xs = p[..., 1:]
    s = p.new_full((*p.shape[:-2], 1, p.shape[-2]), 1.0 / p.shape[-2]) @ p  # (B, 1, n+1), as the reference
    mu = lorentz_normalize(s, k)
    dot = (xs * mu[..., 1:]).sum(-1)  # (B, N)
    alpha = -(dot - p[..., 0] * mu[..., 0]) / k
    acosh_alpha = torch.acosh(alpha.clamp_min(1.0 + norm_floor()))
    variance = (sk * acosh_alpha).square().mean(-1, keepdim=True)  # (B, 1)
    z = xs - _centring_coef(p, dot, mu, sk).unsqueeze(-1) * mu[..., 1:]
    z_norm = torch.linalg.vector_norm(z, dim=-1)
    z_time = torch.sqrt(k + z.square().sum(-1))
    r = sk * torch.acosh((z_time / sk).clamp_min(1.0))
    factor = torch.exp(log_gain) / torch.sqrt(variance + eps)
    a = r * factor / sk
    sinh_a, cosh_a = torch.sinh(a), torch.cosh(a)
    y_space = (sk * sinh_a).unsqueeze(-1) * safe_normalize(z, z_norm)
    e = (y_space * bias).sum(-1) / (sk * (_bias_time(bias, k) + sk)) + sk * cosh_a / sk
    w = y_space + e.unsqueeze(-1) * bias
    out = torch.cat([torch.sqrt(k + w.square().sum(-1, keepdim=True)), w], dim=-1)
    saved = AmbientNormSaved(s, mu, variance, factor, dot, acosh_alpha, z_norm, z_time, r, sinh_a, cosh_a, e)
    return out, saved


@AMBIENT_KERNELS
def ambient_norm_backward(
    grad: Tensor, p: Tensor, out: Tensor, log_gain: Tensor, bias: Tensor, st: AmbientNormSaved, k: float, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/dp, dL/dlog_gain, dL/dbias)`` of :func:`ambient_norm_forward` from its input, output and saved
    scalars, the module docstring's steps in reverse."""
    sk = math.sqrt(k)
    tokens = p.shape[-2]
    xs, mu_s, mu_0 = p[..., 1:], st.mu[..., 1:], st.mu[..., 0]
    # rebuild z_i, u_i and y_is
    coef = _centring_coef(p, st.dot, st.mu, sk)
    z = xs - coef.unsqueeze(-1) * mu_s
    u = safe_normalize(z, st.z_norm)
    y_space = (sk * st.sinh_a).unsqueeze(-1) * u
    # output (w_0, w) = from_space(w): dL/dw = g_s + g_0 w / w_0
    w = out[..., 1:]
    g_w = torch.addcmul(grad[..., 1:], (grad[..., 0] / out[..., 0]).unsqueeze(-1), w)
    # bias gyroaddition w = y_s + e b_s, e = (b_s . y_s) / (sqrt(k) (b_0 + sqrt(k))) + y_0 / sqrt(k)
    bias_time = _bias_time(bias, k)
    inv_b = 1.0 / (sk * (bias_time + sk))
    g_e = g_w @ bias
    g_y_space = torch.addcmul(g_w, (g_e * inv_b).unsqueeze(-1), bias)
    bias_dot = (y_space @ bias) * g_e
    g_bias = sum_dims(st.e.unsqueeze(-1) * g_w + (g_e * inv_b).unsqueeze(-1) * y_space, keep=1)
    g_bias = g_bias - (sk * inv_b * inv_b / bias_time) * sum_dims(bias_dot) * bias
    # radius scaling y = (sqrt(k) cosh a, sqrt(k) sinh a u), a = factor r / sqrt(k)
    g_a = g_e * st.sinh_a + sk * (g_y_space * u).sum(-1) * st.cosh_a  # dL/dy_0 = g_e / sqrt(k)
    g_u = (sk * st.sinh_a).unsqueeze(-1) * g_y_space
    g_factor = (g_a * st.r).sum(-1, keepdim=True) / sk
    g_r = g_a * st.factor / sk
    g_log_gain = sum_dims(g_factor * st.factor)
    g_variance = -0.5 * g_factor * st.factor / (st.variance + eps)
    # u = z / |z| and r = sqrt(k) arcosh(z_0 / sqrt(k)), z_0 = sqrt(k + |z|^2): dz_0 / dz = z / z_0
    inv_norm = inverse_or_zero(st.z_norm)
    x = st.z_time / sk
    slope = torch.where(x > 1.0, g_r * torch.rsqrt(x * x - 1.0) / st.z_time, 0.0)
    g_z = torch.addcmul(g_u * inv_norm.unsqueeze(-1), (slope - (g_u * u).sum(-1) * inv_norm.square()).unsqueeze(-1), z)
    # centring z = x_s - c mu_s, c = -(x_s . mu_s) / (sqrt(k) (mu_0 + sqrt(k))) + x_0 / sqrt(k)
    inv_c = 1.0 / (sk * (mu_0 + sk))  # (B, 1)
    f = (g_z @ mu_s.transpose(-1, -2)).squeeze(-1)  # g_z . mu_s = -dL/dc
    # dispersion sigma^2 = mean k arcosh(alpha)^2, alpha = (x_0 mu_0 - x_s . mu_s) / k
    alpha = -(st.dot - p[..., 0] * mu_0) / k
    g_alpha = torch.where(
        alpha >= 1.0 + norm_floor(),
        (g_variance * (2.0 * k / tokens)) * st.acosh_alpha * torch.rsqrt(alpha * alpha - 1.0),
        0.0,
    )
    along_mu = f * inv_c - g_alpha / k  # dL/dx_s's part along mu_s
    g_x0 = g_alpha * mu_0 / k - f / sk
    g_xs = torch.addcmul(g_z, along_mu.unsqueeze(-1), mu_s)
    g_mu_s = along_mu.unsqueeze(-2) @ xs - coef.unsqueeze(-2) @ g_z  # (B, 1, n)
    g_mu_0 = ((g_alpha * p[..., 0]) / k - f * st.dot * (sk * inv_c * inv_c)).sum(-1, keepdim=True)
    g_mu = torch.cat([g_mu_0.unsqueeze(-1), g_mu_s], dim=-1)
    # centroid mu = lorentz_normalize(s), s = mean x
    g_s = lorentz_normalize_backward(st.s, g_mu, k) / tokens
    g_p = torch.cat([g_x0.unsqueeze(-1), g_xs], dim=-1) + g_s
    return g_p, g_log_gain.reshape(log_gain.shape), g_bias


@registered_operators()
class FusedAmbientGyroLayerNorm(torch.autograd.Function):
    """The ambient gyro layer norm (see the module docstring) as one function.  Saved: the input, the output,
    ``log_gain``, the bias point and :class:`AmbientNormSaved`."""

    @staticmethod
    def forward(ctx: Any, p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> Tensor:  # noqa: D102
        out, saved = run_maybe_compiled(ambient_norm_forward, p, p, log_gain, bias, k, eps)
        save_with_record(ctx, saved, p, log_gain, bias, out)
        ctx.k, ctx.eps = k, eps
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        (p, log_gain, bias, out), saved = saved_with_record(ctx)
        g_p, g_log_gain, g_bias = run_maybe_compiled(
            ambient_norm_backward, p, grad.contiguous(), p, out, log_gain, bias, saved, ctx.k, ctx.eps
        )
        return g_p, g_log_gain, g_bias, None, None


def fused_ambient_gyro_layer_norm(p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> Tensor:
    """The ambient gyro layer norm of ``p (B, N, n+1)`` over its tokens; see :class:`FusedAmbientGyroLayerNorm`."""
    return fused_apply(FusedAmbientGyroLayerNorm, p, log_gain, bias, float(k), float(eps))


# --------------------------------------------------------------------------------------------
# Polar-FC output points (Eq. 8) in ambient coordinates
# --------------------------------------------------------------------------------------------
AmbientRule = tuple[Tensor, Tensor, Tensor, Tensor]  # Eq. 8's (beta, lambda, varphi, varphi_0)


def _arcosh_slope(p: Tensor, k: float) -> Tensor:
    """``d a / d x_0`` of ``a = arcosh(x_0 / sqrt(k))``: ``1 / (sqrt(k) sqrt((x - 1)(x + 1)))`` with ``x = x_0 /
    sqrt(k)``; 0 where ``x`` rounds to 1 or below, where the slope is infinite."""
    sk = math.sqrt(k)
    x = p[..., 0] / sk
    above = x > 1.0
    return torch.where(above, torch.rsqrt(torch.where(above, (x - 1.0) * (x + 1.0), 1.0)) / sk, 0.0)


@AMBIENT_KERNELS
def ambient_fc_forward(
    h: Tensor, p: Tensor, rule: AmbientRule | None, k: float, gelu: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, ||h||, e^l)`` of Eq. 8 in ambient coordinates, straight from the log-radius ``l`` of the product
    ``h (..., H, d)`` (before the GELU when ``gelu``) and the input points ``p (..., n+1)``: ``sinh(r' / sqrt(k)) =
    e^l``, so ``x_s = sqrt(k) e^l h / ||h||`` and ``x_0 = sqrt(k) hypot(e^l, 1)``.  With the radius rule
    ``(beta, lambda, varphi, varphi_0)``, ``l = beta ln||h|| + lambda a + varphi . chi + varphi_0`` with ``a`` and
    ``chi`` read from ``p`` as ambient models do (:func:`ambient.radius`, :func:`ambient.klein`); without it
    ``l = ln||h||`` and ``x_s = sqrt(k) h``, the ambient Lorentz linear layer."""
    sk = math.sqrt(k)
    offset, norm_power = None, None
    if rule is not None:
        norm_power, radius_weight, klein_weight, radius_bias = rule
        klein_term = ambient_klein(p) @ klein_weight.t()
        offset = radius_offset(ambient_radius(p, k) / sk, klein_term, radius_weight, radius_bias)
    h, norm, log_radius = polar_fc_log_radius(h, offset, norm_power, gelu)
    sinh_l = torch.exp(log_radius)
    space = (sk * sinh_l).unsqueeze(-1) * safe_normalize(h, norm)
    time = sk * torch.hypot(sinh_l, torch.ones_like(sinh_l))
    return leading_cat(time, space), norm, sinh_l


@AMBIENT_KERNELS
def ambient_fc_backward(
    grad: Tensor,
    kept: Tensor,
    norm: Tensor,
    sinh_l: Tensor,
    p: Tensor | None,
    weights: tuple[Tensor, Tensor, Tensor] | None,
    k: float,
    gelu: bool,
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...] | None]:
    """``(dL/dh, dL/dp, dL/drule)`` of :func:`ambient_fc_forward` from ``||h||``, ``e^l`` and ``kept``: the output
    points, or with the GELU the pre-activation product (the directions ``u'`` read from either; with the rule, the
    input points and ``weights = (beta, lambda, varphi)``).  With ``s = e^l``:

        g_l = sqrt(k) s (g_0 s / hypot(s, 1) + g_s . u'),   g_u' = sqrt(k) s g_s,
        g_h = (g_u' + (beta g_l - g_u' . u') u') / ||h||   (beta = 1 without the rule),

    the rule's parameters ``(sum g_l ln||h||, sum g_l a, sum g_l chi^T, sum g_l)`` and the input's ``g_a = lambda .
    g_l``, ``g_chi = varphi^T g_l`` through ``a = arcosh(x_0 / sqrt(k))`` (no gradient where ``x_0 / sqrt(k)``
    rounds to 1: its slope is infinite there) and ``chi = x_s / x_0``."""
    sk = math.sqrt(k)
    g_time, g_space = grad[..., 0], grad[..., 1:]
    u = safe_normalize(torch.nn.functional.gelu(kept), norm) if gelu else safe_normalize(kept[..., 1:])
    g_u = (sk * sinh_l).unsqueeze(-1) * g_space
    g_l = sk * sinh_l * (g_time * sinh_l / torch.hypot(sinh_l, torch.ones_like(sinh_l)) + (g_space * u).sum(-1))
    coef = (g_l if weights is None else g_l * weights[0]) - (g_u * u).sum(-1)
    g_h = torch.addcmul(g_u, coef.unsqueeze(-1), u) * inverse_or_zero(norm).unsqueeze(-1)
    if gelu:
        g_h = torch.ops.aten.gelu_backward(g_h, kept)
    if weights is None or p is None:
        return g_h, None, None
    _, radius_weight, klein_weight = weights
    a, chi = ambient_radius(p, k) / sk, ambient_klein(p)
    g_rule = radius_rule_gradients(g_l, norm, a, token_outer_sum(g_l, chi))
    g_chi = heads_to_coordinates(g_l, klein_weight)  # (..., n)
    x0 = p[..., 0]
    g_a = (g_l @ radius_weight) * _arcosh_slope(p, k)
    g_x0 = g_a - (g_chi * p[..., 1:]).sum(-1) / x0.square()
    return g_h, torch.cat([g_x0.unsqueeze(-1), g_chi / x0.unsqueeze(-1)], -1), g_rule


@registered_operators()
class FusedAmbientFCOutput(torch.autograd.Function):
    """The output points of an ambient Polar-FC (:func:`ambient_fc_forward`) from its product ``h`` and input points
    ``p``, with a hand-derived backward (:func:`ambient_fc_backward`).  Saved: ``||h||`` and ``e^l`` per head, the
    output (which the next layer keeps anyway) or, before a GELU, the product in its place (which the output does not
    determine), the input points only with the radius rule (the product keeps them anyway), and the rule's
    parameters."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any,
        h: Tensor,
        p: Tensor,
        norm_power: Tensor | None,
        radius_weight: Tensor | None,
        klein_weight: Tensor | None,
        radius_bias: Tensor | None,
        k: float,
        gelu: bool,
    ) -> Tensor:
        rule = None if norm_power is None else (norm_power, radius_weight, klein_weight, radius_bias)
        out, norm, sinh_l = run_maybe_compiled(ambient_fc_forward, h, h, p, rule, k, gelu)
        kept_p = None if rule is None else p
        ctx.save_for_backward(h if gelu else out, norm, sinh_l, kept_p, norm_power, radius_weight, klein_weight)
        ctx.k, ctx.gelu = k, gelu
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        kept, norm, sinh_l, p, norm_power, radius_weight, klein_weight = ctx.saved_tensors
        weights = None if norm_power is None else (norm_power, radius_weight, klein_weight)
        g_h, g_p, g_rule = run_maybe_compiled(
            ambient_fc_backward, kept, grad.contiguous(), kept, norm, sinh_l, p, weights, ctx.k, ctx.gelu
        )
        return g_h, g_p, *(g_rule if g_rule is not None else (None,) * 4), None, None


def fused_ambient_fc_output(h: Tensor, p: Tensor, rule: AmbientRule | None, k: float, gelu: bool) -> Tensor:
    """The ambient Polar-FC's output points ``(..., H, d+1)`` from its product ``h (..., H, d)`` and input points
    ``p (..., n+1)``; see :class:`FusedAmbientFCOutput`."""
    parameters = rule if rule is not None else (None, None, None, None)
    return fused_apply(FusedAmbientFCOutput, h, p, *parameters, float(k), bool(gelu))


# --------------------------------------------------------------------------------------------
# boost residual (Eq. 12) in ambient coordinates
# --------------------------------------------------------------------------------------------
def _unit_dot(dot: Tensor, first: tuple[Tensor, Tensor], norm_a: Tensor, norm_b: Tensor) -> Tensor:
    """``a / |a| . b / |b|`` from ``dot = a . b``, the norms and the first coordinates ``first = (a_0, b_0)``, with
    :func:`stable_math.safe_normalize`'s ``e_0`` as a zero vector's direction."""
    a_pos, b_pos = norm_a > 0, norm_b > 0
    a_0 = first[0] * inverse_or_zero(norm_a)  # a / |a| . e_0
    b_0 = first[1] * inverse_or_zero(norm_b)
    both = dot * inverse_or_zero(norm_a * norm_b)
    return torch.where(a_pos & b_pos, both, torch.where(a_pos, a_0, torch.where(b_pos, b_0, 1.0)))


class AmbientBoostParts(NamedTuple):
    """What Eq. 12 reads of ambient points ``x, f`` as ambient models read them
    (:meth:`manifold_ops.AmbientOps.polar`): ``|x_s|``, ``|f_s|``, the direction ``u = x_s / |x_s|`` ``(.., n)``
    (:func:`stable_math.safe_normalize`), :class:`fused_layers.BoostDots`, :class:`fused_layers.BoostTokens` (the
    radii ``arcosh(x_0 / sqrt(k))``, :func:`ambient.radius` over ``sqrt(k)``) and ``d = v - s u`` with ``v = f_s /
    |f_s|``."""

    norm_x: Tensor
    norm_f: Tensor
    u: Tensor
    dots: BoostDots
    tok: BoostTokens
    d: Tensor


def ambient_boost_parts(x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, k: float) -> AmbientBoostParts:
    """:class:`AmbientBoostParts` of ``x, f (B, N, n+1)`` in two passes over the coordinates: the norms and ``u .
    v = x_s . f_s / (|x_s| |f_s|)``, then the sums over ``u`` and ``d`` (:func:`fused_layers.boost_dots`)."""
    sk = math.sqrt(k)
    xs, fs = x[..., 1:], f[..., 1:]
    norm_x, norm_f = torch.linalg.vector_norm(xs, dim=-1), torch.linalg.vector_norm(fs, dim=-1)
    u = safe_normalize(xs, norm_x)
    cos = _unit_dot((xs * fs).sum(-1), (xs[..., 0], fs[..., 0]), norm_x, norm_f)
    dots, d = boost_dots(u, safe_normalize(fs, norm_f), cos)
    b = ambient_radius(f, k) / sk
    tok = boost_tokens(ambient_radius(x, k) / sk, b if strength is None else b * strength, alpha, dots)
    return AmbientBoostParts(norm_x, norm_f, u, dots, tok, d)


def ambient_boost_residual_forward(
    x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, k: float
) -> tuple[Tensor, BoostTokens, Tensor, Tensor]:
    """Eq. 12 on ambient points ``x, f (B, N, n+1)`` as :meth:`manifold_ops.AmbientOps.boost_residual` computes
    it: the polar parts read from the ambient coordinates (:func:`ambient_boost_parts`), the polar step per token
    (:func:`fused_layers.boost_tokens`), the output ``(sqrt(k) cosh A, sqrt(k) sinh A u')`` with ``A = |a'|``.  Two
    passes of sums and one that writes; then the per-token terms, stored once."""
    p = ambient_boost_parts(x, f, alpha, strength, k)
    sinh_a, cosh_a = sinh_cosh(p.tok.a_new.abs())
    sk = math.sqrt(k)
    space = (sk * sinh_a).unsqueeze(-1) * boost_direction(p.tok, p.u, p.d)
    return torch.cat([(sk * cosh_a).unsqueeze(-1), space], -1), p.tok, sinh_a, cosh_a


@AMBIENT_KERNELS
def ambient_boost_residual_backward(
    grad: Tensor, x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, k: float
) -> tuple[Tensor, ...]:
    """``(dL/dx, dL/df, dL/dalpha)`` of :func:`ambient_boost_residual_forward`, its per-token terms recomputed.
    With ``A = |a'|``: ``g_A = sqrt(k) (g_0 sinh A + cosh A g_s . u')`` and ``g_u' = sqrt(k) sinh A g_s``, then
    :func:`fused_layers.boost_gradients`, then the normalisations ``u = x_s / |x_s|``, ``v = f_s / |f_s|``
    differentiated, ``(g_u - (g_u . u) u) / |x_s|`` (the dot products per token again, with ``v = d + s u``), and
    :func:`_arcosh_slope`.  Two passes of sums and one that writes both gradients; then the coefficients
    (:data:`fused_layers.BOOST_TERMS`)."""
    p = ambient_boost_parts(x, f, alpha, strength, k)
    dots, tok, s = p.dots, p.tok, p.dots.sign
    gs = grad[..., 1:]
    g_dots = CotangentDots((gs * p.u).sum(-1), (gs * p.d).sum(-1))  # beside the sums over u and d
    sk = math.sqrt(k)
    sinh_a, cosh_a = sinh_cosh(tok.a_new.abs())
    g_dir = torch.where(
        tok.norm > 0, (tok.t * g_dots.u + tok.sigma * g_dots.d) * inverse_or_zero(tok.norm), gs[..., 0]
    )
    g_radius = sk * (grad[..., 0] * sinh_a + cosh_a * tok.flip * g_dir)  # g_dir = g_s . D / |D| (e_0 at D = 0)
    g = boost_gradients(tok, dots, g_dots, alpha, g_radius, sk * sinh_a)
    eu, ev = g.u, g.v
    g_v_dot = g_dots.d + s * g_dots.u  # g_s . v
    eu_dot = eu.g * g_dots.u + eu.u * dots.uu + eu.d * dots.ud  # g_u . u
    ev_dot = ev.g * g_v_dot + ev.u * (dots.ud + s * dots.uu) + ev.d * (dots.dd + s * dots.ud)  # g_v . v
    inv_x, inv_f = inverse_or_zero(p.norm_x), inverse_or_zero(p.norm_f)
    cx = BoostCoefficients(eu.g * inv_x, (eu.u - eu_dot) * inv_x, eu.d * inv_x)
    cf = BoostCoefficients(ev.g * inv_f, (ev.u - s * ev_dot) * inv_f, (ev.d - ev_dot) * inv_f)
    g_b = g.b if strength is None else g.b * strength
    g_x = torch.cat([(g.a * _arcosh_slope(x, k)).unsqueeze(-1), cx.combine(gs, p.u, p.d)], -1)
    g_f = torch.cat([(g_b * _arcosh_slope(f, k)).unsqueeze(-1), cf.combine(gs, p.u, p.d)], -1)
    return g_x, g_f, g.alpha, *cx, *cf


AMBIENT_BOOST = BoostKernels(ambient_boost_residual_forward, ambient_boost_residual_backward)  # ambient points, k


def fused_ambient_boost_residual(x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, k: float) -> Tensor:
    """The boost residual (Eq. 12) of ambient points ``x, f (B, N, n+1)``; ``strength (B, 1)`` or ``None``: a
    :class:`fused_layers.FusedBoostResidual` with :func:`ambient_boost_residual_forward` and
    :func:`ambient_boost_residual_backward`."""
    return fused_apply(FusedBoostResidual, x, f, alpha, strength, float(k), AMBIENT_BOOST)


# --------------------------------------------------------------------------------------------
# relative position encodings (Eq. 10, HoPE, HOPE) on the five leading coordinates
# --------------------------------------------------------------------------------------------
Columns = tuple[Tensor, ...]  # the time and the four reserved coordinates, each its own (B, N, H) plane


def _cosh_sinh(t: Tensor) -> tuple[Tensor, Tensor]:
    """``(cosh t, sinh t)`` of the rates: torch's functions eagerly (the reference's bits), inside a compiled kernel
    from one ``expm1`` (:func:`stable_math.sinh_cosh`, a few ulp), since torch's ``sinh`` and ``cosh`` run in scalar
    code there (``benchmarks/vector_math.py``)."""
    if torch.compiler.is_compiling():
        sinh_t, cosh_t = sinh_cosh(t)
        return cosh_t, sinh_t
    return torch.cosh(t), torch.sinh(t)


def _move(kind: str, c: Columns, t: Tensor, axes: tuple[int, int]) -> Columns:
    """One move of :meth:`manifold_ops.ManifoldOps.relative_position` in ambient coordinates on the columns ``c``
    (the formulas of :func:`ambient.horoshift`, :func:`ambient.boost`, :func:`ambient.rotate`, in their order), by
    ``t (N, H)`` on the space axes ``axes``:

    * ``horoshift`` (Eq. 10): ``nu = x_0 - x_i``, ``l = t x_j + t^2 nu / 2``, ``(x_0, x_i, x_j) += (l, l, t nu)``;
    * ``boost`` along ``i``: ``(x_0, x_i) -> (cosh t x_0 + sinh t x_i, sinh t x_0 + cosh t x_i)``;
    * ``rotation`` of ``(i, j)``: ``(x_i, x_j) -> (cos t x_i - sin t x_j, sin t x_i + cos t x_j)``,

    with ``i, j`` the columns ``1 + axes``."""
    i, j = 1 + axes[0], 1 + axes[1]
    out = list(c)
    if kind == "horoshift":
        nu = c[0] - c[i]
        lift = t * c[j] + 0.5 * t.square() * nu
        out[0], out[i], out[j] = c[0] + lift, c[i] + lift, c[j] + t * nu
    elif kind == "boost":
        cosh_t, sinh_t = _cosh_sinh(t)
        out[0] = cosh_t * c[0] + sinh_t * c[i]
        out[i] = sinh_t * c[0] + cosh_t * c[i]
    else:
        cos_t, sin_t = torch.cos(t), torch.sin(t)
        out[i] = cos_t * c[i] - sin_t * c[j]
        out[j] = sin_t * c[i] + cos_t * c[j]
    return tuple(out)


def _move_backward(kind: str, g: Columns, c: Columns, t: Tensor, axes: tuple[int, int]) -> tuple[Columns, Tensor]:
    """``(dL/dc, dL/dt per token)`` of :func:`_move` at ``c`` for the gradients ``g`` of its output columns.  Each
    move is linear in the point, so ``dL/dc`` is its transpose applied to ``g``:

    * ``horoshift``, with ``G = g_0 + g_i``: ``g_x0 = g_0 + G t^2/2 + t g_j``, ``g_xi = g_i - G t^2/2 - t g_j``,
      ``g_xj = g_j + t G``, ``g_t = G (x_j + t nu) + g_j nu``;
    * ``boost``: ``(g_x0, g_xi) = (cosh t g_0 + sinh t g_i, sinh t g_0 + cosh t g_i)``, ``g_t = g_0 x'_i + g_i
      x'_0``;
    * ``rotation``: ``(g_xi, g_xj) = (cos t g_i + sin t g_j, cos t g_j - sin t g_i)``, ``g_t = g_j x'_i - g_i
      x'_j``,

    with ``x'`` the move's output, written out from ``c`` with the one ``cosh t, sinh t`` (``cos t, sin t``)."""
    i, j = 1 + axes[0], 1 + axes[1]
    out = list(g)
    if kind == "horoshift":
        nu = c[0] - c[i]
        both, half_sq = g[0] + g[i], 0.5 * t.square()
        g_t = both * (c[j] + t * nu) + g[j] * nu
        out[0] = g[0] + half_sq * both + t * g[j]
        out[i] = g[i] - half_sq * both - t * g[j]
        out[j] = g[j] + t * both
    elif kind == "boost":
        cosh_t, sinh_t = _cosh_sinh(t)
        g_t = g[0] * (sinh_t * c[0] + cosh_t * c[i]) + g[i] * (cosh_t * c[0] + sinh_t * c[i])
        out[0] = cosh_t * g[0] + sinh_t * g[i]
        out[i] = sinh_t * g[0] + cosh_t * g[i]
    else:
        cos_t, sin_t = torch.cos(t), torch.sin(t)
        g_t = g[j] * (cos_t * c[i] - sin_t * c[j]) - g[i] * (sin_t * c[i] + cos_t * c[j])
        out[i] = cos_t * g[i] + sin_t * g[j]
        out[j] = cos_t * g[j] - sin_t * g[i]
    return tuple(out), g_t


def ambient_relative_position(lead: Tensor, t_rows: Tensor, t_cols: Tensor, kind: str) -> Tensor:
    """The relative position encoding ``kind`` of ambient points on their time and four reserved coordinates
    ``lead (B, N, H, 5)``: rows moved by ``t_rows (N, H)`` on the reserved axes ``(0, 1)``, then columns by
    ``t_cols`` on ``(2, 3)`` (:func:`_move`), each coordinate its own plane: bit for bit
    :meth:`manifold_ops.AmbientOps.relative_position` on these columns."""
    c = lead.unbind(-1)
    for t, axes in zip((t_rows, t_cols), POSITION_AXES):
        c = _move(kind, c, t, axes)
    return torch.stack(c, dim=-1)


def ambient_relative_position_backward(
    grad: Tensor, lead: Tensor, t_rows: Tensor, t_cols: Tensor, kind: str
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/dlead, dL/dt_rows, dL/dt_cols)`` of :func:`ambient_relative_position` for the gradient ``grad (B, N,
    H, 5)`` of its output: the rows' move recomputed, both moves differentiated by hand (:func:`_move_backward`),
    the rates' per-token gradients summed over the batch (:func:`cpu_kernels.sum_dims`)."""
    x = lead.unbind(-1)
    moved = _move(kind, x, t_rows, POSITION_AXES[0])
    g, g_cols = _move_backward(kind, grad.unbind(-1), moved, t_cols, POSITION_AXES[1])
    g, g_rows = _move_backward(kind, g, x, t_rows, POSITION_AXES[0])
    return torch.stack(g, dim=-1), sum_dims(g_rows, t_rows.dim()), sum_dims(g_cols, t_cols.dim())
