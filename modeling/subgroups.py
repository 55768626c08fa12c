"""The one-parameter subgroups of the Lorentz group used as relative positional encodings (Sec. 4.3): the
horospherical shift (Eq. 10, 11; Appendix C), Lorentz boosts (HoPE) and rotations (HOPE, HELM), in polar form.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and sibling modules.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .stable_math import asinh_nonneg, safe_norm, safe_normalize
from .validation import Curvature, _check_axis, _check_point, _sqrt_k

__all__ = ["boost", "busemann_nu", "horoshift", "rotate"]


# --------------------------------------------------------------------------------------------
# horospherical shift (Eq. 10, 11; Appendix C)
# --------------------------------------------------------------------------------------------
def _axis_mask(n: int, axis: int, like: Tensor) -> Tensor:
    mask = torch.ones(n, dtype=like.dtype, device=like.device)
    mask[axis] = 0.0
    return mask


def busemann_nu(r: Tensor, u: Tensor, ideal_axis: int, k: Curvature = 1.0) -> Tensor:
    """Busemann coordinate ``nu = x_0 - x_1`` towards the ideal point ``e_0 + e_1`` (Eq. 10).

    Polar form (Sec. 4.3): ``nu = sqrt(k) (e^{-a} + sinh a (1 - u_1))`` with
    ``1 - u_1 = ||u_rest||^2 / (1 + u_1)`` for ``u_1 >= 0``, a sum of non-negative terms.
    ``ideal_axis`` indexes the space coordinates (0-based); ``-ln(nu / sqrt(k))`` is the Busemann
    function (Appendix C.1).
    """
    sk = _sqrt_k(k)
    _check_point(r, u, "")
    _check_axis(ideal_axis, u.shape[-1], "ideal_axis")
    a = r / sk
    u1 = u[..., ideal_axis]
    rest_sq = (u * _axis_mask(u.shape[-1], ideal_axis, u)).square().sum(-1)
    one_minus_u1 = torch.where(u1 >= 0, rest_sq / (1.0 + u1.abs()), 1.0 - u1)
    return sk * (torch.exp(-a) + torch.sinh(a) * one_minus_u1)


def horoshift(
    r: Tensor,
    u: Tensor,
    t: Tensor | float,
    ideal_axis: int,
    shift_axis: int,
    k: Curvature = 1.0,
) -> tuple[Tensor, Tensor]:
    """Horospherical shift ``Phi(t)`` (Eq. 10, closed form Eq. 23) in polar form.

    Ambient form: ``x_2 += t nu``, ``x_0 += t x_2 + t^2 nu / 2``, ``x_1 += t x_2 + t^2 nu / 2`` with
    ``nu = x_0 - x_1`` invariant.  Here the shifted point is formed from sums of non-negative
    terms: the coordinates other than ``x_1`` are ``x_rest`` with ``x_2 + t nu``; ``nu`` is kept, and
    ``(x_0 + x_1) nu = k + ||x_rest||^2`` gives ``x_1 = ((k + ||x_rest||^2) / nu - nu) / 2``.  The
    radius is ``sqrt(k) arsinh(||x_s|| / sqrt(k))``.  ``ideal_axis`` (``e_1``) and ``shift_axis``
    (``e_2``) index the space coordinates, 0-based.  Distance law: Eq. 11.
    """
    sk = _sqrt_k(k)
    n = u.shape[-1]
    _check_axis(shift_axis, n, "shift_axis")
    if ideal_axis == shift_axis:
        raise ValueError("ideal_axis and shift_axis must be different space axes")
    nu = busemann_nu(r, u, ideal_axis, k)
    t = torch.as_tensor(t, dtype=r.dtype, device=r.device)
    xs = (sk * torch.sinh(r / sk)).unsqueeze(-1) * u
    shift = torch.zeros(n, dtype=u.dtype, device=u.device)
    shift[shift_axis] = 1.0
    rest = xs * _axis_mask(n, ideal_axis, u) + (t * nu).unsqueeze(-1) * shift
    x1 = 0.5 * ((k + rest.square().sum(-1)) / nu - nu)
    e1 = torch.zeros(n, dtype=u.dtype, device=u.device)
    e1[ideal_axis] = 1.0
    xs_new = rest + x1.unsqueeze(-1) * e1
    return sk * asinh_nonneg(safe_norm(xs_new) / sk), safe_normalize(xs_new)


# --------------------------------------------------------------------------------------------
# the other one-parameter subgroups used as positional encodings (Sec. 4.3)
# --------------------------------------------------------------------------------------------
def boost(r: Tensor, u: Tensor, t: Tensor | float, axis: int, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Lorentz boost of rapidity ``t`` along space axis ``axis`` (HoPE on Lorentz points, Sec. 4.3).

    ``x_0 -> cosh t x_0 + sinh t x_i``, ``x_i -> sinh t x_0 + cosh t x_i``; in polar form only the
    space coordinate ``x_i / sqrt(k) = sinh t cosh a + cosh t sinh a u_i`` changes and the radius is
    read from the space part.
    """
    sk = _sqrt_k(k)
    _check_point(r, u, "")
    _check_axis(axis, u.shape[-1], "axis")
    t = torch.as_tensor(t, dtype=r.dtype, device=r.device)
    a = r / sk
    xs = torch.sinh(a).unsqueeze(-1) * u
    new_i = torch.sinh(t) * torch.cosh(a) + torch.cosh(t) * xs[..., axis]
    e_i = torch.zeros(u.shape[-1], dtype=u.dtype, device=u.device)
    e_i[axis] = 1.0
    xs = xs * (1.0 - e_i) + new_i.unsqueeze(-1) * e_i
    return sk * asinh_nonneg(safe_norm(xs)), safe_normalize(xs)


def rotate(r: Tensor, u: Tensor, t: Tensor | float, axis_a: int, axis_b: int) -> tuple[Tensor, Tensor]:
    """Rotation by angle ``t`` in the plane of space axes ``(axis_a, axis_b)`` (HOPE / HELM, Sec. 4.3).

    Rotations act on the direction only; the radius is unchanged (exact in polar form).
    """
    _check_point(r, u, "")
    _check_axis(axis_a, u.shape[-1], "axis_a")
    _check_axis(axis_b, u.shape[-1], "axis_b")
    t = torch.as_tensor(t, dtype=u.dtype, device=u.device)
    cos, sin = torch.cos(t), torch.sin(t)
    ua, ub = u[..., axis_a], u[..., axis_b]
    new_a, new_b = cos * ua - sin * ub, sin * ua + cos * ub
    e_a = torch.zeros(u.shape[-1], dtype=u.dtype, device=u.device)
    e_b = torch.zeros_like(e_a)
    e_a[axis_a], e_b[axis_b] = 1.0, 1.0
    u = u * (1.0 - e_a - e_b) + new_a.unsqueeze(-1) * e_a + new_b.unsqueeze(-1) * e_b
    return r, u
