"""Ambient Lorentz arithmetic: the baseline twins of the polar operations in :mod:`geometry`.

Points are ambient coordinates ``x = (x_0, x_s)`` of shape ``(..., n+1)`` on
``<x, x>_L = -k``.  These are the textbook formulas (Chen et al. 2022, Law et al. 2019, Bdeir et
al. 2024/2025) that the Polar-ViT paper compares against: they subtract two quantities of size
``e^{2a}`` and fail silently from ``r ~ 8`` in float32 (paper Section 3.1, Proposition 1).  They
are exact in exact arithmetic, agree with the polar forms to ~1e-12 in float64 at moderate
radius, and are used by ``arithmetic="ambient"`` models and by the precision benchmark.

Part of the remote code of exported checkpoints: imports only ``torch`` and :mod:`geometry`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .geometry import beta_coefficient
from .validation import Curvature, _check_axis, _sqrt_k

__all__ = [
    "beta_concat",
    "beta_split",
    "boost",
    "busemann_nu",
    "centroid",
    "direct_concat",
    "distance",
    "exp_origin",
    "expmap",
    "from_space",
    "gyroadd",
    "horoshift",
    "inner",
    "klein",
    "lorentz_normalize",
    "lorentz_normalize_backward",
    "acosh_slope",
    "log_origin",
    "logmap",
    "pairwise_minus_inner",
    "pairwise_sq_distance",
    "project_grad",
    "radius",
    "rotate",
    "sq_distance",
    "tangent_from_polar",
    "tangent_to_polar",
    "transport",
]


def norm_floor() -> float:
    """``1e-8``: the floor of the Lorentz norm and of ``arcosh``'s argument over 1, as in common ambient
    implementations (a function, not a module float, so compiled kernels hold it as a constant, not a guard)."""
    return 1e-8


def _check_ambient(x: Tensor, name: str = "x") -> None:
    if x.dim() < 1 or x.shape[-1] < 2:
        raise ValueError(f"{name} must have ambient coordinates (..., n+1), got shape {tuple(x.shape)}")


def inner(x: Tensor, y: Tensor) -> Tensor:
    """Lorentzian inner product ``<x, y>_L = -x_0 y_0 + x_s . y_s`` (Section 3)."""
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(y.shape)}")
    return -x[..., 0] * y[..., 0] + (x[..., 1:] * y[..., 1:]).sum(-1)


def from_space(xs: Tensor, k: Curvature = 1.0) -> Tensor:
    """Complete space coordinates with the recomputed time ``x_0 = sqrt(k + ||x_s||^2)`` (Section 3)."""
    _sqrt_k(k)
    return torch.cat([torch.sqrt(k + xs.square().sum(-1, keepdim=True)), xs], dim=-1)


def radius(x: Tensor, k: Curvature = 1.0) -> Tensor:
    """Geodesic radius ``sqrt(k) arcosh(x_0 / sqrt(k))``, read from the time coordinate as ambient models do (the
    argument clamped at 1)."""
    sk = _sqrt_k(k)
    return sk * torch.acosh((x[..., 0] / sk).clamp_min(1.0))


def klein(x: Tensor) -> Tensor:
    """Klein coordinates ``chi = x_s / x_0`` (Eq. 8)."""
    return x[..., 1:] / x[..., :1]


def sq_distance(x: Tensor, y: Tensor, k: Curvature = 1.0) -> Tensor:
    """Squared distance ``k arcosh(-<x, y>_L / k)^2``, Eq. 1 (argument clamped at ``1 + 1e-8``)."""
    sk = _sqrt_k(k)
    _check_ambient(x)
    _check_ambient(y, "y")
    arg = (-inner(x, y) / k).clamp_min(1.0 + norm_floor())
    return (sk * torch.acosh(arg)).square()


def distance(x: Tensor, y: Tensor, k: Curvature = 1.0) -> Tensor:
    """Geodesic distance ``sqrt(k) arcosh(-<x, y>_L / k)``, Eq. 1."""
    sk = _sqrt_k(k)
    arg = (-inner(x, y) / k).clamp_min(1.0)
    return sk * torch.acosh(arg)


def pairwise_sq_distance(xq: Tensor, xk: Tensor, k: Curvature = 1.0) -> Tensor:
    """All squared distances ``(..., Nq, n+1) x (..., Nk, n+1) -> (..., Nq, Nk)`` via one matmul."""
    sk = _sqrt_k(k)
    _check_ambient(xq, "xq")
    _check_ambient(xk, "xk")
    return (sk * torch.acosh((pairwise_minus_inner(xq, xk) / k).clamp_min(1.0 + norm_floor()))).square()


def pairwise_minus_inner(xq: Tensor, xk: Tensor, key_times: Tensor | None = None) -> Tensor:
    """All ``-<q_i, k_j>_L = q_0 k_0 - q_s . k_s`` ``(..., Nq, Nk)``: one outer product and one matmul.

    ``key_times (..., Nk)``: the keys' time coordinates ``k_0`` as a tensor of their own (the same values).  A
    compiled kernel loads a contiguous ``k_0`` a vector at a time, where from the points ``(..., Nk, n+1)`` it
    gathers them one by one at the points' stride."""
    times = xk[..., 0] if key_times is None else key_times
    return xq[..., :, None, 0] * times[..., None, :] - xq[..., 1:] @ xk[..., 1:].transpose(-1, -2)


def lorentz_normalize(s: Tensor, k: Curvature = 1.0) -> Tensor:
    """The point ``sqrt(k) s / sqrt(|<s, s>_L|)`` on the hyperboloid through a time-like ``s`` (Eq. 4), the Lorentz
    norm floored at ``1e-8``."""
    return _sqrt_k(k) * s / torch.sqrt(inner(s, s).abs().clamp_min(norm_floor())).unsqueeze(-1)


def lorentz_normalize_backward(s: Tensor, grad: Tensor, k: Curvature = 1.0) -> Tensor:
    """The gradient of :func:`lorentz_normalize` at ``s`` for the output gradient ``grad``: with ``t = <s, s>_L``,
    ``n = sqrt(|t|)`` and ``J s = (-s_0, s_s)``, ``sqrt(k) / n (g - sign(t) (g . s) J s / n^2)`` (the second term
    zero where the norm is floored)."""
    t = inner(s, s)
    n_sq = t.abs().clamp_min(norm_floor())
    coef = torch.where(t.abs() >= norm_floor(), torch.sign(t) * (grad * s).sum(-1) / n_sq, 0.0)
    j_s = torch.cat([-s[..., :1], s[..., 1:]], dim=-1)
    return (_sqrt_k(k) / torch.sqrt(n_sq)).unsqueeze(-1) * (grad - coef.unsqueeze(-1) * j_s)


def acosh_slope(x: Tensor, acosh_x: Tensor) -> Tensor:
    """``arcosh(x) / sqrt(x^2 - 1)`` for ``x >= 1`` from ``acosh_x = arcosh(x)``: the derivative ``2 arcosh(x) /
    sqrt(x^2 - 1)`` of ``arcosh(x)^2`` over 2, ``1`` at ``x = 1`` (its limit)."""
    above = x > 1.0
    safe = torch.where(above, x, 2.0)
    return torch.where(above, acosh_x / torch.sqrt((safe - 1.0) * (safe + 1.0)), 1.0)


def centroid(x: Tensor, weights: Tensor, k: Curvature = 1.0) -> Tensor:
    """Weighted Lorentz centroid, Eq. 4: ``mu = sqrt(k) s / sqrt(|<s, s>_L|)`` with ``s = sum w x``.

    ``x (..., M, n+1)``, ``weights (..., N, M)`` -> ``(..., N, n+1)``.  The Lorentz norm is floored
    at ``1e-8``; a row of zero weights returns the origin.
    """
    sk = _sqrt_k(k)
    _check_ambient(x)
    if weights.shape[-1] != x.shape[-2]:
        raise ValueError(f"weights {tuple(weights.shape)} must end with M={x.shape[-2]}")
    mu = lorentz_normalize(weights @ x, k)
    origin = torch.zeros_like(mu)
    origin[..., 0] = sk
    return torch.where((weights.sum(-1) <= 0).unsqueeze(-1), origin, mu)


def gyroadd(x: Tensor, y: Tensor, k: Curvature = 1.0) -> Tensor:
    """Gyroaddition ``x (+) y``, Eq. 20: ``z = y_s + [x_s.y_s / (sqrt(k)(x_0 + sqrt(k))) + y_0/sqrt(k)] x_s``.

    The time coordinate is recomputed from the space part.
    """
    sk = _sqrt_k(k)
    _check_ambient(x)
    _check_ambient(y, "y")
    xs, ys = x[..., 1:], y[..., 1:]
    coef = (xs * ys).sum(-1) / (sk * (x[..., 0] + sk)) + y[..., 0] / sk
    return from_space(ys + coef.unsqueeze(-1) * xs, k)


def project_grad(x: Tensor, grad: Tensor, k: Curvature = 1.0) -> Tensor:
    """Riemannian gradient: raise ``(-g_0, g_s)`` and project, ``v + <x, v>_L x / k`` (Appendix B.2)."""
    _sqrt_k(k)
    raised = torch.cat([-grad[..., :1], grad[..., 1:]], dim=-1)
    return raised + (inner(x, raised) / k).unsqueeze(-1) * x


def expmap(x: Tensor, xi: Tensor, k: Curvature = 1.0) -> Tensor:
    """``exp_x(xi) = cosh(w) x + sqrt(k) sinh(w) xi / ||xi||_L`` with ``w = ||xi||_L / sqrt(k)``."""
    sk = _sqrt_k(k)
    norm = torch.sqrt(inner(xi, xi).clamp_min(0.0))
    w = (norm / sk).unsqueeze(-1)
    sinhc = torch.where(w > 1e-12, torch.sinh(w) / w.clamp_min(1e-12), torch.ones_like(w))
    return torch.cosh(w) * x + sinhc * xi


def logmap(x: Tensor, y: Tensor, k: Curvature = 1.0) -> Tensor:
    """``log_x(y) = arcosh(alpha) / sqrt(alpha^2 - 1) (y - alpha x)`` with ``alpha = -<x, y>_L / k`` (B.4)."""
    _sqrt_k(k)
    alpha = (-inner(x, y) / k).clamp_min(1.0)
    diff = alpha.square() - 1.0
    close = diff < 1e-12
    factor = torch.where(
        close, torch.ones_like(alpha), torch.acosh(alpha) / torch.sqrt(torch.where(close, torch.ones_like(diff), diff))
    )
    return factor.unsqueeze(-1) * (y - alpha.unsqueeze(-1) * x)


def transport(x: Tensor, y: Tensor, xi: Tensor, k: Curvature = 1.0) -> Tensor:
    """Parallel transport ``xi + <y, xi>_L (x + y) / (k - <x, y>_L)`` (B.5)."""
    _sqrt_k(k)
    coef = inner(y, xi) / (k - inner(x, y))
    return xi + coef.unsqueeze(-1) * (x + y)


def busemann_nu(x: Tensor, ideal_axis: int) -> Tensor:
    """Busemann coordinate ``nu = x_0 - x_1`` (Eq. 10); ``ideal_axis`` indexes space coordinates."""
    _check_axis(ideal_axis, x.shape[-1] - 1, "ideal_axis")
    return x[..., 0] - x[..., 1 + ideal_axis]


def horoshift(x: Tensor, t: Tensor | float, ideal_axis: int, shift_axis: int, k: Curvature = 1.0) -> Tensor:
    """Horospherical shift, Eq. 10 as written: ``x_2 += t nu``, ``x_0, x_1 += t x_2 + t^2 nu / 2``."""
    _sqrt_k(k)
    _check_axis(shift_axis, x.shape[-1] - 1, "shift_axis")
    if ideal_axis == shift_axis:
        raise ValueError("ideal_axis and shift_axis must be different space axes")
    nu = busemann_nu(x, ideal_axis)
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    i1, i2 = 1 + ideal_axis, 1 + shift_axis
    x2 = x[..., i2]
    lift = t * x2 + 0.5 * t.square() * nu
    out = x.clone()
    out[..., 0] = x[..., 0] + lift
    out[..., i1] = x[..., i1] + lift
    out[..., i2] = x2 + t * nu
    return out


def tangent_from_polar(r: Tensor, u: Tensor, xi_r: Tensor, xi_perp: Tensor, k: Curvature = 1.0) -> Tensor:
    """Ambient tangent vector ``xi_r e_r + (0, xi_perp)`` with ``e_r = (sinh a, cosh a u)`` (Eq. 13)."""
    sk = _sqrt_k(k)
    a = r / sk
    xi0 = xi_r * torch.sinh(a)
    xis = (xi_r * torch.cosh(a)).unsqueeze(-1) * u + xi_perp
    return torch.cat([xi0.expand(xis.shape[:-1]).unsqueeze(-1), xis], dim=-1)


def tangent_to_polar(r: Tensor, u: Tensor, xi: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Polar-frame components of an ambient tangent vector, Eq. 13: ``xi_r = (u . xi_s) / cosh a``."""
    sk = _sqrt_k(k)
    radial = (u * xi[..., 1:]).sum(-1)
    return radial / torch.cosh(r / sk), xi[..., 1:] - radial.unsqueeze(-1) * u


def boost(x: Tensor, t: Tensor | float, axis: int, k: Curvature = 1.0) -> Tensor:
    """Lorentz boost of rapidity ``t`` along space axis ``axis``: ``(x_0, x_i)`` mixed by ``cosh t, sinh t``."""
    _sqrt_k(k)
    _check_axis(axis, x.shape[-1] - 1, "axis")
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    x0, xi = x[..., 0], x[..., 1 + axis]
    out = x.clone()
    out[..., 0] = torch.cosh(t) * x0 + torch.sinh(t) * xi
    out[..., 1 + axis] = torch.sinh(t) * x0 + torch.cosh(t) * xi
    return out


def rotate(x: Tensor, t: Tensor | float, axis_a: int, axis_b: int) -> Tensor:
    """Rotation by ``t`` in the plane of space axes ``(axis_a, axis_b)``; the time coordinate is kept."""
    _check_axis(axis_a, x.shape[-1] - 1, "axis_a")
    _check_axis(axis_b, x.shape[-1] - 1, "axis_b")
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    ia, ib = 1 + axis_a, 1 + axis_b
    xa, xb = x[..., ia], x[..., ib]
    out = x.clone()
    out[..., ia] = torch.cos(t) * xa - torch.sin(t) * xb
    out[..., ib] = torch.sin(t) * xa + torch.cos(t) * xb
    return out


def direct_concat(x: Tensor, k: Curvature = 1.0) -> Tensor:
    """Lorentz direct concatenation ``(..., H, d+1) -> (..., H d + 1)``: concatenate space parts, recompute time."""
    return from_space(x[..., 1:].flatten(-2), k)


def _origin(like: Tensor, k: Curvature) -> Tensor:
    """The origin ``(sqrt(k), 0, ..., 0)`` shaped like ``like``."""
    out = torch.zeros_like(like)
    out[..., 0] = _sqrt_k(k)
    return out


def log_origin(x: Tensor, k: Curvature = 1.0) -> Tensor:
    """Space part of ``log_o(x)`` (:func:`logmap` at the origin): norm = the geodesic radius."""
    return logmap(_origin(x, k), x, k)[..., 1:]


def exp_origin(v: Tensor, k: Curvature = 1.0) -> Tensor:
    """``exp_o`` of the tangent vector with space part ``v`` (:func:`expmap` at the origin)."""
    xi = torch.cat([torch.zeros_like(v[..., :1]), v], dim=-1)
    return expmap(_origin(xi, k), xi, k)


def beta_concat(x: Tensor, k: Curvature = 1.0) -> Tensor:
    """HNN++ beta-concatenation ``(..., H, d+1) -> (..., H d + 1)``:
    ``exp_o(beta_{Hd} / beta_d concat_h log_o(x_h))``."""
    heads, dim = x.shape[-2], x.shape[-1] - 1
    ratio = beta_coefficient(heads * dim) / beta_coefficient(dim)
    return exp_origin(ratio * log_origin(x, k).flatten(-2), k)


def beta_split(x: Tensor, heads: int, k: Curvature = 1.0) -> Tensor:
    """HNN++ beta-split ``(..., n+1) -> (..., H, n/H + 1)``: ``exp_o(beta_d/beta_n log_o(x)_h)``."""
    v = log_origin(x, k).unflatten(-1, (heads, -1))
    return exp_origin(beta_coefficient(v.shape[-1]) / beta_coefficient(x.shape[-1] - 1) * v, k)
