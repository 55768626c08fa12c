"""Shared test helpers: random polar points."""

from __future__ import annotations

import torch
from torch import Tensor


def unit(v: Tensor) -> Tensor:
    return v / v.norm(dim=-1, keepdim=True)


def random_points(*shape: int, dim: int = 8, rmax: float = 5.0, dtype=torch.float64,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Radii uniform in [0, rmax) and uniformly random directions."""
    r = torch.rand(*shape, dtype=dtype, generator=generator) * rmax
    u = unit(torch.randn(*shape, dim, dtype=dtype, generator=generator))
    return r, u


def near(u: Tensor, angle: float, generator: torch.Generator | None = None) -> Tensor:
    """Directions at (about) ``angle`` from ``u``."""
    noise = torch.randn(u.shape, dtype=u.dtype, generator=generator)
    noise = noise - (noise * u).sum(-1, keepdim=True) * u
    return unit(u + angle * unit(noise))
