"""Polar attention core (paper Eq. 5, 6, 7, 9, 22): squared-distance scores, softmax, polar centroid.

``polar_attention`` works on per-head polar points: radii ``(B, H, N)`` and directions
``(B, H, N, d)``.  The score between query ``i`` and key ``j`` is ``-scale_h * d^2(q_i, k_j)``
(``scale = gamma / tau`` of Eq. 9) and the output is the polar centroid of the values with the
softmax weights.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from .geometry import centroid, pairwise_sq_distance

IMPLEMENTATIONS = ("eager",)

Scale = Union[float, Tensor]


def _scale_tensor(scale: Scale, num_heads: int, like: Tensor) -> Tensor:
    """``scale`` as a ``(H, 1, 1)`` tensor broadcasting over ``(B, H, Nq, Nk)`` scores."""
    scale = torch.as_tensor(scale, dtype=like.dtype, device=like.device)
    if scale.dim() == 0:
        return scale.reshape(1, 1, 1)
    if scale.shape != (num_heads,):
        raise ValueError(f"scale must be a float or a ({num_heads},) tensor, got shape {tuple(scale.shape)}")
    return scale.reshape(num_heads, 1, 1)


def _check_attention_shapes(rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor) -> None:
    if uq.dim() != 4 or uk.dim() != 4 or uv.dim() != 4:
        raise ValueError("polar_attention expects directions of shape (B, H, N, d)")
    if rq.shape != uq.shape[:-1] or rk.shape != uk.shape[:-1] or rv.shape != uv.shape[:-1]:
        raise ValueError("radii must have shape (B, H, N) matching their directions (B, H, N, d)")
    if uk.shape[:-1] != uv.shape[:-1]:
        raise ValueError(f"keys {tuple(uk.shape)} and values {tuple(uv.shape)} must have the same (B, H, N)")
    if uq.shape[:2] != uk.shape[:2] or uq.shape[-1] != uk.shape[-1]:
        raise ValueError(f"queries {tuple(uq.shape)} and keys {tuple(uk.shape)} must share B, H and d")


def eager_polar_attention(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale: Scale, k: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference implementation: materialises the ``(B, H, Nq, Nk)`` scores and probabilities.

    Returns ``(r, u, probs)``.
    """
    scores = -_scale_tensor(scale, uq.shape[1], rq) * pairwise_sq_distance(rq, uq, rk, uk, k)
    probs = torch.softmax(scores, dim=-1)
    r, u = centroid(rv, uv, probs, k)
    return r, u, probs


def polar_attention(
    rq: Tensor,
    uq: Tensor,
    rk: Tensor,
    uk: Tensor,
    rv: Tensor,
    uv: Tensor,
    scale: Scale,
    k: float = 1.0,
    impl: str = "eager",
    return_probs: bool = False,
):
    """Polar attention of Eq. 9: ``softmax_j(-scale d^2(q_i, k_j))`` and the polar centroid of the values.

    Shapes: radii ``(B, H, N)``, directions ``(B, H, N, d)``; ``scale`` is a float or an ``(H,)``
    tensor.  Returns ``(r, u)`` of shapes ``(B, H, Nq)``, ``(B, H, Nq, d)``, and the probabilities
    ``(B, H, Nq, Nk)`` as a third element when ``return_probs`` is set (eager only).
    """
    _check_attention_shapes(rq, uq, rk, uk, rv, uv)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLEMENTATIONS}")
    r, u, probs = eager_polar_attention(rq, uq, rk, uk, rv, uv, scale, k)
    return (r, u, probs) if return_probs else (r, u)


__all__ = ["IMPLEMENTATIONS", "eager_polar_attention", "polar_attention"]
