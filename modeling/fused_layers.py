"""Fused polar layers: the Polar-FC (Eq. 8), the relative position encodings on the reserved axes (Eq. 10, App. C;
HoPE boost; HOPE rotation), the boost residual (Eq. 12) and the heads' direct concatenation (Sec. 4.2), each an
autograd Function with a hand-derived backward.

Each saves only its inputs, its output and per-token scalars, and recomputes the rest.  The formulas that the
reference layers share with these (the Polar-FC epilogue :func:`polar_fc_epilogue`) have their one home here: the
reference layers call the same functions and let autograd differentiate them.  The boost residual has its vector
form here (:func:`boost_residual_step`, the reference layers') and its per-token form (:func:`boost_tokens`,
:func:`boost_gradients`, both arithmetics' fused layers).  Cores are compiled kernels in float32 on the CPU
(:mod:`cpu_kernels`).

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and sibling modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .cpu_kernels import first_order, recompute_vjp, run_maybe_compiled, sum_dims
from .geometry import direct_concat
from .operators import fused_apply, registered_operators
from .stable_math import (
    asinh_exp,
    asinh_nonneg,
    inverse_or_zero,
    perp_parts,
    safe_normalize,
    safe_sqrt,
    scaled_sinh_cosh,
    sinh_cosh,
    sinh_cosh_smooth,
    sinhc_sq,
)

GEMM_ALIGN = 8  # the Polar-FC's inner width n+1 is zero-padded to a multiple of this (MKL: odd widths run slowly)

__all__ = [
    "BOOST_TERMS",
    "BoostCoefficients",
    "BoostDots",
    "BoostGradients",
    "BoostKernels",
    "BoostTokens",
    "CotangentDots",
    "FusedBoostResidual",
    "FusedDirectConcat",
    "FusedPolarFC",
    "FusedReservedAxesEncoding",
    "GEMM_ALIGN",
    "GemmWidthProduct",
    "POLAR_BOOST",
    "RadiusRuleGradients",
    "boost_direction",
    "boost_dots",
    "boost_gradients",
    "boost_residual_step",
    "boost_tokens",
    "fused_boost_residual",
    "fused_direct_concat",
    "fused_polar_fc",
    "fused_reserved_axes_encoding",
    "gemm_width",
    "gemm_width_product",
    "heads_to_coordinates",
    "is_gelu",
    "packed_direct_concat",
    "perp_difference",
    "polar_fc_epilogue",
    "polar_fc_log_radius",
    "policy_matmul",
    "radius_offset",
    "radius_rule_gradients",
    "token_outer_sum",
]


# --------------------------------------------------------------------------------------------
# Polar-FC (Eq. 8)
# --------------------------------------------------------------------------------------------
def gemm_width(n: int) -> int:
    """``n`` rounded up to a multiple of ``GEMM_ALIGN``: the width of the Polar-FC's unit coordinates and weight.

    Matrix products whose inner or output width is odd (``n + 1 = 193`` for ``n = 192``) take a slow path in MKL
    on the CPU (``benchmarks/step_time.py``); zero columns change no sum.
    """
    return -(-n // GEMM_ALIGN) * GEMM_ALIGN


def write_product(dest: Tensor, a: Tensor, b: Tensor) -> None:
    """``dest[...] = a * b`` in one pass into the view ``dest`` (no product tensor copied in); traced, an
    assignment (dynamo takes no ``out=`` into a view; compiled code fuses the product anyway)."""
    if torch.compiler.is_compiling():
        dest.copy_(a * b)
    else:
        torch.mul(a, b, out=dest)


def _unit_coords(r: Tensor, u: Tensor, sqrt_k: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x / sqrt(k) = (cosh a, sinh a u)`` (Eq. 2) as one ``(T, gemm_width(n+1))`` tensor (zeros after ``n+1``),
    with ``a``, ``sinh a``, ``cosh a``."""
    a = r / sqrt_k
    sinh_a, cosh_a = sinh_cosh(a)
    width = u.shape[-1] + 1
    x = u.new_empty(*u.shape[:-1], gemm_width(width))
    x[..., 0] = cosh_a
    write_product(x[..., 1:width], u, sinh_a.unsqueeze(-1))
    x[..., width:] = 0.0
    return x, a, sinh_a, cosh_a


def _padded_weight(weight: Tensor) -> Tensor:
    """``weight (m, n+1)`` with zero columns up to :func:`gemm_width`."""
    return torch.nn.functional.pad(weight, (0, gemm_width(weight.shape[1]) - weight.shape[1]))


class RadiusRuleGradients(NamedTuple):
    """``dL/d`` the radius rule's parameters (Eq. 8), sums over the tokens: ``beta`` and ``lambda`` ``(H,)``,
    ``varphi`` ``(H, n)``, ``varphi_0`` ``(H,)``."""

    norm_power: Tensor
    radius_weight: Tensor
    klein_weight: Tensor
    radius_bias: Tensor


def heads_to_coordinates(g_l: Tensor, weight: Tensor) -> Tensor:
    """``g_l W`` ``(..., n)`` for per-head values ``g_l`` ``(..., H)`` and weights ``W`` ``(H, n)`` (the radius rule's
    ``varphi^T g_l``); a broadcast for one head (a compiled matrix product of inner size 1 runs far below memory
    speed)."""
    return g_l * weight[0] if weight.shape[0] == 1 else g_l @ weight


def token_outer_sum(weights: Tensor, values: Tensor) -> Tensor:
    """``sum_t weights_t values_t^T`` ``(H, n)`` over every leading dimension of ``weights`` ``(..., H)`` and
    ``values`` ``(..., n)``: a matrix product over the flattened tokens, or for one head a broadcast summed one
    dimension at a time (:func:`cpu_kernels.sum_dims`; a matrix product of inner size 1 runs far below memory
    speed)."""
    if weights.shape[-1] == 1:
        return sum_dims(weights * values, keep=1).unsqueeze(0)
    return weights.flatten(0, -2).t() @ values.flatten(0, -2)


def radius_rule_gradients(g_l: Tensor, norm: Tensor, a: Tensor, g_varphi: Tensor) -> RadiusRuleGradients:
    """The radius rule's parameter gradients (Eq. 8; ``l = beta ln||h|| + lambda a + varphi . chi + varphi_0``) from
    ``g_l = dL/dl`` and ``||h||`` ``(..., H)``, the input radii ``a`` ``(...)`` over ``sqrt(k)`` and ``g_varphi =
    sum g_l chi^T`` (:func:`token_outer_sum`): sums over the leading dimensions one at a time
    (:func:`cpu_kernels.sum_dims`: one compiled variant serves every batch size)."""
    return RadiusRuleGradients(
        sum_dims(g_l * torch.log(norm.clamp_min(1e-30)), keep=1),
        sum_dims(g_l * a.unsqueeze(-1), keep=1),
        g_varphi,
        sum_dims(g_l, keep=1),
    )


def _polar_fc_input_gradients(
    p: Tensor,
    g_x: Tensor,
    sinh_a: Tensor,
    cosh_a: Tensor,
    g_l: Tensor,
    norm: Tensor,
    klein_weight: Tensor | None,
    radius_weight: Tensor | None,
    sqrt_k: float,
) -> tuple[Tensor, RadiusRuleGradients | None]:
    """``(dL/dp, dL/d rule)``: ``dL/dp = [g_a / sqrt(k), g_u]`` ``(..., n+1)`` from the tokens ``p = [r, u]``,
    ``g_x = dL/d(x / sqrt(k))`` (its first ``n+1`` of :func:`gemm_width` columns), and, with the radius rule,
    ``g_l = dL/dl`` ``(..., H)``, ``||h||`` ``(..., H)`` (:func:`_polar_fc_epilogue_backward`), ``varphi`` ``(H, n)``
    and ``lambda`` ``(H,)`` (``None`` without the rule):

        g_a = g_x0 sinh a + cosh a (g_xs . u) + lambda . g_l + sech^2 a (u . varphi^T g_l),
        g_u = sinh a g_xs + tanh a varphi^T g_l,
        dL/dbeta = sum_t g_l ln||h||,  dL/dlambda = sum_t g_l a,  dL/dvarphi = sum_t g_l (tanh a u)^T,
        dL/dvarphi_0 = sum_t g_l

    (Eq. 8 through ``x / sqrt(k) = (cosh a, sinh a u)``; :func:`radius_rule_gradients`), one compiled kernel over
    the tokens."""
    u = p[..., 1:]
    g_xs = g_x[..., 1 : p.shape[-1]]
    g_a = g_x[..., 0] * sinh_a + cosh_a * (g_xs * u).sum(-1)
    g_u = g_xs * sinh_a.unsqueeze(-1)
    if klein_weight is None or radius_weight is None:
        return torch.cat([(g_a / sqrt_k).unsqueeze(-1), g_u], dim=-1), None
    tanh_a = sinh_a / cosh_a
    g_klein = heads_to_coordinates(g_l, klein_weight)  # varphi^T g_l (..., n)
    g_a = g_a + g_l @ radius_weight + (u * g_klein).sum(-1) / cosh_a.square()
    g_u = g_u + tanh_a.unsqueeze(-1) * g_klein
    g_varphi = token_outer_sum(g_l * tanh_a.unsqueeze(-1), u)  # sum g_l chi^T, chi = tanh a u never formed
    grads = radius_rule_gradients(g_l, norm, p[..., 0] / sqrt_k, g_varphi)
    return torch.cat([(g_a / sqrt_k).unsqueeze(-1), g_u], dim=-1), grads


def policy_matmul(a: Tensor, b: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``a @ b`` under the precision policy (:func:`manifold_ops.product_dtype`): in ``dtype`` (bf16 / fp16 GEMMs
    accumulate in float32) and returned in ``a``'s precision, or in ``a``'s precision when ``dtype`` is ``None``."""
    if dtype is None:
        return a @ b.to(a.dtype)
    return (a.to(dtype) @ b.to(dtype)).to(a.dtype)


class GemmWidthProduct(torch.autograd.Function):
    """``x W^T`` for ``x (..., n)`` and ``W (m, n)`` whose input gradient ``g W`` is computed through ``W``
    zero-padded to :func:`gemm_width` columns and returned as the view of its first ``n``: MKL writes an output of
    odd width on a slow path (such as ``(8192, 576) x (576, 193)``), while the forward's and the
    weight gradient's outputs, ``(..., m)`` and ``(m, n)``, keep their plain products (no copy of ``x`` padded).
    Saved: ``x`` and ``W``, as autograd's product; backward is differentiable (double backward as autograd's)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, dtype: torch.dtype | None) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        return policy_matmul(x, weight.t(), dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        x, weight = ctx.saved_tensors
        g_x = g_weight = None
        if ctx.needs_input_grad[0]:
            g_x = policy_matmul(grad, _padded_weight(weight), ctx.dtype)[..., : weight.shape[1]]
        if ctx.needs_input_grad[1]:
            g_weight = policy_matmul(grad.flatten(0, -2).t(), x.flatten(0, -2), ctx.dtype).to(weight.dtype)
        return g_x, g_weight, None


def gemm_width_product(x: Tensor, weight: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``x W^T`` under the precision policy (:func:`policy_matmul`), its input gradient at :func:`gemm_width`
    (:class:`GemmWidthProduct`)."""
    return GemmWidthProduct.apply(x, weight, dtype)


def is_gelu(activation: Callable | None) -> bool:
    """The exact GELU, or transformers' ``GELUActivation`` of it (its backward is ``aten.gelu_backward``)."""
    return getattr(activation, "act", activation) is torch.nn.functional.gelu


def polar_fc_epilogue(
    pre: Tensor,
    offset: Tensor | None,
    norm_power: Tensor | None,
    sqrt_k: float,
    gelu: bool,
) -> tuple[Tensor, Tensor]:
    """``([r', u'] (..., H, d+1), ||h|| (..., H))`` of Eq. 8 from the pre-activation ``pre = W x / sqrt(k)``.

    ``h = gelu(pre)`` (or ``pre``), ``u' = h / ||h||`` (``e_0`` where ``h = 0``), ``r' = sqrt(k) arsinh(e^l)`` with
    ``l = beta ln||h|| + offset`` and ``offset = lambda a + varphi^T chi + varphi_0``, or ``l = ln||h||`` without the
    radius rule (``norm_power`` ``None``).
    """
    h, norm, log_radius = polar_fc_log_radius(pre, offset, norm_power, gelu)
    radius = asinh_exp(log_radius) * sqrt_k
    return torch.cat([radius.unsqueeze(-1), safe_normalize(h, norm)], dim=-1), norm


def polar_fc_log_radius(
    pre: Tensor, offset: Tensor | None, norm_power: Tensor | None, gelu: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(h, ||h||, l)`` of Eq. 8 (all ``(..., H, ...)``): ``h = gelu(pre)`` (or ``pre``) and the log-radius
    ``l = ln sinh(r' / sqrt(k)) = beta ln||h|| + offset`` (``ln ||h||`` without the radius rule)."""
    h = torch.nn.functional.gelu(pre) if gelu else pre
    norm = torch.linalg.vector_norm(h, dim=-1)  # (..., H)
    log_radius = torch.log(norm.clamp_min(1e-30))
    if norm_power is not None and offset is not None:
        log_radius = torch.addcmul(offset, norm_power, log_radius)
    return h, norm, log_radius


def _polar_fc_epilogue_backward(
    grad_out: Tensor, out: Tensor, norm: Tensor, norm_power: Tensor | None, pre: Tensor | None, sqrt_k: float
) -> tuple[Tensor, Tensor]:
    """``(dL/dpre, g_l)`` of :func:`polar_fc_epilogue` (``dL/dh`` where ``pre`` is ``None``), with
    ``g_l = sqrt(k) g_r' tanh(a')`` and ``g_h = (g_u' + (beta g_l - g_u'.u') u') / ||h||``."""
    u_out, g_u_out = out[..., 1:], grad_out[..., 1:]
    g_l = grad_out[..., 0] * sqrt_k * torch.tanh(out[..., 0] / sqrt_k)  # (T, H)
    coef = (g_l * norm_power if norm_power is not None else g_l) - (g_u_out * u_out).sum(-1)
    inv_norm = inverse_or_zero(norm)
    g_h = torch.addcmul(g_u_out, coef.unsqueeze(-1), u_out) * inv_norm.unsqueeze(-1)
    return (g_h if pre is None else torch.ops.aten.gelu_backward(g_h, pre)), g_l


def radius_offset(a: Tensor, klein_term: Tensor, radius_weight: Tensor, radius_bias: Tensor) -> Tensor:
    """``lambda a + varphi^T chi + varphi_0`` ``(..., H)``: the input-radius part of Eq. 8's log-radius, from ``a``
    ``(...)`` and the Klein term ``varphi^T chi`` ``(..., H)`` (``chi = tanh(a) u``)."""
    return klein_term + radius_weight * a.unsqueeze(-1) + radius_bias


@registered_operators()
class FusedPolarFC(torch.autograd.Function):
    r"""``H`` Polar-FCs (Eq. 8) on tokens ``p = [r, u]`` ``(..., n+1)`` -> ``[r', u']`` ``(..., H, d+1)``.

    ``h = phi(W x / sqrt(k))``, ``u' = h / ||h||``, ``l = beta ln||h|| + lambda a + varphi . (tanh(a) u) + varphi_0``,
    ``r' = sqrt(k) arsinh(e^l)``; without the radius rule (``beta`` is ``None``) ``l = ln ||h||``.  Saved: the input,
    the weight as the products read it (zero columns up to :func:`gemm_width`: padded once per step), the output,
    ``||h||`` per head and the pre-activation (only with an activation).  Backward, with
    ``g_l = sqrt(k) g_r' tanh(a')``:

        g_h = (g_u' + (beta g_l - g_u'.u') u') / ||h||,   g_W = g_pre^T x,   g_x = g_pre W
        g_a = g_x0 sinh a + cosh a (g_xs . u) + lambda . g_l + sech^2 a (u . varphi^T g_l),
        g_u = sinh a g_xs + tanh a varphi^T g_l.

    Backward is two compiled kernels around the products: :func:`_polar_fc_epilogue_backward` and
    :func:`_polar_fc_input_gradients`, which also sums the radius rule's parameter gradients, over the tokens'
    ``leading`` dimensions (batch, sequence) one at a time.
    """

    @staticmethod
    def forward(
        ctx: Any,
        p: Tensor,
        weight: Tensor,
        norm_power: Tensor | None,  # noqa: D102
        radius_weight: Tensor | None,
        klein_weight: Tensor | None,
        radius_bias: Tensor | None,
        sqrt_k: float,
        heads: int,
        activation: Callable | None,
        matmul_dtype: torch.dtype | None,
    ) -> Tensor:
        tokens = p
        p = p.reshape(-1, p.shape[-1])
        x, a, _, _ = _unit_coords(p[:, 0], p[:, 1:], sqrt_k)
        padded = _padded_weight(weight)  # kept for backward: one padding per step
        pre = policy_matmul(x, padded.t(), matmul_dtype).view(p.shape[0], heads, -1)  # (T, H, d)
        gelu = is_gelu(activation)
        offset = None
        if (
            norm_power is not None
            and radius_weight is not None
            and klein_weight is not None
            and radius_bias is not None
        ):
            offset = radius_offset(
                a, torch.tanh(a).unsqueeze(-1) * (p[:, 1:] @ klein_weight.t()), radius_weight, radius_bias
            )
        if activation is None or gelu:
            out, norm = run_maybe_compiled(polar_fc_epilogue, pre, pre, offset, norm_power, sqrt_k, gelu)
        else:  # any other activation: applied eagerly, the epilogue without one
            out, norm = polar_fc_epilogue(activation(pre), offset, norm_power, sqrt_k, False)
        out = out.view(*tokens.shape[:-1], heads, -1)
        ctx.save_for_backward(
            tokens, padded, norm_power, radius_weight, klein_weight, out, norm, pre if activation is not None else None
        )
        ctx.sqrt_k, ctx.activation, ctx.matmul_dtype = sqrt_k, activation, matmul_dtype
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad_out: Tensor) -> tuple:  # noqa: D102
        tokens, padded, norm_power, radius_weight, klein_weight, out, norm, pre = ctx.saved_tensors
        p, leading = tokens.reshape(-1, tokens.shape[-1]), tuple(tokens.shape[:-1]) or (1,)
        out, grad_out = out.reshape(p.shape[0], *out.shape[-2:]), grad_out.reshape(p.shape[0], *out.shape[-2:])
        matmul_dtype = ctx.matmul_dtype
        sqrt_k = ctx.sqrt_k
        x, _, sinh_a, cosh_a = _unit_coords(p[:, 0], p[:, 1:], sqrt_k)
        if pre is None or is_gelu(ctx.activation):
            g_pre, g_l = run_maybe_compiled(
                _polar_fc_epilogue_backward, out, grad_out, out, norm, norm_power, pre, sqrt_k
            )
        else:
            g_h, g_l = _polar_fc_epilogue_backward(grad_out, out, norm, norm_power, None, sqrt_k)
            with torch.enable_grad():
                leaf = pre.detach().requires_grad_(True)
                (g_pre,) = torch.autograd.grad(ctx.activation(leaf), leaf, g_h)
        g_pre = g_pre.flatten(1)  # (T, H d)
        g_weight = policy_matmul(g_pre.t(), x, matmul_dtype)[:, : p.shape[1]].to(padded.dtype)
        g_x = policy_matmul(g_pre, padded, matmul_dtype)  # (T, gemm_width(n+1))
        per_token = [t.unflatten(0, leading) for t in (p, g_x, sinh_a, cosh_a, g_l, norm)]  # (batch, tokens, ...)
        g_p, grads_rule = run_maybe_compiled(
            _polar_fc_input_gradients, p, *per_token, klein_weight, radius_weight, sqrt_k
        )
        return (g_p.view_as(tokens), g_weight, *(grads_rule or (None, None, None, None)), None, None, None, None)


def fused_polar_fc(
    p: Tensor,
    weight: Tensor,
    rule: tuple[Tensor, Tensor, Tensor, Tensor] | None,
    sqrt_k: float,
    heads: int,
    activation: Callable | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> Tensor:
    """``heads`` Polar-FCs (Eq. 8) on ``p (..., n+1)`` -> ``(..., heads, d+1)``; ``rule`` is ``(beta, lambda, varphi,
    varphi_0)`` of shapes ``(H,), (H,), (H, n), (H,)`` or ``None`` (Lorentz FC); the products ``W x`` in
    ``matmul_dtype`` (the precision policy) or in ``p``'s precision."""
    parameters: tuple[Tensor | None, ...] = rule if rule is not None else (None, None, None, None)
    activation = torch.nn.functional.gelu if is_gelu(activation) else activation  # a function, not a module
    return fused_apply(FusedPolarFC, p, weight, *parameters, float(sqrt_k), int(heads), activation, matmul_dtype)


# --------------------------------------------------------------------------------------------
# relative position encodings on the reserved axes (Eq. 10, 11, App. C; HoPE boost; HOPE rotation)
# --------------------------------------------------------------------------------------------
def _horoshift_scalars(x: list[Tensor], rest: Tensor, nu: Tensor, t: Tensor, ideal: int, shift: int) -> list[Tensor]:
    """One horospherical shift (Eq. 10, :func:`geometry.horoshift`) on the four reserved coordinates.

    ``x`` holds the reserved space coordinates ``x_0..x_3`` over ``sqrt(k)``, ``rest`` the sum of squares of all
    the others and ``nu`` the Busemann coordinate over ``sqrt(k)`` (:func:`_busemann`).  ``x_shift += t nu`` and
    ``x_ideal = ((1 + |rest of x|^2) / nu - nu) / 2``: sums of non-negative terms.
    """
    others = [x[c].square() for c in range(4) if c not in (ideal, shift)]
    moved = x[shift] + t * nu
    out = list(x)
    out[shift] = moved
    out[ideal] = 0.5 * ((1.0 + rest + others[0] + others[1] + moved.square()) / nu - nu)
    return out


def _busemann(
    exp_minus_a: Tensor, scale: Tensor | float, y: list[Tensor], rest: Tensor, norm: Tensor, ideal: int
) -> Tensor:
    """``nu / sqrt(k) = e^{-a} + scale (|y| - y_ideal)`` (Eq. 10, :func:`geometry.busemann_nu`).

    ``|y| - y_ideal = (|y|^2 - y_ideal^2) / (|y| + y_ideal)`` for ``y_ideal >= 0`` (the numerator summed from the
    other coordinates, ``rest`` their tail), else ``|y| - y_ideal``: no cancellation.  ``y`` is the unit direction
    (``scale = sinh a``, ``norm = 1``) or the space coordinates (``scale = 1``, ``norm = |y|``).
    """
    off_axis = rest + sum(y[c].square() for c in range(4) if c != ideal)
    denom = norm + y[ideal].abs()  # 0 only at the origin, where the numerator is 0 too
    gap = torch.where(y[ideal] >= 0, off_axis / torch.where(denom > 0, denom, torch.ones_like(denom)), norm - y[ideal])
    return exp_minus_a + scale * gap


def _boost_scalars(x: list[Tensor], cosh_a: Tensor, t: Tensor, axis: int) -> list[Tensor]:
    """Lorentz boost of rapidity ``t`` along ``axis`` (:func:`geometry.boost`):
    ``x_i <- sinh t cosh a + cosh t x_i``."""
    sinh_t, cosh_t = sinh_cosh_smooth(t)  # differentiated by autograd; (N, H)-sized
    out = list(x)
    out[axis] = sinh_t * cosh_a + cosh_t * x[axis]
    return out


def _reserved_axes_scalars(
    kind: str, r: Tensor, u4: Tensor, rest_sq: Tensor, t_rows: Tensor, t_cols: Tensor, sqrt_k: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token scalar part of the 2-D encoding: ``(r', u'_0..3 (4, ...), scale)`` with ``u'_m = scale u_m`` for
    ``m >= 4``.  ``u4 (4, ...)`` holds the reserved direction coordinates (coordinate first: each one contiguous),
    ``rest_sq`` the sum of squares of the others."""
    if kind == "rotation":  # HOPE: the planes (0, 1) and (2, 3) rotate, the radius is exact
        parts = []
        for t, (first, second) in ((t_rows, (0, 1)), (t_cols, (2, 3))):
            cos, sin = torch.cos(t), torch.sin(t)
            parts += [cos * u4[first] - sin * u4[second], sin * u4[first] + cos * u4[second]]
        return r, torch.stack(parts), torch.ones_like(r)
    a = r / sqrt_k
    sinh_a, cosh_a = sinh_cosh_smooth(a)  # differentiated by autograd; per token
    x = [sinh_a * u4[c] for c in range(4)]
    rest = sinh_a.square() * rest_sq
    if kind == "horoshift":
        nu = _busemann(torch.exp(-a), sinh_a, list(u4), rest_sq, torch.ones_like(a), 0)
        x = _horoshift_scalars(x, rest, nu, t_rows, 0, 1)
        norm = safe_sqrt(rest + sum(c.square() for c in x))
        exp_minus = 1.0 / (torch.sqrt(1.0 + norm.square()) + norm)  # e^{-a} of the shifted point
        x = _horoshift_scalars(x, rest, _busemann(exp_minus, 1.0, x, rest, norm, 2), t_cols, 2, 3)
    else:  # boost (HoPE) along axes 0 and 2
        x = _boost_scalars(x, cosh_a, t_rows, 0)
        norm = safe_sqrt(rest + sum(c.square() for c in x))
        x = _boost_scalars(x, torch.sqrt(1.0 + norm.square()), t_cols, 2)
    norm = safe_sqrt(rest + sum(c.square() for c in x))
    nonzero = norm > 0
    inv = 1.0 / torch.where(nonzero, norm, torch.ones_like(norm))
    e_0 = torch.zeros_like(u4)
    e_0[0] = 1.0  # the origin: direction e_0, zero gradient (as stable_math.safe_normalize)
    direction = torch.where(nonzero, torch.stack(x) * inv, e_0)
    return sqrt_k * asinh_nonneg(norm), direction, torch.where(nonzero, sinh_a * inv, torch.zeros_like(norm))


def _reserved_axes_scalar_gradients(
    kind: str,
    r: Tensor,
    u4: Tensor,
    rest_sq: Tensor,
    t_rows: Tensor,
    t_cols: Tensor,
    sqrt_k: float,
    grads: tuple[Tensor, Tensor, Tensor],
) -> tuple:
    """``(scale, gradients)``: the ``scale`` output of :func:`_reserved_axes_scalars` and its gradients with respect
    to ``(r, u4, rest_sq, t_rows, t_cols)`` for the incoming ``grads`` of its three outputs; the forward recomputed
    and differentiated (:func:`cpu_kernels.recompute_vjp`; one compiled kernel in float32 on the CPU)."""

    def scalars(*args: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _reserved_axes_scalars(kind, args[0], args[1], args[2], args[3], args[4], sqrt_k)

    outputs, gradients = recompute_vjp(scalars, (r, u4, rest_sq, t_rows, t_cols), grads)
    return outputs[2], gradients


def _reserved_axes_parts(t: Tensor, rest: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The per-token parts of :func:`_reserved_axes_scalars` from packed ``t (..., d+1)`` (points or their
    gradient): the radius part, the four reserved direction parts ``(4, ...)`` (coordinate first), each contiguous,
    and ``rest``, the part of the other coordinates (their sum of squares, or its gradient's dot product)."""
    return t[..., 0].contiguous(), t[..., 1:5].movedim(-1, 0).contiguous(), rest


def _reserved_axes_assemble(radius: Tensor, u4: Tensor, rest: Tensor, scale: Tensor) -> Tensor:
    """The packed ``(..., d+1)`` tensor ``[radius, u4 (4, ...) coordinate last, scale rest]`` (points or their
    gradient), written in place: the inverse of :func:`_reserved_axes_parts`."""
    out = rest.new_empty(*rest.shape[:-1], rest.shape[-1] + 5)
    out[..., 0] = radius
    out[..., 1:5] = u4.movedim(0, -1)
    write_product(out[..., 5:], rest, scale.unsqueeze(-1))
    return out


@registered_operators()
class FusedReservedAxesEncoding(torch.autograd.Function):
    r"""The 2-D relative position encoding of every head (``horoshift`` Eq. 10 / ``boost`` / ``rotation``) as one
    function.

    The two moves (rows on the reserved axes ``(0, 1)``, columns on ``(2, 3)``) change only the four reserved
    coordinates and the radius; every other space coordinate ``x_m = sqrt(k) sinh a u_m`` is unchanged, so its
    direction coordinate is only rescaled, ``u'_m = (sinh a / sinh a') u_m``.  The per-token scalars (radius, four
    coordinates, the sum of squares of the others) carry the whole computation (:func:`_reserved_axes_scalars`, on
    contiguous ``(B, N, H)`` tensors); the ``d``-wide vectors are touched once forward and once backward.  Saved:
    the input and the per-token sum of squares of its other direction coordinates; backward recomputes the scalar
    part and differentiates it (:func:`cpu_kernels.recompute_vjp`), the vector part by hand.
    """

    @staticmethod
    def forward(
        ctx: Any,
        p: Tensor,
        t_rows: Tensor,
        t_cols: Tensor,
        kind: str,
        sqrt_k: float,  # noqa: D102
    ) -> Tensor:
        u_rest = p[..., 5:]
        rest_sq = torch.linalg.vecdot(u_rest, u_rest)
        scalars = _reserved_axes_parts(p, rest_sq)
        r_out, u4, scale = run_maybe_compiled(_reserved_axes_scalars, p, kind, *scalars, t_rows, t_cols, sqrt_k)
        ctx.save_for_backward(p, t_rows, t_cols, rest_sq)
        ctx.kind, ctx.sqrt_k = kind, sqrt_k
        return _reserved_axes_assemble(r_out, u4, u_rest, scale)

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        p, t_rows, t_cols, rest_sq = ctx.saved_tensors
        u_rest, g_rest = p[..., 5:], grad[..., 5:]
        scalars = _reserved_axes_parts(p, rest_sq)
        outputs = _reserved_axes_parts(grad, torch.linalg.vecdot(g_rest, u_rest))
        scale, (g_r, g_u4, g_rest_sq, g_t_rows, g_t_cols) = run_maybe_compiled(
            _reserved_axes_scalar_gradients, p, ctx.kind, *scalars, t_rows, t_cols, ctx.sqrt_k, outputs
        )
        g_p = _reserved_axes_assemble(g_r, g_u4, g_rest, scale)
        g_p[..., 5:].addcmul_(u_rest, 2.0 * g_rest_sq.unsqueeze(-1))
        return g_p, g_t_rows, g_t_cols, None, None


def fused_reserved_axes_encoding(p: Tensor, t_rows: Tensor, t_cols: Tensor, kind: str, sqrt_k: float) -> Tensor:
    """Relative position encoding of ``p (B, N, H, d+1)`` with per-token, per-head moves ``t (N, H)``."""
    return fused_apply(FusedReservedAxesEncoding, p, t_rows, t_cols, kind, float(sqrt_k))


# --------------------------------------------------------------------------------------------
# boost residual (Eq. 12)
# --------------------------------------------------------------------------------------------
def boost_residual_step(a: Tensor, u: Tensor, b: Tensor, v: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 12 for ``x = (a, u)`` and ``f(x) = (b, v)`` (radii over ``sqrt(k)``; ``b`` already scaled by the
    stochastic depth), over the tokens of each sample ``(..., N)``: ``(|a'|, u')`` with

        a' = a + alpha (b_par - mean_N b_par),   b_par = b (u . v),
        u' = sign(a') D / |D|,   D = tanh(a) u + sinhc(alpha b |v_perp|) alpha b v_perp

    and the stable ``v_perp`` of :func:`stable_math.perp_parts`.  The reference layer, differentiated by autograd;
    the fused layers compute the same per token (:func:`boost_tokens`)."""
    v_perp = perp_parts(v, u)[0]
    b_par = b * (u * v).sum(-1)
    a_new = a + alpha * (b_par - b_par.mean(-1, keepdim=True))
    step = alpha * b
    sinhc = sinhc_sq(step.square() * v_perp.square().sum(-1))[0]
    big_d = torch.addcmul(torch.tanh(a).unsqueeze(-1) * u, (sinhc * step).unsqueeze(-1), v_perp)
    flip = torch.where(a_new < 0, -1.0, 1.0).to(u.dtype)
    return a_new.abs(), flip.unsqueeze(-1) * safe_normalize(big_d)


class BoostDots(NamedTuple):
    """The per-token sums over the directions ``u`` (of ``x``) and ``v`` (of ``f(x)``) that Eq. 12 reads, ``(..)``
    each: ``u . v``, ``s = sign(u . v)`` (1 at 0), and with ``d = v - s u`` (formed from the difference itself: no
    cancellation for nearly aligned or opposite directions) ``|u|^2``, ``|d|^2`` and ``u . d``."""

    cos: Tensor
    sign: Tensor
    uu: Tensor
    dd: Tensor
    ud: Tensor


class CotangentDots(NamedTuple):
    """``g . u`` and ``g . d`` per token for the cotangent ``g`` of the output's directions."""

    u: Tensor
    d: Tensor


def perp_difference(u: Tensor, v: Tensor, sign: Tensor) -> Tensor:
    """``d = v - s u`` ``(.., n)`` (:func:`stable_math.perp_parts`)."""
    return v - sign.unsqueeze(-1) * u


def boost_dots(u: Tensor, v: Tensor, cos: Tensor) -> tuple[BoostDots, Tensor]:
    """:class:`BoostDots` of the directions ``u, v (.., n)`` given ``u . v`` (a first pass over the coordinates),
    in a second pass, and ``d``."""
    sign = torch.where(cos >= 0, 1.0, -1.0)
    d = perp_difference(u, v, sign)
    return BoostDots(cos, sign, (u * u).sum(-1), (d * d).sum(-1), (u * d).sum(-1)), d


class BoostTokens(NamedTuple):
    """Eq. 12 per token (:func:`boost_residual_step`'s quantities; radii over ``sqrt(k)``): ``b`` (scaled by the
    stochastic depth), ``h = |d|^2 / 2``, ``b_par = b (u . v)``, ``a'``, ``step = alpha b``, ``P = |v_perp|^2 =
    |d|^2 + 2 s h (u . d) + h^2 |u|^2``, ``omega^2 = step^2 P``, ``sinhc(omega)``, ``cosh(omega)``, whether
    ``omega`` is in the series range, ``tanh a``, ``sigma = sinhc(omega) step``, ``t = tanh a + sigma s h`` (so
    ``D = t u + sigma d``), ``|D| = sqrt(t^2 |u|^2 + 2 t sigma (u . d) + sigma^2 |d|^2)`` and ``sign(a')`` as a
    factor."""

    b: Tensor
    h: Tensor
    b_par: Tensor
    a_new: Tensor
    step: Tensor
    vperp_sq: Tensor
    omega_sq: Tensor
    sinhc: Tensor
    cosh_w: Tensor
    small: Tensor
    tanh_a: Tensor
    sigma: Tensor
    t: Tensor
    norm: Tensor
    flip: Tensor


def boost_tokens(a: Tensor, b: Tensor, alpha: Tensor, dots: BoostDots) -> BoostTokens:
    """:class:`BoostTokens` from the radii and :class:`BoostDots`: every vector of Eq. 12 is ``u`` and ``d``
    combined per token (``v_perp = d + s h u``), so its norms are per-token formulas of the dot products."""
    s, uu, dd, ud = dots.sign, dots.uu, dots.dd, dots.ud
    h = 0.5 * dd
    b_par = b * dots.cos
    a_new = a + alpha * (b_par - b_par.mean(-1, keepdim=True))
    step = alpha * b
    vperp_sq = dd + s * dd * ud + h.square() * uu
    omega_sq = step.square() * vperp_sq
    sinhc, cosh_w, _, small = sinhc_sq(omega_sq)
    tanh_a = torch.tanh(a)
    sigma = sinhc * step
    t = tanh_a + sigma * s * h
    norm = torch.sqrt((t.square() * uu + 2.0 * t * sigma * ud + sigma.square() * dd).clamp_min(0.0))
    flip = torch.where(a_new < 0, -1.0, 1.0)
    return BoostTokens(
        b, h, b_par, a_new, step, vperp_sq, omega_sq, sinhc, cosh_w, small, tanh_a, sigma, t, norm, flip
    )


def boost_direction(tok: BoostTokens, u: Tensor, d: Tensor) -> Tensor:
    """``u' = sign(a') D / |D|`` ``(.., n)`` with ``D = t u + sigma d`` (``e_0`` where ``D = 0``)."""
    return tok.flip.unsqueeze(-1) * safe_normalize(tok.t.unsqueeze(-1) * u + tok.sigma.unsqueeze(-1) * d, tok.norm)


class BoostCoefficients(NamedTuple):
    """A vector ``c_g g + c_u u + c_d d`` of Eq. 12's backward by its per-token coefficients on the cotangent ``g``
    of the output's directions and on ``u``, ``d``."""

    g: Tensor
    u: Tensor
    d: Tensor

    def combine(self, g: Tensor, u: Tensor, d: Tensor) -> Tensor:
        """The vector ``(.., n)``."""
        return self.g.unsqueeze(-1) * g + self.u.unsqueeze(-1) * u + self.d.unsqueeze(-1) * d


def boost_scalar_cotangents(
    tok: BoostTokens, dots: BoostDots, g_dots: CotangentDots, gamma_over_sq: Tensor
) -> tuple[Tensor, Tensor]:
    """``g_t = g_D . u`` and ``g_sigma = g_D . d + s h g_t = g_D . v_perp`` for ``g_D = gamma (g - (g . D) D / |D|^2)``
    (:func:`boost_gradients`; ``gamma_over_sq = gamma / |D|^2``), free of cancellation.  ``g_D`` is orthogonal to
    ``D = t u + sigma d``, so both are multiples of one sum of 2x2 determinants of the dot products:

        W = t ((g . u)(u . d) - (g . d)|u|^2) + sigma ((g . u)|d|^2 - (g . d)(u . d)),
        g_t = gamma sigma W / |D|^2,   g_sigma = -gamma tanh(a) W / |D|^2   (t - s h sigma = tanh a).

    Summed as ``g_D . v_perp``, ``g_sigma`` is a difference of terms about ``sigma |v_perp| / tanh a`` times larger
    than itself (``D ~ sigma v_perp`` once ``sigma = sinhc(omega) alpha b`` is large), whose rounding ``cosh(omega)``
    then carries into the gradients of ``b`` and ``alpha``."""
    t, sigma = tok.t, tok.sigma
    w = t * (g_dots.u * dots.ud - g_dots.d * dots.uu) + sigma * (g_dots.u * dots.dd - g_dots.d * dots.ud)
    return gamma_over_sq * sigma * w, -gamma_over_sq * tok.tanh_a * w


class BoostGradients(NamedTuple):
    """The gradients of Eq. 12 with respect to ``a``, ``b`` (before the stochastic depth's scaling) and ``alpha``,
    and those of ``u`` and ``v`` as :class:`BoostCoefficients`."""

    a: Tensor
    b: Tensor
    alpha: Tensor
    u: BoostCoefficients
    v: BoostCoefficients


def boost_gradients(
    tok: BoostTokens,
    dots: BoostDots,
    g_dots: CotangentDots,
    alpha: Tensor,
    g_radius: Tensor,
    scale: Tensor | float,
) -> BoostGradients:
    """The backward of :func:`boost_tokens` and :func:`boost_direction` for the cotangents ``g_radius`` of ``|a'|``
    and ``scale g`` of ``u'``, every vector kept as its coefficients on ``(g, u, d)``, for any ``u, v`` (the
    dot products' gradients: ``d|d|^2 = 2 d (dv - s du)``, ``d(u . d) = (d - s u) du + u dv``, ``d(u . v) = v du +
    u dv`` with ``v = d + s u``):

        g_D = scale sign(a') (g - (g . D) D / |D|^2) / |D|,   D = t u + sigma d
        g_t = g_D . u,  g_sigma = g_D . d + s h g_t  (both by :func:`boost_scalar_cotangents`),  g_h = s sigma g_t
        g_omega^2 = step sinhc'(omega^2) g_sigma,
        g_P = step^2 g_omega^2,  g_|d|^2 = g_P (1 + s u . d + h |u|^2) + g_h / 2,  g_(u.d) = 2 s h g_P,
        g_|u|^2 = h^2 g_P
        g_u = (t - s sigma) g_D - 2 s g_|d|^2 d + g_(u.d) (d - s u) + 2 g_|u|^2 u + g_cos v
        g_v = sigma g_D + 2 g_|d|^2 d + g_(u.d) u + g_cos u
    """
    s, h, sigma, t, step = dots.sign, tok.h, tok.sigma, tok.t, tok.step
    inv = inverse_or_zero(tok.norm)
    gamma = scale * tok.flip * inv
    along = -gamma * (t * g_dots.u + sigma * g_dots.d) * inv.square()
    g_big_d = BoostCoefficients(gamma, along * t, along * sigma)
    g_t, g_sigma = boost_scalar_cotangents(tok, dots, g_dots, gamma * inv.square())
    g_h = s * sigma * g_t
    # sinhc(omega) as a function of omega^2: d sinhc / d omega^2 = (cosh w - sinhc) / (2 w^2)
    small = tok.small
    slope = torch.where(small, 1.0 / 6.0, (tok.cosh_w - tok.sinhc) / (2.0 * torch.where(small, 1.0, tok.omega_sq)))
    g_omega_sq = g_sigma * step * slope
    g_step = g_sigma * tok.sinhc + g_omega_sq * 2.0 * step * tok.vperp_sq
    g_p = g_omega_sq * step.square()
    g_dd = g_p * (1.0 + s * dots.ud + h * dots.uu) + 0.5 * g_h
    g_ud = 2.0 * s * h * g_p
    g_uu = h.square() * g_p
    # a' = a + alpha (b_par - mean b_par), b_par = b (u . v), step = alpha b
    g_a_new = g_radius * torch.sign(tok.a_new)  # d|a'|/da' = sign(a') (0 at 0, as torch.abs)
    g_b_par = alpha * (g_a_new - g_a_new.mean(-1, keepdim=True))
    g_alpha = sum_dims(g_a_new * (tok.b_par - tok.b_par.mean(-1, keepdim=True))) + sum_dims(g_step * tok.b)
    g_cos = g_b_par * tok.b
    explicit = t - s * sigma
    g_u = BoostCoefficients(
        explicit * g_big_d.g,
        explicit * g_big_d.u - s * g_ud + 2.0 * g_uu + s * g_cos,
        explicit * g_big_d.d - 2.0 * s * g_dd + g_ud + g_cos,
    )
    g_v = BoostCoefficients(sigma * g_big_d.g, sigma * g_big_d.u + g_ud + g_cos, sigma * g_big_d.d + 2.0 * g_dd)
    g_a = (1.0 - tok.tanh_a.square()) * g_t + g_a_new
    return BoostGradients(g_a, g_b_par * dots.cos + g_step * alpha, g_alpha, g_u, g_v)


BOOST_TERMS = 6  # the per-token coefficients the boost residuals' backward kernels return last (stored once)


def _boost_residual_parts(
    x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float
) -> tuple[BoostDots, BoostTokens, Tensor]:
    """:class:`BoostDots`, :class:`BoostTokens` and ``d`` of packed points ``x``, ``f``."""
    u, v = x[..., 1:], f[..., 1:]
    dots, d = boost_dots(u, v, (u * v).sum(-1))
    b = f[..., 0] / sqrt_k
    return dots, boost_tokens(x[..., 0] / sqrt_k, b if strength is None else b * strength, alpha, dots), d


def _boost_residual_forward(
    x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float
) -> tuple[Tensor, BoostTokens]:
    """The packed output ``[sqrt(k) |a'|, u']`` of Eq. 12 on packed points (the Function's forward kernel): two
    passes of sums over the coordinates and one that writes; then the per-token terms, stored once."""
    dots, tok, d = _boost_residual_parts(x, f, alpha, strength, sqrt_k)
    out = torch.cat([(sqrt_k * tok.a_new.abs()).unsqueeze(-1), boost_direction(tok, x[..., 1:], d)], dim=-1)
    return out, tok


def _boost_residual_gradients(
    grad: Tensor, x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float
) -> tuple[Tensor, ...]:
    """``(dL/dx, dL/df, dL/dalpha)`` of :func:`_boost_residual_forward`, its per-token terms recomputed and
    differentiated (:func:`boost_gradients`): two passes of sums and one that writes both gradients; then the
    coefficients of the two direction gradients (:data:`BOOST_TERMS`)."""
    dots, tok, d = _boost_residual_parts(x, f, alpha, strength, sqrt_k)
    gs, u = grad[..., 1:], x[..., 1:]
    g_dots = CotangentDots((gs * u).sum(-1), (gs * d).sum(-1))
    g = boost_gradients(tok, dots, g_dots, alpha, grad[..., 0] * sqrt_k, 1.0)
    g_b = g.b if strength is None else g.b * strength
    g_x = torch.cat([(g.a / sqrt_k).unsqueeze(-1), g.u.combine(gs, u, d)], dim=-1)
    g_f = torch.cat([(g_b / sqrt_k).unsqueeze(-1), g.v.combine(gs, u, d)], dim=-1)
    return g_x, g_f, g.alpha, *g.u, *g.v


class BoostKernels(NamedTuple):
    """The kernel functions of a :class:`FusedBoostResidual`: ``forward(x, f, alpha, strength, constant) -> (out,
    ...)`` and ``backward(grad, x, f, alpha, strength, constant) -> (g_x, g_f, g_alpha, *BOOST_TERMS
    coefficients)``, with ``constant`` ``sqrt(k)`` for packed polar points, ``k`` for ambient ones."""

    forward: Callable
    backward: Callable


@registered_operators()
class FusedBoostResidual(torch.autograd.Function):
    r"""The boost residual of Eq. 12 (:func:`boost_residual_step`) as one function, for either arithmetic's points
    (:class:`BoostKernels`).  Saved: the two inputs, ``alpha`` and the stochastic-depth strength; backward
    recomputes the per-token terms and differentiates them by hand (:func:`boost_gradients`)."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any,
        x: Tensor,
        f: Tensor,
        alpha: Tensor,
        strength: Tensor | None,
        constant: float,
        kernels: BoostKernels,
    ) -> Tensor:
        out = run_maybe_compiled(kernels.forward, x, x, f, alpha, strength, constant)[0]
        ctx.save_for_backward(x, f, alpha, strength)
        ctx.constant, ctx.kernels = constant, kernels
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        x, f, alpha, strength = ctx.saved_tensors
        grads = run_maybe_compiled(ctx.kernels.backward, x, grad, x, f, alpha, strength, ctx.constant)
        g_x, g_f, g_alpha = grads[:-BOOST_TERMS]
        return g_x, g_f, g_alpha, None, None, None


POLAR_BOOST = BoostKernels(_boost_residual_forward, _boost_residual_gradients)  # packed polar points, sqrt(k)


def fused_boost_residual(x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float) -> Tensor:
    """Boost residual (Eq. 12) of ``x, f (B, N, n+1)`` (:class:`FusedBoostResidual`); ``strength (B, 1)`` or
    ``None``."""
    return fused_apply(FusedBoostResidual, x, f, alpha, strength, float(sqrt_k), POLAR_BOOST)


# --------------------------------------------------------------------------------------------
# Lorentz direct concatenation of the heads (Sec. 4.2)
# --------------------------------------------------------------------------------------------
def packed_direct_concat(p: Tensor, k: float) -> Tensor:
    """Lorentz direct concatenation (:func:`geometry.direct_concat`) of packed points ``(..., H, d+1)`` into one
    packed point ``(..., H d + 1)``."""
    r, u = direct_concat(p[..., 0], p[..., 1:], k)
    return torch.cat([r.unsqueeze(-1), u], dim=-1)


def _direct_concat_gradients(grad: Tensor, p: Tensor, sqrt_k: float) -> Tensor:
    r"""``dL/dp (..., H, d+1)`` of :func:`packed_direct_concat` from its input ``p = [r_h, u_h]`` and ``grad = [g_R,
    g_U]``.  With ``a_h = r_h / sqrt(k)``, ``P = concat_h(sinh a_h u_h)``, ``n = ||P|| = sinh(R / sqrt(k))``,
    ``R = sqrt(k) arsinh(n)`` and ``U_h = sinh a_h u_h / n``:

        g_P = g_R sqrt(k) U / sqrt(1 + n^2) + (g_U - (g_U . U) U) / n,
        g_u_h = sinh a_h g_P_h,   g_r_h = cosh a_h (g_P_h . u_h) / sqrt(k).

    Written through the per-head sums ``e_h = g_U_h . u_h`` and ``|u_h|^2`` (one pass over the input and the
    gradient): ``g_U . U = sum_h sinh a_h e_h / n``, ``g_P_h = c_h u_h + g_U_h / n`` with ``c_h = (g_R sqrt(k) /
    sqrt(1 + n^2) - (g_U . U) / n) sinh a_h / n``, so ``g_P_h . u_h = c_h |u_h|^2 + e_h / n`` and the output
    ``U`` is never read.  Every factor is scaled by ``e^{-max_h a_h}`` as in the forward (no overflow at any
    radius); all zero where every radius is 0 (the reference's subgradient)."""
    heads, dim = p.shape[-2], p.shape[-1] - 1
    a, u = p[..., 0] / sqrt_k, p[..., 1:]
    top = a.amax(-1, keepdim=True)
    sinh_a, cosh_a = scaled_sinh_cosh(a, top)  # (..., H), times e^{-top}
    g_big_u = grad[..., 1:].unflatten(-1, (heads, dim))
    along = (g_big_u * u).sum(-1)  # e_h
    length_sq = u.square().sum(-1)  # |u_h|^2
    norm = safe_sqrt((sinh_a.square() * length_sq).sum(-1))  # n e^{-top}
    inv_norm = inverse_or_zero(norm)
    # dR/dn e^{top} = sqrt(k) / sqrt(1 + n^2) e^{top} = sqrt(k) / sqrt(e^{-2 top} + (n e^{-top})^2)
    slope = sqrt_k * torch.rsqrt(torch.exp(-2.0 * top[..., 0]) + norm.square())
    radial = torch.where(norm > 0, grad[..., 0] * slope, 0.0)
    tangential = (sinh_a * along).sum(-1) * inv_norm  # g_U . U
    coef = ((radial - tangential * inv_norm) * inv_norm).unsqueeze(-1) * sinh_a  # c_h e^{top}
    g_r = cosh_a * (coef * length_sq + along * inv_norm.unsqueeze(-1)) / sqrt_k
    g_u = sinh_a.unsqueeze(-1) * (coef.unsqueeze(-1) * u + inv_norm[..., None, None] * g_big_u)
    return torch.cat([g_r.unsqueeze(-1), g_u], dim=-1)


@registered_operators()
class FusedDirectConcat(torch.autograd.Function):
    r"""The heads' Lorentz direct concatenation (Sec. 4.2, :func:`packed_direct_concat`) with the hand-derived
    backward of :func:`_direct_concat_gradients`.  Saved: the input; the backward recomputes the per-head ``sinh`` /
    ``cosh`` and ``||P||`` per token, and never reads the output."""

    @staticmethod
    def forward(ctx: Any, p: Tensor, k: float) -> Tensor:  # noqa: D102
        ctx.save_for_backward(p)
        ctx.sqrt_k = math.sqrt(k)
        return run_maybe_compiled(packed_direct_concat, p, p, k)

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        (p,) = ctx.saved_tensors
        return run_maybe_compiled(_direct_concat_gradients, p, grad.contiguous(), p, ctx.sqrt_k), None


def fused_direct_concat(p: Tensor, k: float) -> Tensor:
    """Lorentz direct concatenation ``(..., H, d+1) -> (..., H d + 1)`` of packed points
    (:class:`FusedDirectConcat`)."""
    return fused_apply(FusedDirectConcat, p, float(k))
