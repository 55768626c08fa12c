"""Polar-form Lorentz geometry: the numerically exact core of Polar-ViT.

A point of the Lorentz model ``L^n_k`` (curvature ``-1/k``, ``k > 0``) is stored in polar form as
a pair ``(r, u)``: the geodesic radius ``r`` of shape ``(...)`` and a unit direction ``u`` of shape
``(..., n)``.  ``a = r / sqrt(k)`` is the rescaled radius, and the ambient coordinates are
``x = (sqrt(k) cosh a, sqrt(k) sinh a u)`` (paper Eq. 2).

Every operation below is written as a sum of non-negative terms (paper Section 3.2), so that the
large ambient quantities ``cosh a`` and ``sinh a`` never cancel against each other; the angular
term is always the chord ``1/2 ||u - v||^2`` and never ``1 - u.v`` (Appendix D.1).  The results
are accurate to the resolution limit of the stored points (Proposition 2) up to ``a ~ 44`` in
float32 (``a ~ 88`` for the operations that form only one hyperbolic function of an input).

Equation numbers refer to "Rethinking the Fully Hyperbolic Vision Transformer in Polar
Coordinates" (Bdeir & Landwehr).  The ambient twins of these operations, the baseline the paper
compares against, live in :mod:`ambient`.

The scalar functions every one of them relies on (the non-negative ``asinh``, ``arsinh(e^l)``, the series
cut-offs, ``perp``, the unit-or-origin normalisation) live in :mod:`stable_math` and are re-exported here.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and sibling modules.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .stable_math import (
    asinh_exp,
    asinh_nonneg,
    asinhc_half,
    cosh_sinhc_sq,
    perp,
    safe_norm,
    safe_normalize,
    safe_sqrt,
    scaled_sinh_cosh,
)
from .subgroups import boost, busemann_nu, horoshift, rotate
from .validation import (
    Curvature,
    _check_finite,
    _check_point,
    _check_same_dim,
    _sqrt_k,
    input_checks,
    set_input_checks,
)

__all__ = [
    "asinh_exp",
    "asinhc_half",
    "beta_coefficient",
    "beta_concat",
    "beta_split",
    "boost",
    "busemann_nu",
    "centroid",
    "centroid_log_sinh",
    "centroid_radius",
    "chord",
    "cosh_sinhc_sq",
    "distance",
    "direct_concat",
    "expmap",
    "from_ambient",
    "from_space",
    "gyroadd",
    "gyroadd_space",
    "gyrocenter",
    "gyroneg",
    "haversine",
    "haversine_from_chord",
    "horoshift",
    "input_checks",
    "logmap",
    "pairwise_chord",
    "pairwise_sq_distance",
    "perp",
    "project_grad",
    "rotate",
    "safe_normalize",
    "set_input_checks",
    "space",
    "sq_distance",
    "sq_distance_from_c",
    "tangent_inner",
    "to_ambient",
    "transport",
]


# --------------------------------------------------------------------------------------------
# scalar helpers
# --------------------------------------------------------------------------------------------
def sq_distance_from_c(c: Tensor, k: Curvature) -> Tensor:
    """``d^2 = k (2 asinh(sqrt(c/2)))^2 = 2 k c (asinh(s)/s)^2`` (Eq. 5 with ``cosh D - 1 = c``)."""
    return (2.0 * k) * c * asinhc_half(c).square()


def _dist_from_c(c: Tensor, sqrt_k: Curvature) -> Tensor:
    """``d = 2 sqrt(k) asinh(sqrt(c/2))``; zero gradient (a subgradient) at ``c = 0``."""
    positive = c > 0
    c_safe = torch.where(positive, c, torch.ones_like(c))
    d = 2.0 * sqrt_k * asinh_nonneg(torch.sqrt(0.5 * c_safe))
    return torch.where(positive, d, torch.zeros_like(d))


# --------------------------------------------------------------------------------------------
# coordinates
# --------------------------------------------------------------------------------------------
def to_ambient(r: Tensor, u: Tensor, k: Curvature = 1.0) -> Tensor:
    """Polar to ambient coordinates, Eq. 2: ``x = (sqrt(k) cosh a, sqrt(k) sinh a u)``.

    Shapes: ``r (...)``, ``u (..., n)`` -> ``x (..., n+1)``.
    """
    sk = _sqrt_k(k)
    _check_point(r, u, "")
    a = r / sk
    xs = (sk * torch.sinh(a)).unsqueeze(-1) * u
    x0 = (sk * torch.cosh(a)).expand(xs.shape[:-1])
    return torch.cat([x0.unsqueeze(-1), xs], dim=-1)


def from_ambient(x: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Ambient to polar coordinates (below Eq. 2): ``r = sqrt(k) arsinh(||x_s|| / sqrt(k))``.

    Only the space part ``x_s = x[..., 1:]`` is read, so the time coordinate's rounding error
    never enters; ``u = x_s / ||x_s||`` (``e_0`` at the origin).  ``x (..., n+1)`` ->
    ``(r (...), u (..., n))``.
    """
    sk = _sqrt_k(k)
    if x.dim() < 1 or x.shape[-1] < 2:
        raise ValueError(f"ambient points need at least 2 coordinates, got shape {tuple(x.shape)}")
    _check_finite(x=x)
    xs = x[..., 1:]
    return sk * asinh_nonneg(safe_norm(xs) / sk), safe_normalize(xs)


def from_space(xs: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Polar form of the point with space coordinates ``x_s`` (time from ``<x, x>_L = -k``).

    ``r = sqrt(k) arsinh(||x_s|| / sqrt(k))``, ``u = x_s / ||x_s||``.  Manifold-valued parameters are
    stored as space coordinates: a plain tensor that survives ``from_pretrained`` and stores the
    radius and the direction to relative precision at every radius.
    """
    sk = _sqrt_k(k)
    return sk * asinh_nonneg(safe_norm(xs) / sk), safe_normalize(xs)


def space(r: Tensor, u: Tensor, k: Curvature = 1.0) -> Tensor:
    """Space coordinates ``x_s = sqrt(k) sinh(a) u`` of a polar point (Eq. 2)."""
    sk = _sqrt_k(k)
    return (sk * torch.sinh(r / sk)).unsqueeze(-1) * u


def direct_concat(r: Tensor, u: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Lorentz direct concatenation of ``H`` points of ``L^d`` into one point of ``L^{H d}`` (Sec. 4.2).

    The space parts are concatenated and the time coordinate follows from the constraint, so
    ``sinh a = sqrt(sum_h sinh^2 a_h)`` and ``u = concat_h(sinh a_h u_h) / sinh a``; evaluated with the
    largest radius factored out so nothing overflows.  ``r (..., H)``, ``u (..., H, d)`` ->
    ``(..., )``, ``(..., H d)``.
    """
    sk = _sqrt_k(k)
    a = r / sk
    top = a.amax(-1, keepdim=True).detach()
    parts = scaled_sinh_cosh(a, top)[0].unsqueeze(-1) * u  # (sinh a_h u_h) e^{-top}, (..., H, d)
    norm = concat_norm(parts)
    positive = norm > 0
    log_sinh = top.squeeze(-1) + torch.log(torch.where(positive, norm, torch.ones_like(norm)))
    radius = torch.where(positive, asinh_exp(log_sinh), torch.zeros_like(norm))
    return sk * radius, safe_normalize(parts.flatten(-2), norm)


def concat_norm(parts: Tensor) -> Tensor:
    """``||concat_h(v_h)||`` of ``parts (..., H, d)`` with a zero subgradient at 0: summed over each head's
    coordinates, then over the heads, so a compiled kernel loops over contiguous coordinates (over the flattened
    ``H d`` coordinates of the heads' strided view inductor emits scalar code with an integer division per
    element)."""
    return safe_sqrt(parts.square().sum(-1).sum(-1))


def beta_coefficient(n: int) -> float:
    """HNN++'s ``beta_n = B(n/2, 1/2)`` (Shimizu et al. 2021, Sec. 3.3): the expected-norm scale of ``n``
    coordinates."""
    return math.exp(math.lgamma(n / 2) + math.lgamma(0.5) - math.lgamma((n + 1) / 2))


def beta_concat(r: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """HNN++ Poincare beta-concatenation of ``H`` points of ``L^d`` into one point of ``L^{H d}``, in polar form.

    HNN++ maps each input to the tangent space at the origin, ``v_h = log_0(x_h)`` (in the Poincare
    ball ``||x_h|| = sqrt(k) tanh(r_h / (2 sqrt(k)))`` and ``||v_h|| = r_h / 2``), scales it by
    ``beta_{Hd} / beta_d``, concatenates and maps back with ``exp_0`` (radius ``2 ||v||``).  In
    polar form that round trip is exact and curvature-free:

        ``R = (beta_{Hd} / beta_d) sqrt(sum_h r_h^2)``,   ``U = concat_h(r_h u_h) / sqrt(sum_h r_h^2)``

    (no ball coordinate near 1, no large ambient coordinate).  ``r (..., H)``, ``u (..., H, d)`` ->
    ``(...)``, ``(..., H d)``; all radii 0 gives the origin (direction ``e_0``, zero gradient).
    """
    heads, dim = u.shape[-2], u.shape[-1]
    parts = (r.unsqueeze(-1) * u).flatten(-2)
    return beta_coefficient(heads * dim) / beta_coefficient(dim) * safe_norm(parts), safe_normalize(parts)


def beta_split(r: Tensor, u: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """HNN++ Poincare beta-split of a point of ``L^n`` into ``heads`` points of ``L^{n/heads}``, in polar form.

    The inverse of :func:`beta_concat`: the tangent vector ``r u`` at the origin is cut into
    ``heads`` chunks ``r u_h``, each scaled by ``beta_d / beta_n`` and mapped back:
    ``r_h = (beta_d / beta_n) r ||u_h||``, direction ``u_h / ||u_h||`` (``e_0`` for an empty chunk).
    ``r (...)``, ``u (..., n)`` -> ``(..., H)``, ``(..., H, n/H)``.
    """
    chunks = u.unflatten(-1, (heads, u.shape[-1] // heads))
    ratio = beta_coefficient(chunks.shape[-1]) / beta_coefficient(u.shape[-1])
    return ratio * r.unsqueeze(-1) * safe_norm(chunks), safe_normalize(chunks)


# --------------------------------------------------------------------------------------------
# distances
# --------------------------------------------------------------------------------------------
def chord(u: Tensor, v: Tensor) -> Tensor:
    """Elementwise chord ``1/2 ||u - v||^2 = 1 - cos(theta)`` for unit vectors (Appendix B)."""
    return 0.5 * (u - v).square().sum(-1)


class _PairwiseChord(torch.autograd.Function):
    """``C[..., i, j] = 1/2 ||u_i - v_j||^2`` with the closed-form backward of Eq. 25.

    The forward pass evaluates the exact differences ``u_i - v_j`` (``torch.cdist`` without its
    matrix-product shortcut; never ``1 - u.v``) and keeps none of them; the backward pass is

        dJ/du_i = (u_i - vbar) sum_j g_ij - sum_j g_ij (v_j - vbar)
        dJ/dv_j = (v_j - vbar) sum_i g_ij - sum_i g_ij (u_i - vbar)

    centred on the mean key direction ``vbar`` (Eq. 25): one row sum and one matrix product, and
    no tensor with ``N * M * n`` elements is saved.  The backward is made of differentiable operators (second
    derivatives by autograd), and forward, ``setup_context`` and backward of transformable ones (``torch.func``:
    ``grad``, ``vmap`` with the generated batching rule).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(u: Tensor, v: Tensor) -> Tensor:  # noqa: D102
        batch = torch.broadcast_shapes(u.shape[:-2], v.shape[:-2])
        ue = u.expand(*batch, *u.shape[-2:])
        ve = v.expand(*batch, *v.shape[-2:])
        if torch.compiler.is_exporting():  # exported graphs: the same differences as broadcasts (ONNX has no cdist)
            return chord(ue.unsqueeze(-2), ve.unsqueeze(-3))
        # cdist's difference form: ||u_i - v_j|| from the exact differences, fused, nothing stored
        dist = torch.cdist(ue, ve, compute_mode="donot_use_mm_for_euclid_dist")
        return 0.5 * dist.square()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:  # noqa: D102
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        u, v = ctx.saved_tensors
        vbar = v.mean(dim=-2, keepdim=True)
        p, q = u - vbar, v - vbar
        grad_u = p * grad.sum(-1, keepdim=True) - grad @ q
        grad_v = q * grad.sum(-2).unsqueeze(-1) - grad.transpose(-1, -2) @ p
        return _sum_to_shape(grad_u, u.shape), _sum_to_shape(grad_v, v.shape)


def _sum_to_shape(t: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    if t.shape == shape:
        return t
    lead = t.dim() - len(shape)
    t = t.sum(dim=tuple(range(lead))) if lead > 0 else t
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


def pairwise_chord(u: Tensor, v: Tensor) -> Tensor:
    """Pairwise chords ``1/2 ||u_i - v_j||^2``: ``u (..., N, n)``, ``v (..., M, n)`` -> ``(..., N, M)``.

    Exact difference form in the forward pass, closed-form centred gradient (Eq. 25) in the
    backward pass; nothing of size ``N * M * n`` is kept for backward.
    """
    if u.dim() < 2 or v.dim() < 2:
        raise ValueError("pairwise_chord needs directions of shape (..., N, n) and (..., M, n)")
    _check_same_dim(u, v)
    return _PairwiseChord.apply(u, v)


def haversine_from_chord(a: Tensor, b: Tensor, chords: Tensor) -> Tensor:
    """The law of haversines, Eq. 5: ``c = cosh D - 1 = 2 sinh^2((a - b)/2) + sinh a sinh b chord``.

    Radii ``a, b`` divided by ``sqrt(k)`` (broadcasting), ``chords = 1/2 ||u - v||^2``; a sum of
    non-negative terms.
    """
    return 2.0 * torch.sinh(0.5 * (a - b)).square() + torch.sinh(a) * torch.sinh(b) * chords


def haversine(r1: Tensor, u1: Tensor, r2: Tensor, u2: Tensor, k: Curvature = 1.0) -> Tensor:
    """Hyperbolic law of haversines, Eq. 5: ``c = cosh(d/sqrt(k)) - 1`` of two points (elementwise)."""
    sk = _sqrt_k(k)
    _check_point(r1, u1, "1")
    _check_point(r2, u2, "2")
    _check_same_dim(u1, u2)
    return haversine_from_chord(r1 / sk, r2 / sk, chord(u1, u2))


def sq_distance(r1: Tensor, u1: Tensor, r2: Tensor, u2: Tensor, k: Curvature = 1.0) -> Tensor:
    """Squared geodesic distance, Eq. 5: ``d^2 = k arcosh(1 + c)^2`` with ``c`` from the haversine law.

    Elementwise with broadcasting; smooth everywhere, including for coincident points and at
    ``r = 0``.
    """
    return sq_distance_from_c(haversine(r1, u1, r2, u2, k), k)


def distance(r1: Tensor, u1: Tensor, r2: Tensor, u2: Tensor, k: Curvature = 1.0) -> Tensor:
    """Geodesic distance, Eq. 1 via Eq. 5: ``d = 2 sqrt(k) arsinh(sqrt(c / 2))``."""
    return _dist_from_c(haversine(r1, u1, r2, u2, k), _sqrt_k(k))


def pairwise_sq_distance(rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, k: Curvature = 1.0) -> Tensor:
    """All squared distances between queries and keys, Eq. 5 with the chord gradient of Eq. 25.

    Shapes: ``rq (..., Nq)``, ``uq (..., Nq, n)``, ``rk (..., Nk)``, ``uk (..., Nk, n)`` ->
    ``(..., Nq, Nk)``.  The backward pass keeps no ``(Nq, Nk, n)`` tensor.
    """
    sk = _sqrt_k(k)
    _check_point(rq, uq, "q")
    _check_point(rk, uk, "k")
    if uq.dim() < 2 or uk.dim() < 2:
        raise ValueError("pairwise_sq_distance needs uq (..., Nq, n) and uk (..., Nk, n)")
    c = haversine_from_chord((rq / sk).unsqueeze(-1), (rk / sk).unsqueeze(-2), pairwise_chord(uq, uk))
    return sq_distance_from_c(c, k)


# --------------------------------------------------------------------------------------------
# centroid
# --------------------------------------------------------------------------------------------
def centroid_log_sinh(big_t: Tensor, big_e: Tensor, big_s: Tensor, v_norm: Tensor) -> Tensor:
    """``ln sinh a_mu = ln ||V|| - 1/2 ln(E + S) - 1/2 ln(T + ||V||)`` (Eq. 22); ``-inf`` where ``V = 0``."""
    return torch.log(v_norm) - 0.5 * torch.log(big_e + big_s) - 0.5 * torch.log(big_t + v_norm)


def centroid_radius(big_t: Tensor, big_e: Tensor, big_s: Tensor, v_norm: Tensor, degenerate: Tensor) -> Tensor:
    """The centroid radius ``a_mu`` (divided by ``sqrt(k)``) of Eq. 22 from the weighted sums; 0 (the origin, with
    zero gradients) where ``degenerate``."""
    v_safe = torch.where(degenerate, torch.ones_like(v_norm), v_norm)
    log_sinh = centroid_log_sinh(big_t, big_e, big_s, v_safe)
    return torch.where(degenerate, torch.zeros_like(log_sinh), asinh_exp(log_sinh))


def centroid(r: Tensor, u: Tensor, weights: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Weighted Lorentz centroid (Eq. 4) in polar form, Eq. 6, 7 and the log-domain radius Eq. 22.

    With ``T = sum w cosh a``, ``V = sum w sinh a u``, ``u_hat = V/||V||``, ``E = sum w e^{-a}`` and
    ``S = sum w sinh a * 1/2 ||u - u_hat||^2`` (so that ``T - ||V|| = E + S``, Eq. 6):

        ln sinh a_mu = ln ||V|| - 1/2 ln(E + S) - 1/2 ln(T + ||V||)          (Eq. 22)

    and the direction is ``u_hat``.  Shapes: ``r (..., M)``, ``u (..., M, n)``,
    ``weights (..., N, M)`` (non-negative, need not be normalised) -> ``(..., N)``, ``(..., N, n)``.
    A row of all-zero weights (or a weighted sum with ``V = 0``) returns the origin with finite
    (zero) gradients.  ``S`` is stationary in ``u_hat``, so the rounding of ``u_hat`` enters it only
    to second order.
    """
    sk = _sqrt_k(k)
    _check_point(r, u, "")
    if u.dim() < 2 or weights.dim() < 2 or r.dim() < 1:
        raise ValueError("centroid needs r (..., M), u (..., M, n) and weights (..., N, M)")
    if weights.shape[-1] != u.shape[-2] or r.shape[-1] != u.shape[-2]:
        raise ValueError(
            f"shape mismatch: weights {tuple(weights.shape)} must end with M={u.shape[-2]} "
            f"points as r {tuple(r.shape)} and u {tuple(u.shape)} do"
        )
    _check_finite(weights=weights)
    a = r / sk
    empty_row = weights.sum(-1) <= 0
    w = torch.where(empty_row.unsqueeze(-1), torch.ones_like(weights), weights)
    sh = torch.sinh(a)
    w_sinh = w * sh.unsqueeze(-2)  # (..., N, M)
    big_t = (w * torch.cosh(a).unsqueeze(-2)).sum(-1)
    big_e = (w * torch.exp(-a).unsqueeze(-2)).sum(-1)
    big_v = w_sinh @ u  # (..., N, n)
    v_norm = safe_norm(big_v)
    u_hat = safe_normalize(big_v)
    big_s = (w_sinh * pairwise_chord(u_hat, u)).sum(-1)
    a_mu = centroid_radius(big_t, big_e, big_s, v_norm, empty_row | (v_norm <= 0))
    return sk * a_mu, u_hat


# --------------------------------------------------------------------------------------------
# gyrovector operations
# --------------------------------------------------------------------------------------------
def gyroneg(r: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Gyro inverse ``(-)x = (r, -u)``."""
    return r, -u


def gyroadd(r1: Tensor, u1: Tensor, r2: Tensor, u2: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Gyroaddition ``x (+) y``, the boost that carries the origin to ``x`` applied to ``y`` (Eq. 20).

    In polar form, with ``x = (a, u)``, ``y = (b, v)`` and ``cos = u.v``, the space part divided by
    ``sqrt(k)`` is ``z = z_par u + sinh b (v - (v.u) u)`` with

        z_par = sinh a cosh b + cosh a sinh b cos                    (cos >= 0, all terms >= 0)
        z_par = sinh(a - b) + cosh a sinh b * 1/2 ||u + v||^2        (cos <  0, Eq. 21)

    so the cancellation of Eq. 20 for opposite directions (e.g. the centring ``(-)xbar (+) x``)
    is never formed.  Returns ``(sqrt(k) arsinh ||z||, z / ||z||)``.
    """
    sk = _sqrt_k(k)
    _check_point(r1, u1, "1")
    _check_point(r2, u2, "2")
    _check_same_dim(u1, u2)
    a, b = r1 / sk, r2 / sk
    v_perp, sign, half_gap = perp(u2, u1)  # half_gap = 1 - sign * cos
    sinh_a, cosh_a, sinh_b = torch.sinh(a), torch.cosh(a), torch.sinh(b)
    aligned = sinh_a * torch.cosh(b) + cosh_a * sinh_b * (1.0 - half_gap)
    opposite = torch.sinh(a - b) + cosh_a * sinh_b * half_gap
    z_par = torch.where(sign > 0, aligned, opposite)
    z = z_par.unsqueeze(-1) * u1 + sinh_b.unsqueeze(-1) * v_perp
    return sk * asinh_nonneg(safe_norm(z)), safe_normalize(z)


def gyrocenter(r_center: Tensor, u_center: Tensor, r: Tensor, u: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """The centring ``((-)xbar) (+) x`` of gyro normalisation (Sec. 4.4), accurate via Eq. 21."""
    return gyroadd(r_center, -u_center, r, u, k)


def gyroadd_space(xs: Tensor, r: Tensor, u: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """``x (+) y`` with ``x`` given by its space coordinates, smooth at ``x = o`` (Eq. 20, 21).

    Used for learned bias points (initialised at the origin).  For ``||x_s|| <= sqrt(k)`` Eq. 20
    is evaluated directly, ``z / sqrt(k) = sinh b v + [(X.v) sinh b / (sqrt(1 + |X|^2) + 1) + cosh b] X``
    with ``X = x_s / sqrt(k)``: the two terms of the bracket cannot cancel there (the first is at
    most half the second), and its Jacobian at ``x = o`` is ``cosh b`` (Sec. B.6).  Beyond, the
    polar :func:`gyroadd` (Eq. 21) is used.
    """
    sk = _sqrt_k(k)
    big_x = xs / sk
    x_sq = big_x.square().sum(-1)
    near = x_sq <= 1.0
    b = r / sk
    sinh_b = torch.sinh(b)
    coef = (big_x * u).sum(-1) * sinh_b / (torch.sqrt(1.0 + x_sq) + 1.0) + torch.cosh(b)
    z = sinh_b.unsqueeze(-1) * u + coef.unsqueeze(-1) * big_x
    r_near, u_near = sk * asinh_nonneg(safe_norm(z)), safe_normalize(z)
    far_x = torch.where(near.unsqueeze(-1), torch.ones_like(big_x), big_x)
    r_far, u_far = gyroadd(*from_space(far_x * sk, k), r, u, k)
    return torch.where(near, r_near, r_far), torch.where(near.unsqueeze(-1), u_near, u_far)


# --------------------------------------------------------------------------------------------
# tangent vectors in the polar frame (Appendix B.1-B.5)
# --------------------------------------------------------------------------------------------
def tangent_inner(xi_r: Tensor, xi_perp: Tensor, zeta_r: Tensor, zeta_perp: Tensor) -> Tensor:
    """Lorentzian inner product of two tangent vectors at the same point, Eq. 14.

    In the polar frame ``xi = xi_r e_r + (0, xi_perp)`` it is the plain sum
    ``xi_r zeta_r + xi_perp . zeta_perp`` (a sum of squares for ``xi = zeta``).
    """
    _check_same_dim(xi_perp, zeta_perp, "perpendicular components")
    return xi_r * zeta_r + (xi_perp * zeta_perp).sum(-1)


def project_grad(
    r: Tensor, u: Tensor, grad_time: Tensor, grad_space: Tensor, k: Curvature = 1.0
) -> tuple[Tensor, Tensor]:
    """Riemannian gradient in the polar frame from a Euclidean ambient gradient, Eq. 15.

    ``xi_r = g_0 sinh a + (g_s . u) cosh a`` and ``xi_perp = g_s - (g_s . u) u``: no division and
    no difference of large terms.  ``grad_time`` has shape ``(...)`` (use zeros when the loss reads
    only space coordinates, as every polar operation does), ``grad_space (..., n)``.
    """
    sk = _sqrt_k(k)
    _check_point(r, u, "")
    _check_same_dim(u, grad_space, "u and grad_space")
    a = r / sk
    radial = (grad_space * u).sum(-1)
    xi_r = grad_time * torch.sinh(a) + radial * torch.cosh(a)
    return xi_r, grad_space - radial.unsqueeze(-1) * u


def expmap(r: Tensor, u: Tensor, xi_r: Tensor, xi_perp: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Exponential map ``exp_x(xi)`` in the polar frame, Eq. 16-18.

    With ``w_r = xi_r / sqrt(k)``, ``w^2 = w_r^2 + ||xi_perp||^2 / k`` and ``chi = tanh a``:

        x0~ = cosh w + sinhc(w) w_r chi
        x~  = (cosh w chi + sinhc(w) w_r) u + sinhc(w) xi_perp / (sqrt(k) cosh a)      (Eq. 16)
        a'  = a + ln(x0~ + ||x~||) - ln(1 + chi)                                      (Eq. 17)

    and for inward steps (``w_r < 0``) the cancelling terms are rewritten with
    ``psi = ||xi_perp||^2 / (k w (w + |w_r|))`` and ``1 - chi = 2 / (e^{2a} + 1)`` (Eq. 18):
    ``x0~ = e^{-w} + sinh w [(1 - chi) + chi psi]``, radial coefficient
    ``chi e^{-w} + sinh w [psi - (1 - chi)]``.  The map is even in ``w``, so its gradient is finite
    at ``xi = 0``.
    """
    sk = _sqrt_k(k)
    _check_point(r, u, "")
    _check_same_dim(u, xi_perp, "u and xi_perp")
    _check_finite(xi_r=xi_r, xi_perp=xi_perp)
    a = r / sk
    chi = torch.tanh(a)
    w_r = xi_r / sk
    perp_sq = xi_perp.square().sum(-1) / sk**2
    omega_sq = w_r.square() + perp_sq
    cosh_w, sinhc_w = cosh_sinhc_sq(omega_sq)
    # outward or tangential step (Eq. 16): every term is non-negative
    x0_out = cosh_w + sinhc_w * w_r * chi
    radial_out = cosh_w * chi + sinhc_w * w_r
    # inward step (Eq. 18): w >= |w_r| > 0 on this branch
    inward = w_r < 0
    omega = torch.sqrt(torch.where(inward, omega_sq, torch.ones_like(omega_sq)))
    abs_wr = torch.where(inward, -w_r, torch.ones_like(w_r))
    psi = perp_sq / (omega * (omega + abs_wr))
    one_minus_chi = 2.0 / (torch.exp(2.0 * a) + 1.0)
    e_minus, sinh_w = torch.exp(-omega), torch.sinh(omega)
    x0_in = e_minus + sinh_w * (one_minus_chi + chi * psi)
    radial_in = chi * e_minus + sinh_w * (psi - one_minus_chi)
    x0 = torch.where(inward, x0_in, x0_out)
    radial = torch.where(inward, radial_in, radial_out)
    x_tilde = radial.unsqueeze(-1) * u + (sinhc_w / (sk * torch.cosh(a))).unsqueeze(-1) * xi_perp
    a_new = a + torch.log(x0 + safe_norm(x_tilde)) - torch.log1p(chi)
    return sk * a_new.clamp_min(0.0), safe_normalize(x_tilde)


def logmap(r1: Tensor, u1: Tensor, r2: Tensor, u2: Tensor, k: Curvature = 1.0) -> tuple[Tensor, Tensor]:
    """Logarithmic map ``log_x(y)`` in the polar frame at ``x = (r1, u1)``, Eq. 19.

    With ``D = d(x, y)/sqrt(k)`` and ``c = cosh D - 1`` from Eq. 5:

        xi_r    = -sqrt(k) D/sinh D [sinh(a - b) + cosh a sinh b * 1/2 ||u - v||^2]
        xi_perp =  sqrt(k) D/sinh D  sinh b (v - (v.u) u)

    ``D / sinh D`` is evaluated as a smooth function of ``c`` (it is 1 at ``c = 0``).
    """
    sk = _sqrt_k(k)
    c = haversine(r1, u1, r2, u2, k)
    a, b = r1 / sk, r2 / sk
    # D / sinh D = asinhc(s) / sqrt(1 + s^2) with s = sinh(D/2) = sqrt(c/2)
    ratio = sk * asinhc_half(c) / torch.sqrt(1.0 + 0.5 * c)
    sinh_b = torch.sinh(b)
    radial = torch.sinh(a - b) + torch.cosh(a) * sinh_b * chord(u1, u2)
    v_perp, _, _ = perp(u2, u1)
    return -ratio * radial, (ratio * sinh_b).unsqueeze(-1) * v_perp


def transport(
    r1: Tensor,
    u1: Tensor,
    r2: Tensor,
    u2: Tensor,
    xi_r: Tensor,
    xi_perp: Tensor,
    k: Curvature = 1.0,
) -> tuple[Tensor, Tensor]:
    """Parallel transport of ``xi`` from ``x = (r1, u1)`` to ``y = (r2, u2)`` along the geodesic (B.5).

    ``P(xi) = xi + lam (x + y)`` with ``lam = <y, xi>_L / (k - <x, y>_L)``.  In the polar frame,
    ``<y, xi>_L / sqrt(k) = -xi_r P + sinh b (v . xi_perp)`` where
    ``P = sinh(a - b) + cosh a sinh b * 1/2 ||u - v||^2`` (the radial term of Eq. 19) and
    ``k - <x, y>_L = k (2 + c)`` with ``c`` from Eq. 5.  The result is returned in the frame at
    ``y`` (Eq. 13): ``zeta_r = (v . zeta_s) / cosh b``, ``zeta_perp = zeta_s - (v . zeta_s) v``
    with ``zeta_s = (xi_r cosh a + lam' sinh a) u + xi_perp + lam' sinh b v`` and
    ``lam' = lam / sqrt(k)``.
    """
    sk = _sqrt_k(k)
    _check_same_dim(u1, xi_perp, "u1 and xi_perp")
    c = haversine(r1, u1, r2, u2, k)
    a, b = r1 / sk, r2 / sk
    sinh_a, cosh_a, sinh_b = torch.sinh(a), torch.cosh(a), torch.sinh(b)
    radial_gap = torch.sinh(a - b) + cosh_a * sinh_b * chord(u1, u2)
    v_dot_xi = (u2 * xi_perp).sum(-1)
    lam = (-xi_r * radial_gap + sinh_b * v_dot_xi) / (2.0 + c)
    along_u = xi_r * cosh_a + lam * sinh_a  # coefficient of u in zeta_s
    u_perp_v, _, _ = perp(u1, u2)  # u - (u.v) v, stable
    cos = (u1 * u2).sum(-1)
    zeta_r = (along_u * cos + v_dot_xi + lam * sinh_b) / torch.cosh(b)
    xi_perp_v = xi_perp - v_dot_xi.unsqueeze(-1) * u2
    return zeta_r, along_u.unsqueeze(-1) * u_perp_v + xi_perp_v
