"""The arithmetic strategies of Polar-ViT: the one place where "how to compute" is decided.

Every layer of the model is written once against :class:`ManifoldOps` and never tests a flag: it calls the
layer-level operations (:meth:`~ManifoldOps.polar_fc`, :meth:`~ManifoldOps.gyro_layer_norm`,
:meth:`~ManifoldOps.boost_residual`, :meth:`~ManifoldOps.relative_position`, :meth:`~ManifoldOps.attention`,
:meth:`~ManifoldOps.concat_heads`) and the geometric primitives below them.  Four siblings implement it:

* :class:`PolarOps` - polar points ``[r, u]``, the reference: the small functions of :mod:`geometry`
  differentiated by autograd;
* :class:`FusedPolarOps` - polar points, the same formulas as autograd Functions with hand-derived backward
  passes (:mod:`fused_attention`, :mod:`fused_gyro_norm`, :mod:`fused_layers`), compiled CPU kernels
  (:mod:`cpu_kernels`);
* :class:`AmbientOps` - ambient coordinates ``[x_0, x_s]``, the textbook Lorentz formulas of :mod:`ambient`
  (the paper's baseline), differentiated by autograd;
* :class:`FusedAmbientOps` - ambient coordinates, the same formulas without an autograd graph of their
  intermediates (:mod:`fused_ambient`, :class:`fused_attention.FusedAmbientAttention`).

An operation one of them lacks is an error at class creation (abstract method), never a silent fallback.  All
pack a point as one tensor ``(..., n+1)``, so reshapes, indexing and gradient checkpointing are the same.  The
parameters never depend on the strategy: a state dict of one loads into the others, and in float64 all give the
same logits (to ~1e-12).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .ambient import (
    beta_concat as ambient_beta_concat,
    beta_split as ambient_beta_split,
    boost as ambient_boost,
    centroid as ambient_centroid,
    direct_concat as ambient_direct_concat,
    from_space as ambient_from_space,
    gyroadd as ambient_gyroadd,
    horoshift as ambient_horoshift,
    klein as ambient_klein,
    pairwise_sq_distance as ambient_pairwise_sq_distance,
    radius as ambient_radius,
    rotate as ambient_rotate,
    sq_distance as ambient_sq_distance,
)
from .attention import polar_attention, select_implementation
from .configuration_polar_vit import POSITION_AXES
from .cpu_kernels import first_order, leading_columns
from .fused_ambient import (
    ambient_fc_forward,
    ambient_relative_position,
    ambient_relative_position_backward,
    fused_ambient_boost_residual,
    fused_ambient_fc_output,
    fused_ambient_gyro_layer_norm,
)
from .fused_attention import (
    fused_ambient_attention,
    fused_ambient_attention_heads,
    fused_polar_attention_heads,
    head_major,
)
from .fused_gyro_norm import fused_gyro_layer_norm
from .fused_layers import (
    boost_residual_step,
    fused_boost_residual,
    fused_direct_concat,
    fused_polar_fc,
    fused_reserved_axes_encoding,
    gemm_width_product,
    is_gelu,
    packed_direct_concat,
    polar_fc_epilogue,
    policy_matmul,
    radius_offset,
)
from .geometry import (
    beta_concat,
    beta_split,
    boost,
    centroid,
    from_space,
    gyroadd_space,
    gyrocenter,
    horoshift,
    pairwise_sq_distance,
    rotate,
    space,
    sq_distance,
    to_ambient,
)
from .stable_math import safe_normalize

Rule = tuple[Tensor, Tensor, Tensor, Tensor]  # Eq. 8's (beta, lambda, varphi, varphi_0)
HALF_DTYPES = (torch.bfloat16, torch.float16)
RESERVED_COLUMNS = 1 + 2 * len(POSITION_AXES)  # the time and the reserved axes, which position encodings move


def product_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype | None:
    """The precision policy's dtype for the Polar-FC matrix products: the autocast dtype when autocast is on for
    ``device_type``, else the weights' dtype when they are stored in half precision, else ``None`` (the products
    in the compute precision).  Everything else (radii, ``arsinh``, norms, chords, centroids, residual boosts)
    runs in float32 or float64."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype if weight_dtype in HALF_DTYPES else None


def product(x: Tensor, weight: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``x W^T`` under the precision policy: in ``dtype`` (bf16 / fp16 GEMMs accumulate in float32) and returned in
    ``x``'s precision, or in ``x``'s precision when ``dtype`` is ``None``."""
    return policy_matmul(x, weight.t(), dtype)


__all__ = [
    "AmbientOps",
    "FusedAmbientOps",
    "FusedPolarOps",
    "ManifoldOps",
    "PolarOps",
    "make_ops",
    "product",
    "product_dtype",
]


class ManifoldOps(ABC):
    """The operations Polar-ViT's layers use, on points packed as one tensor ``(..., n+1)``.

    The layer-level operations are written here once against the primitives (the reference formulas);
    :class:`FusedPolarOps` overrides them with fused Functions.
    """

    name: str

    def __init__(self, k: float = 1.0, product_dtype: torch.dtype | None = None) -> None:
        self.k = float(k)
        self.sqrt_k = math.sqrt(self.k)
        self.product_dtype = product_dtype  # the precision policy's dtype of the Polar-FC products (or None)

    # primitives ------------------------------------------------------------------------------
    @abstractmethod
    def make(self, r: Tensor, u: Tensor) -> Tensor:
        """Pack a radius ``(...)`` and a direction ``(..., n)`` into a point ``(..., n+1)``."""

    @abstractmethod
    def polar(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """``(r, u)`` of a point."""

    @abstractmethod
    def radius(self, p: Tensor) -> Tensor:
        """Geodesic radius ``r`` of a point."""

    @abstractmethod
    def to_ambient(self, p: Tensor) -> Tensor:
        """Ambient coordinates ``(x_0, x_s)``."""

    @abstractmethod
    def unit_coords(self, p: Tensor) -> Tensor:
        """``x / sqrt(k) = (cosh a, sinh a u)``: the input of a Lorentz / Polar fully connected layer."""

    @abstractmethod
    def klein(self, p: Tensor) -> Tensor:
        """Klein vector ``chi = tanh(a) u = x_s / x_0`` (Eq. 8)."""

    @abstractmethod
    def space(self, p: Tensor) -> Tensor:
        """Space coordinates ``x_s = sqrt(k) sinh(a) u``."""

    @abstractmethod
    def from_space(self, xs: Tensor) -> Tensor:
        """The point with space coordinates ``xs``."""

    @abstractmethod
    def origin_like(self, p: Tensor) -> Tensor:
        """The origin, shaped like ``p``."""

    @abstractmethod
    def sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        """Squared geodesic distance (Eq. 5), elementwise."""

    @abstractmethod
    def pairwise_sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        """``(..., N, n+1), (..., M, n+1)`` -> ``(..., N, M)`` squared distances."""

    @abstractmethod
    def centroid(self, p: Tensor, weights: Tensor) -> Tensor:
        """``p (..., M, n+1)``, ``weights (..., N, M)`` -> ``(..., N, n+1)`` (Eq. 4, 22)."""

    @abstractmethod
    def gyrocenter(self, center: Tensor, p: Tensor) -> Tensor:
        """``(-)center (+) p`` (Eq. 21)."""

    @abstractmethod
    def gyroadd_space(self, bias_space: Tensor, p: Tensor) -> Tensor:
        """``b (+) p`` for a bias point given by its space coordinates (Eq. 20)."""

    @abstractmethod
    def scale(self, p: Tensor, factor: Tensor) -> Tensor:
        """Gyro scalar multiplication ``t (x) p``: the radius is scaled, the direction kept."""

    @abstractmethod
    def horoshift(self, p: Tensor, t: Tensor, ideal_axis: int, shift_axis: int) -> Tensor:
        """Horoshift (Eq. 10) by ``t`` with the given ideal and shift axes."""

    @abstractmethod
    def boost(self, p: Tensor, t: Tensor, axis: int) -> Tensor:
        """Lorentz boost with rapidity ``t`` along ``axis``."""

    @abstractmethod
    def rotate(self, p: Tensor, t: Tensor, axis_a: int, axis_b: int) -> Tensor:
        """Rotation of the plane ``(axis_a, axis_b)`` by angle ``t``."""

    @abstractmethod
    def beta_concat_heads(self, p: Tensor) -> Tensor:
        """HNN++ beta-concatenation ``(..., H, d+1) -> (..., H d + 1)`` (``geometry.beta_concat``)."""

    @abstractmethod
    def beta_split_heads(self, p: Tensor, heads: int) -> Tensor:
        """HNN++ beta-split ``(..., n+1) -> (..., H, n/H + 1)`` (``geometry.beta_split``)."""

    @abstractmethod
    def hyperplane_margin(self, p: Tensor, z_hat: Tensor, c1: Tensor, c2: Tensor) -> Tensor:
        """``c1 sinh(a) (u . z_hat) - c2 cosh(a)`` for every point ``(..., n+1)`` and class ``z_hat (C, n)``."""

    @abstractmethod
    def readout(self, output) -> Tensor:  # noqa: ANN001 - a PolarViTModelOutput
        """The readout point of a :class:`PolarViTModelOutput` in this arithmetic's packing."""

    # layer-level operations --------------------------------------------------------------------
    @abstractmethod
    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, implementation: str, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Eq. 9 on ``(B, H, N, d+1)`` points with per-head ``scale (H,)``: ``(heads (B, H, N, d+1), probs or
        None)``; ``implementation`` is ``config.polar_attn_implementation`` (``auto`` decided here)."""

    def attention_heads(
        self, qk: Tensor, v: Tensor, scale: Tensor, implementation: str, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`attention` on the heads as a layer holds them, token-major: queries and keys side by side
        ``qk (B, N, 2H, d+1)``, values ``v (B, N, H, d+1)``; ``(heads (B, N, H, d+1), probs or None)``."""
        heads, probs = self.attention(*head_major(qk, v), scale, implementation, return_probs)
        return heads.transpose(1, 2), probs

    @abstractmethod
    def concat_heads(self, p: Tensor) -> Tensor:
        """Lorentz direct concatenation ``(..., H, d+1) -> (..., H d + 1)`` (Sec. 4.2)."""

    def polar_fc(
        self, p: Tensor, weight: Tensor, rule: Rule | None, heads: int, activation: Callable | None = None
    ) -> Tensor:
        """``heads`` Polar-FCs (Eq. 8) on ``p (..., n+1)`` -> ``(..., heads, d+1)``: ``h = phi(W x / sqrt(k))``,
        ``u' = h / ||h||``, ``r' = sqrt(k) arsinh(e^l)`` (:func:`fused_layers.polar_fc_epilogue`); ``rule`` is
        ``(beta, lambda, varphi, varphi_0)`` or ``None`` (the Lorentz FC, ``l = ln ||h||``)."""
        h = self.fc_product(self.unit_coords(p), weight).unflatten(-1, (heads, -1))
        gelu = is_gelu(activation)
        if activation is not None and not gelu:
            h = activation(h)
        return self.polar_fc_output(h, p, rule, gelu)

    def fc_product(self, x: Tensor, weight: Tensor) -> Tensor:
        """The product ``x W^T`` of :meth:`polar_fc` under the precision policy (:func:`product`)."""
        return product(x, weight, self.product_dtype)

    def polar_fc_output(self, h: Tensor, p: Tensor, rule: Rule | None, gelu: bool) -> Tensor:
        """The output points of :meth:`polar_fc` from its product ``h = W x / sqrt(k)`` ``(..., heads, d)`` (before
        the GELU when ``gelu``) and its input points ``p`` (read by the radius rule only)."""
        offset, norm_power = self.radius_rule_terms(p, rule)
        out, _ = polar_fc_epilogue(h, offset, norm_power, self.sqrt_k, gelu)
        return self.make(out[..., 0], out[..., 1:])

    def radius_rule_terms(self, p: Tensor, rule: Rule | None) -> tuple[Tensor | None, Tensor | None]:
        """``(offset, beta)`` of Eq. 8's radius rule on the input points ``p``: ``offset = lambda a + varphi^T chi +
        varphi_0`` (:func:`fused_layers.radius_offset`); ``(None, None)`` without the rule."""
        if rule is None:
            return None, None
        norm_power, radius_weight, klein_weight, radius_bias = (t.to(p.dtype) for t in rule)
        klein_term = self.klein(p) @ klein_weight.t()
        return radius_offset(self.radius(p) / self.sqrt_k, klein_term, radius_weight, radius_bias), norm_power

    def gyro_layer_norm(self, p: Tensor, log_gain: Tensor, bias_space: Tensor, eps: float) -> Tensor:
        """Gyro layer norm (Sec. 4.4) over the tokens ``(B, N, n+1)`` of each sample: ``b (+) (gamma / sqrt(sigma^2
        + eps) (x) ((-)m (+) x))`` with ``m`` their centroid and ``sigma^2`` their mean squared distance to it."""
        batch, tokens = p.shape[0], p.shape[-2]
        uniform = p.new_full((batch, 1, tokens), 1.0 / tokens)
        mean = self.centroid(p, uniform)  # (B, 1, n+1)
        variance = self.sq_distance(p, mean).mean(-1, keepdim=True)  # (B, 1)
        centred = self.gyrocenter(mean, p)
        return self.gyroadd_space(bias_space, self.scale(centred, torch.exp(log_gain) / torch.sqrt(variance + eps)))

    def boost_residual(self, x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None) -> Tensor:
        """The boost residual of Eq. 12 (:func:`fused_layers.boost_residual_step`) on ``x, f (B, N, n+1)``;
        ``strength (B, 1)`` scales ``f``'s radius (stochastic depth)."""
        r, u = self.polar(x)
        r_f, v = self.polar(f)
        b = r_f / self.sqrt_k
        radius, direction = boost_residual_step(r / self.sqrt_k, u, b if strength is None else b * strength, v, alpha)
        return self.make(self.sqrt_k * radius, direction)

    def relative_position(self, kind: str, p: Tensor, t_rows: Tensor, t_cols: Tensor) -> Tensor:
        """The 2-D relative encoding ``kind`` (``horoshift`` Eq. 10 / ``boost`` HoPE / ``rotation`` HOPE) of
        ``p (B, N, H, d+1)``: rows moved by ``t_rows (N, H)`` on the reserved axes ``(0, 1)``, columns by ``t_cols``
        on ``(2, 3)``."""
        for t, axes in zip((t_rows, t_cols), POSITION_AXES):
            if kind == "horoshift":
                p = self.horoshift(p, t, *axes)
            elif kind == "boost":
                p = self.boost(p, t, axes[0])
            else:
                p = self.rotate(p, t, *axes)
        return p


class _PolarPoints(ManifoldOps):
    """The primitives on packed polar points ``[r, u]`` (radius, then unit direction), shared by the reference
    and the fused strategies."""

    name = "polar"
    auto_attention = "eager"  # what ``polar_attn_implementation="auto"`` resolves to below the chunked length

    @staticmethod
    def make(r: Tensor, u: Tensor) -> Tensor:
        """Pack a radius ``(...)`` and a direction ``(..., n)`` into a point ``(..., n+1)``."""
        return torch.cat([r.unsqueeze(-1), u], dim=-1)

    @staticmethod
    def polar(p: Tensor) -> tuple[Tensor, Tensor]:
        """``(r, u)`` of a point."""
        return p[..., 0], p[..., 1:]

    def radius(self, p: Tensor) -> Tensor:
        return p[..., 0]

    def to_ambient(self, p: Tensor) -> Tensor:
        return to_ambient(p[..., 0], p[..., 1:], self.k)

    def unit_coords(self, p: Tensor) -> Tensor:
        a = p[..., :1] / self.sqrt_k
        return torch.cat([torch.cosh(a), torch.sinh(a) * p[..., 1:]], dim=-1)

    def klein(self, p: Tensor) -> Tensor:
        return torch.tanh(p[..., :1] / self.sqrt_k) * p[..., 1:]

    def space(self, p: Tensor) -> Tensor:
        return space(p[..., 0], p[..., 1:], self.k)

    def from_space(self, xs: Tensor) -> Tensor:
        return self.make(*from_space(xs, self.k))

    def origin_like(self, p: Tensor) -> Tensor:
        out = torch.zeros_like(p)
        out[..., 1] = 1.0
        return out

    def sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        return sq_distance(p[..., 0], p[..., 1:], q[..., 0], q[..., 1:], self.k)

    def pairwise_sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        return pairwise_sq_distance(p[..., 0], p[..., 1:], q[..., 0], q[..., 1:], self.k)

    def centroid(self, p: Tensor, weights: Tensor) -> Tensor:
        return self.make(*centroid(p[..., 0], p[..., 1:], weights, self.k))

    def gyrocenter(self, center: Tensor, p: Tensor) -> Tensor:
        return self.make(*gyrocenter(center[..., 0], center[..., 1:], p[..., 0], p[..., 1:], self.k))

    def gyroadd_space(self, bias_space: Tensor, p: Tensor) -> Tensor:
        return self.make(*gyroadd_space(bias_space, p[..., 0], p[..., 1:], self.k))

    def scale(self, p: Tensor, factor: Tensor) -> Tensor:
        return self.make(p[..., 0] * factor, p[..., 1:])

    def horoshift(self, p: Tensor, t: Tensor, ideal_axis: int, shift_axis: int) -> Tensor:
        return self.make(*horoshift(p[..., 0], p[..., 1:], t, ideal_axis, shift_axis, self.k))

    def boost(self, p: Tensor, t: Tensor, axis: int) -> Tensor:
        return self.make(*boost(p[..., 0], p[..., 1:], t, axis, self.k))

    def rotate(self, p: Tensor, t: Tensor, axis_a: int, axis_b: int) -> Tensor:
        return self.make(*rotate(p[..., 0], p[..., 1:], t, axis_a, axis_b))

    def beta_concat_heads(self, p: Tensor) -> Tensor:
        return self.make(*beta_concat(p[..., 0], p[..., 1:]))

    def beta_split_heads(self, p: Tensor, heads: int) -> Tensor:
        return self.make(*beta_split(p[..., 0], p[..., 1:], heads))

    def hyperplane_margin(self, p: Tensor, z_hat: Tensor, c1: Tensor, c2: Tensor) -> Tensor:
        """``cosh(a) [c1 cos - c2] - c1 cos e^{-a}`` with ``cos = u . z_hat``: the large terms never cancel."""
        a = p[..., :1] / self.sqrt_k
        cos = p[..., 1:] @ z_hat.t()
        return torch.cosh(a) * (c1 * cos - c2) - c1 * cos * torch.exp(-a)

    def readout(self, output) -> Tensor:  # noqa: ANN001 - a PolarViTModelOutput
        return output.pooler_polar

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, implementation: str, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        impl = select_implementation(implementation, return_probs, q.device, q.shape[2], self.auto_attention)
        out = polar_attention(
            q[..., 0],
            q[..., 1:],
            k[..., 0],
            k[..., 1:],
            v[..., 0],
            v[..., 1:],
            scale,
            self.k,
            impl=impl,
            return_probs=return_probs,
        )
        return self.make(out[0], out[1]), (out[-1] if return_probs else None)

    def concat_heads(self, p: Tensor) -> Tensor:
        return packed_direct_concat(p, self.k)


class PolarOps(_PolarPoints):
    """Polar points, the reference: every operation from the functions of :mod:`geometry`, differentiated by
    autograd."""


class FusedPolarOps(_PolarPoints):
    """Polar points, the fused layers: the same formulas as autograd Functions with hand-derived backward passes
    that save only inputs, outputs and per-token scalars (compiled CPU kernels)."""

    auto_attention = "fused"

    def polar_fc(
        self, p: Tensor, weight: Tensor, rule: Rule | None, heads: int, activation: Callable | None = None
    ) -> Tensor:
        rule = (
            None
            if rule is None
            else (rule[0].to(p.dtype), rule[1].to(p.dtype), rule[2].to(p.dtype), rule[3].to(p.dtype))
        )
        return fused_polar_fc(p, weight, rule, self.sqrt_k, heads, activation, self.product_dtype)

    def gyro_layer_norm(self, p: Tensor, log_gain: Tensor, bias_space: Tensor, eps: float) -> Tensor:
        return fused_gyro_layer_norm(p, log_gain, bias_space, self.k, eps)

    def boost_residual(self, x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None) -> Tensor:
        return fused_boost_residual(x, f, alpha, strength, self.sqrt_k)

    def relative_position(self, kind: str, p: Tensor, t_rows: Tensor, t_cols: Tensor) -> Tensor:
        return fused_reserved_axes_encoding(p, t_rows, t_cols, kind, self.sqrt_k)

    def attention_heads(
        self, qk: Tensor, v: Tensor, scale: Tensor, implementation: str, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The fused core on the token-major heads themselves (:class:`fused_attention.FusedPolarAttentionHeads`:
        the output and the gradients in the layer's layouts) where the implementation resolves to ``fused``."""
        impl = select_implementation(implementation, return_probs, v.device, v.shape[1], self.auto_attention)
        if impl != "fused":
            return super().attention_heads(qk, v, scale, implementation, return_probs)
        return fused_polar_attention_heads(qk, v, scale, self.k), None

    def concat_heads(self, p: Tensor) -> Tensor:
        """Hand-derived backward from the input and the output (a compiled kernel each way on the CPU)."""
        return fused_direct_concat(p, self.k)


class AmbientOps(ManifoldOps):
    """Ambient coordinates ``[x_0, x_s]``: the textbook Lorentz formulas (the paper's baseline)."""

    name = "ambient"

    def make(self, r: Tensor, u: Tensor) -> Tensor:
        return to_ambient(r, u, self.k)

    def radius(self, p: Tensor) -> Tensor:
        """``sqrt(k) arcosh(x_0 / sqrt(k))``, read from the time coordinate as ambient models do."""
        return ambient_radius(p, self.k)

    def polar(self, p: Tensor) -> tuple[Tensor, Tensor]:
        return self.radius(p), safe_normalize(p[..., 1:])

    def to_ambient(self, p: Tensor) -> Tensor:
        return p

    def unit_coords(self, p: Tensor) -> Tensor:
        return p if self.sqrt_k == 1.0 else p / self.sqrt_k  # (no copy at k = 1: the product saves its input)

    def klein(self, p: Tensor) -> Tensor:
        return ambient_klein(p)

    def space(self, p: Tensor) -> Tensor:
        return p[..., 1:]

    def from_space(self, xs: Tensor) -> Tensor:
        return ambient_from_space(xs, self.k)

    def origin_like(self, p: Tensor) -> Tensor:
        out = torch.zeros_like(p)
        out[..., 0] = self.sqrt_k
        return out

    def sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        return ambient_sq_distance(p, q, self.k)

    def pairwise_sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        return ambient_pairwise_sq_distance(p, q, self.k)

    def centroid(self, p: Tensor, weights: Tensor) -> Tensor:
        return ambient_centroid(p, weights, self.k)

    def gyrocenter(self, center: Tensor, p: Tensor) -> Tensor:
        negated = torch.cat([center[..., :1], -center[..., 1:]], dim=-1)
        return ambient_gyroadd(negated.expand_as(p), p, self.k)

    def gyroadd_space(self, bias_space: Tensor, p: Tensor) -> Tensor:
        return ambient_gyroadd(ambient_from_space(bias_space, self.k).expand_as(p), p, self.k)

    def scale(self, p: Tensor, factor: Tensor) -> Tensor:
        r, u = self.polar(p)
        return self.make(r * factor, u)

    def horoshift(self, p: Tensor, t: Tensor, ideal_axis: int, shift_axis: int) -> Tensor:
        return ambient_horoshift(p, t, ideal_axis, shift_axis, self.k)

    def boost(self, p: Tensor, t: Tensor, axis: int) -> Tensor:
        return ambient_boost(p, t, axis, self.k)

    def rotate(self, p: Tensor, t: Tensor, axis_a: int, axis_b: int) -> Tensor:
        return ambient_rotate(p, t, axis_a, axis_b)

    def concat_heads(self, p: Tensor) -> Tensor:
        return ambient_direct_concat(p, self.k)

    def beta_concat_heads(self, p: Tensor) -> Tensor:
        return ambient_beta_concat(p, self.k)

    def beta_split_heads(self, p: Tensor, heads: int) -> Tensor:
        return ambient_beta_split(p, heads, self.k)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, implementation: str, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Eager ambient attention (``implementation`` applies to polar arithmetic only)."""
        weights = torch.softmax(-scale.view(-1, 1, 1) * self.pairwise_sq_distance(q, k), dim=-1)
        return self.centroid(v, weights), (weights if return_probs else None)

    def polar_fc_output(self, h: Tensor, p: Tensor, rule: Rule | None, gelu: bool) -> Tensor:
        """Eq. 8's output in ambient coordinates, straight from its log-radius
        (:func:`fused_ambient.ambient_fc_forward`, differentiated by autograd)."""
        return ambient_fc_forward(h, p, _cast(rule, h.dtype), self.k, gelu)[0]

    def hyperplane_margin(self, p: Tensor, z_hat: Tensor, c1: Tensor, c2: Tensor) -> Tensor:
        x = p / self.sqrt_k
        return c1 * (x[..., 1:] @ z_hat.t()) - c2 * x[..., :1]

    def readout(self, output) -> Tensor:  # noqa: ANN001 - a PolarViTModelOutput
        return output.pooler_output


class FusedAmbientOps(AmbientOps):
    """Ambient coordinates, the fused layers: the formulas of :class:`AmbientOps`, in the same order, without an
    autograd graph of their intermediates.  Attention is :class:`fused_attention.FusedAmbientAttention`, the gyro
    layer norm :class:`fused_ambient.FusedAmbientGyroLayerNorm`, the Polar-FC's output points (the epilogue of
    Eq. 8, the radius rule and the ambient coordinates) :class:`fused_ambient.FusedAmbientFCOutput` and the boost
    residual (:func:`fused_ambient.fused_ambient_boost_residual`) and the position encodings on the five leading
    coordinates (:func:`fused_ambient.ambient_relative_position` through :func:`cpu_kernels.leading_columns`), with
    hand-derived backward passes; each a compiled kernel on the CPU.  Polar-FC's product keeps the input points and the
    weight, as autograd's, and computes their gradient at an aligned width (:class:`fused_layers.GemmWidthProduct`);
    the heads' concatenation keeps only its output (:class:`SpaceToPoint`)."""

    def fc_product(self, x: Tensor, weight: Tensor) -> Tensor:
        """The product with its input gradient at an aligned width (:class:`fused_layers.GemmWidthProduct`): the
        points are ``n + 1`` wide, and the gradient ``g W`` of that odd width takes MKL's slow path."""
        return gemm_width_product(x, weight, self.product_dtype)

    def polar_fc_output(self, h: Tensor, p: Tensor, rule: Rule | None, gelu: bool) -> Tensor:
        """:class:`fused_ambient.FusedAmbientFCOutput`: without the GELU nothing of the product's size is kept."""
        return fused_ambient_fc_output(h, p, _cast(rule, h.dtype), self.k, gelu)

    def gyro_layer_norm(self, p: Tensor, log_gain: Tensor, bias_space: Tensor, eps: float) -> Tensor:
        return fused_ambient_gyro_layer_norm(p, log_gain, bias_space, self.k, eps)

    def boost_residual(self, x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None) -> Tensor:
        return fused_ambient_boost_residual(x, f, alpha, strength, self.k)

    def relative_position(self, kind: str, p: Tensor, t_rows: Tensor, t_cols: Tensor) -> Tensor:
        """Only the time and the reserved coordinates change (:data:`RESERVED_COLUMNS`): the moves run on them, each
        coordinate its own plane, and the other coordinates pass through (:func:`cpu_kernels.leading_columns`)."""
        return leading_columns(
            ambient_relative_position,
            ambient_relative_position_backward,
            RESERVED_COLUMNS,
            p,
            t_rows,
            t_cols,
            constants=(kind,),
        )

    def concat_heads(self, p: Tensor) -> Tensor:
        """Keeping only its output points, which the output projection's product keeps anyway
        (:class:`SpaceToPoint`)."""
        return SpaceToPoint.apply(p[..., 1:].flatten(-2), self.k)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, implementation: str, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The fused core (:class:`fused_attention.FusedAmbientAttention`: nothing of size ``N x M`` kept for
        backward); eager where the probabilities are returned."""
        if return_probs:
            return super().attention(q, k, v, scale, implementation, return_probs)
        return fused_ambient_attention(q, k, v, scale, self.k), None

    def attention_heads(
        self, qk: Tensor, v: Tensor, scale: Tensor, implementation: str, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The fused core on the token-major heads themselves (:class:`fused_attention.FusedAmbientAttentionHeads`);
        eager where the probabilities are returned."""
        if return_probs:
            return super().attention_heads(qk, v, scale, implementation, return_probs)
        return fused_ambient_attention_heads(qk, v, scale, self.k), None


class SpaceToPoint(torch.autograd.Function):
    """The point ``[x_0, x_s]`` with ``x_0 = sqrt(k + ||x_s||^2)`` (:func:`ambient.from_space`), keeping only its
    output: ``dx_0 / dx_s = x_s / x_0``, both read from the output (autograd would keep ``x_s`` as well)."""

    @staticmethod
    def forward(ctx: Any, xs: Tensor, k: float) -> Tensor:  # noqa: D102
        out = ambient_from_space(xs, k)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        (out,) = ctx.saved_tensors
        return torch.addcmul(grad[..., 1:], grad[..., :1] / out[..., :1], out[..., 1:]), None


def _cast(rule: Rule | None, dtype: torch.dtype) -> Rule | None:
    """Eq. 8's radius rule in the precision of the points and the product (``None`` without the rule)."""
    return None if rule is None else (rule[0].to(dtype), rule[1].to(dtype), rule[2].to(dtype), rule[3].to(dtype))


def make_ops(
    arithmetic: str,
    k: float,
    fused: bool = False,
    product_dtype: torch.dtype | None = None,
) -> ManifoldOps:
    """The strategy of ``config.arithmetic`` and ``config.fused_ops``, with the matrix products in
    ``product_dtype`` (:func:`product_dtype`)."""
    if arithmetic == "polar":
        return (FusedPolarOps if fused else PolarOps)(k, product_dtype)
    if arithmetic == "ambient":
        return (FusedAmbientOps if fused else AmbientOps)(k, product_dtype)
    raise ValueError(f"arithmetic={arithmetic!r} is not one of ('polar', 'ambient')")
