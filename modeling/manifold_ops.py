"""The two arithmetics of Polar-ViT: polar form and ambient Lorentz coordinates.

Every layer of the model is written once against the interface :class:`ManifoldOps`; its two
implementations are siblings: ``PolarOps`` runs it with the polar operations of :mod:`geometry`,
``AmbientOps`` with the ambient formulas of :mod:`ambient` (the paper's baseline).  An operation
one of them lacks is an error at class creation (abstract method), never a silent fallback.  Both
represent a point as one tensor of shape
``(..., n+1)`` so that reshapes, indexing and gradient checkpointing are the same:

* polar:   ``p = [r, u_1, ..., u_n]`` (radius, then unit direction);
* ambient: ``x = [x_0, x_1, ..., x_n]`` (time, then space coordinates).

The parameters of a model never depend on the arithmetic, so a state dict of one loads into
the other, and in float64 both give the same logits (to ~1e-12).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

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
    pairwise_sq_distance as ambient_pairwise_sq_distance,
    rotate as ambient_rotate,
    sq_distance as ambient_sq_distance,
)
from .attention import polar_attention
from .fused import recomputed
from .geometry import (
    beta_concat,
    beta_split,
    boost,
    centroid,
    direct_concat,
    from_space,
    gyroadd_space,
    gyrocenter,
    horoshift,
    pairwise_sq_distance,
    rotate,
    safe_normalize,
    space,
    sq_distance,
    to_ambient,
)


def packed_direct_concat(p: Tensor, k: float) -> Tensor:
    """Lorentz direct concatenation (:func:`geometry.direct_concat`) of packed points ``(..., H, d+1)`` into one
    packed point ``(..., H d + 1)``."""
    r, u = direct_concat(p[..., 0], p[..., 1:], k)
    return torch.cat([r.unsqueeze(-1), u], dim=-1)


class ManifoldOps(ABC):
    """The operations Polar-ViT's layers use, on points packed as one tensor ``(..., n+1)``.

    ``fused`` is ``True`` only for polar arithmetic with ``config.fused_ops``: the layers then call
    the fused functions of :mod:`fused` (the same formulas with hand-derived backward passes).
    """

    name: str
    fused: bool = False

    def __init__(self, k: float = 1.0):
        self.k = float(k)
        self.sqrt_k = math.sqrt(self.k)

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
    def concat_heads(self, p: Tensor) -> Tensor:
        """Lorentz direct concatenation ``(..., H, d+1) -> (..., H d + 1)`` (Sec. 4.2)."""

    @abstractmethod
    def beta_concat_heads(self, p: Tensor) -> Tensor:
        """HNN++ beta-concatenation ``(..., H, d+1) -> (..., H d + 1)`` (``geometry.beta_concat``)."""

    @abstractmethod
    def beta_split_heads(self, p: Tensor, heads: int) -> Tensor:
        """HNN++ beta-split ``(..., n+1) -> (..., H, n/H + 1)`` (``geometry.beta_split``)."""

    @abstractmethod
    def attention(self, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, implementation: str,
                  return_probs: bool) -> tuple[Tensor, Tensor | None]:
        """Eq. 9 on ``(B, H, N, d+1)`` points with per-head ``scale (H,)``:
        ``(heads (B, H, N, d+1), probs or None)``."""

    @abstractmethod
    def hyperplane_margin(self, p: Tensor, z_hat: Tensor, c1: Tensor, c2: Tensor) -> Tensor:
        """``c1 sinh(a) (u . z_hat) - c2 cosh(a)`` for every point ``(..., n+1)`` and class ``z_hat (C, n)``."""

    @abstractmethod
    def readout(self, output) -> Tensor:
        """The readout point of a :class:`PolarViTModelOutput` in this arithmetic's packing."""


class PolarOps(ManifoldOps):
    """Arithmetic on packed polar points ``[r, u]``."""

    name = "polar"

    def __init__(self, k: float = 1.0, fused: bool = False):
        super().__init__(k)
        self.fused = bool(fused)

    # packing -------------------------------------------------------------------------------
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
        """``x / sqrt(k) = (cosh a, sinh a u)``: the input of a Lorentz / Polar fully connected layer."""
        a = p[..., :1] / self.sqrt_k
        return torch.cat([torch.cosh(a), torch.sinh(a) * p[..., 1:]], dim=-1)

    def klein(self, p: Tensor) -> Tensor:
        """Klein vector ``chi = tanh(a) u = x_s / x_0`` (Eq. 8)."""
        return torch.tanh(p[..., :1] / self.sqrt_k) * p[..., 1:]

    def space(self, p: Tensor) -> Tensor:
        return space(p[..., 0], p[..., 1:], self.k)

    def from_space(self, xs: Tensor) -> Tensor:
        return self.make(*from_space(xs, self.k))

    def origin_like(self, p: Tensor) -> Tensor:
        out = torch.zeros_like(p)
        out[..., 1] = 1.0
        return out

    # geometry ------------------------------------------------------------------------------
    def sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        return sq_distance(p[..., 0], p[..., 1:], q[..., 0], q[..., 1:], self.k)

    def pairwise_sq_distance(self, p: Tensor, q: Tensor) -> Tensor:
        return pairwise_sq_distance(p[..., 0], p[..., 1:], q[..., 0], q[..., 1:], self.k)

    def centroid(self, p: Tensor, weights: Tensor) -> Tensor:
        """``p (..., M, n+1)``, ``weights (..., N, M)`` -> ``(..., N, n+1)`` (Eq. 22)."""
        return self.make(*centroid(p[..., 0], p[..., 1:], weights, self.k))

    def gyrocenter(self, center: Tensor, p: Tensor) -> Tensor:
        """``(-)center (+) p`` (Eq. 21)."""
        return self.make(*gyrocenter(center[..., 0], center[..., 1:], p[..., 0], p[..., 1:], self.k))

    def gyroadd_space(self, bias_space: Tensor, p: Tensor) -> Tensor:
        """``b (+) p`` for a bias point given by its space coordinates (smooth at the origin)."""
        return self.make(*gyroadd_space(bias_space, p[..., 0], p[..., 1:], self.k))

    def scale(self, p: Tensor, factor: Tensor) -> Tensor:
        """Gyro scalar multiplication ``t (x) p``: the radius is scaled, the direction kept."""
        return self.make(p[..., 0] * factor, p[..., 1:])

    def horoshift(self, p: Tensor, t: Tensor, ideal_axis: int, shift_axis: int) -> Tensor:
        return self.make(*horoshift(p[..., 0], p[..., 1:], t, ideal_axis, shift_axis, self.k))

    def boost(self, p: Tensor, t: Tensor, axis: int) -> Tensor:
        return self.make(*boost(p[..., 0], p[..., 1:], t, axis, self.k))

    def rotate(self, p: Tensor, t: Tensor, axis_a: int, axis_b: int) -> Tensor:
        return self.make(*rotate(p[..., 0], p[..., 1:], t, axis_a, axis_b))

    def concat_heads(self, p: Tensor) -> Tensor:
        if self.fused:  # no autograd graph of its intermediates (a compiled kernel when training on the CPU)
            return recomputed(packed_direct_concat, p, constants=(self.k,))
        return packed_direct_concat(p, self.k)

    def beta_concat_heads(self, p: Tensor) -> Tensor:
        return self.make(*beta_concat(p[..., 0], p[..., 1:]))

    def beta_split_heads(self, p: Tensor, heads: int) -> Tensor:
        return self.make(*beta_split(p[..., 0], p[..., 1:], heads))

    def attention(self, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, implementation: str,
                  return_probs: bool) -> tuple[Tensor, Tensor | None]:
        out = polar_attention(q[..., 0], q[..., 1:], k[..., 0], k[..., 1:], v[..., 0], v[..., 1:], scale, self.k,
                              impl=implementation, return_probs=return_probs)
        return self.make(out[0], out[1]), (out[2] if return_probs else None)

    def hyperplane_margin(self, p: Tensor, z_hat: Tensor, c1: Tensor, c2: Tensor) -> Tensor:
        """``cosh(a) [c1 cos - c2] - c1 cos e^{-a}`` with ``cos = u . z_hat``: the large terms never cancel."""
        a = p[..., :1] / self.sqrt_k
        cos = p[..., 1:] @ z_hat.t()
        return torch.cosh(a) * (c1 * cos - c2) - c1 * cos * torch.exp(-a)

    def readout(self, output) -> Tensor:
        return output.pooler_polar


class AmbientOps(ManifoldOps):
    """Arithmetic on ambient coordinates ``[x_0, x_s]``: the textbook Lorentz formulas."""

    name = "ambient"

    def make(self, r: Tensor, u: Tensor) -> Tensor:
        return to_ambient(r, u, self.k)

    def radius(self, p: Tensor) -> Tensor:
        """``sqrt(k) arcosh(x_0 / sqrt(k))``, read from the time coordinate as ambient models do."""
        return self.sqrt_k * torch.acosh((p[..., 0] / self.sqrt_k).clamp_min(1.0))

    def polar(self, p: Tensor) -> tuple[Tensor, Tensor]:
        return self.radius(p), safe_normalize(p[..., 1:])

    def to_ambient(self, p: Tensor) -> Tensor:
        return p

    def unit_coords(self, p: Tensor) -> Tensor:
        return p / self.sqrt_k

    def klein(self, p: Tensor) -> Tensor:
        return p[..., 1:] / p[..., :1]

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

    def attention(self, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, implementation: str,
                  return_probs: bool) -> tuple[Tensor, Tensor | None]:
        """Eager ambient attention (``implementation`` applies to polar arithmetic only)."""
        weights = torch.softmax(-scale.view(-1, 1, 1) * self.pairwise_sq_distance(q, k), dim=-1)
        return self.centroid(v, weights), (weights if return_probs else None)

    def hyperplane_margin(self, p: Tensor, z_hat: Tensor, c1: Tensor, c2: Tensor) -> Tensor:
        x = p / self.sqrt_k
        return c1 * (x[..., 1:] @ z_hat.t()) - c2 * x[..., :1]

    def readout(self, output) -> Tensor:
        return output.pooler_output


def make_ops(arithmetic: str, k: float, fused: bool = False) -> ManifoldOps:
    """The arithmetic named by ``config.arithmetic``; ``fused`` (``config.fused_ops``) applies to polar only."""
    if arithmetic == "polar":
        return PolarOps(k, fused)
    if arithmetic == "ambient":
        return AmbientOps(k)
    raise ValueError(f"arithmetic={arithmetic!r} is not one of ('polar', 'ambient')")
