"""Precision study of polar vs ambient Lorentz arithmetic (paper Appendix E.4, Table 7).

Everything here is measured against an mpmath reference (60 significant digits) evaluated on the
*same stored inputs* as the float32 computation, so the numbers are the error of the arithmetic
and not of the storage.  Used by ``benchmarks/precision.py``, the ``polar-vit-precision`` console
script and the test suite.

Test inputs are clusters of points with a given geodesic spread around a centre at radius ``r``
(``make_cluster``).  Ambient inputs are the float32 rounding of the exact ambient coordinates of
those very points, i.e. the best an ambient model could store.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from polar_vit_hf.modeling import ambient as amb, geometry as geo

try:
    import mpmath
except ImportError as error:  # a runtime-optional dependency: only the precision study needs it
    raise ImportError("the precision study needs mpmath: pip install 'polar-vit-hf[precision]'") from error

MP_DIGITS = 60

__all__ = [
    "Cluster",
    "MpPoint",
    "PrecisionRow",
    "bf16_radius_limit",
    "make_cluster",
    "mp_centroid",
    "mp_distance",
    "mp_gyroadd",
    "mp_horoshift",
    "mp_point",
    "mp_radius",
    "geodesic_error_polar",
    "geodesic_error_ambient",
    "precision_row",
    "precision_table",
    "weight_decay_row",
]

MpPoint = list  # [x0, x1, ..., xn] as mpf, on the hyperboloid <x, x> = -k


# --------------------------------------------------------------------------------------------
# mpmath reference arithmetic (ambient formulas, enough digits that cancellation is harmless)
# --------------------------------------------------------------------------------------------
def _mpf(v: float) -> mpmath.mpf:
    return mpmath.mpf(float(v))


def mp_point(r: float, u: Sequence[float], k: float = 1.0) -> MpPoint:
    """Exact ambient point of the stored polar input ``(r, u)`` (``u`` normalised in high precision)."""
    with mpmath.workdps(MP_DIGITS):
        sk = mpmath.sqrt(_mpf(k))
        uu = [_mpf(c) for c in u]
        norm = mpmath.sqrt(mpmath.fsum(c * c for c in uu))
        a = _mpf(r) / sk
        return [sk * mpmath.cosh(a)] + [sk * mpmath.sinh(a) * c / norm for c in uu]


def mp_point_from_space(xs: Sequence[float], k: float = 1.0) -> MpPoint:
    """Exact point whose space coordinates are the stored ``xs`` (time from the constraint)."""
    with mpmath.workdps(MP_DIGITS):
        s = [_mpf(c) for c in xs]
        return [mpmath.sqrt(_mpf(k) + mpmath.fsum(c * c for c in s))] + s


def _mp_inner(x: MpPoint, y: MpPoint):
    return -x[0] * y[0] + mpmath.fsum(a * b for a, b in zip(x[1:], y[1:]))


def mp_distance(x: MpPoint, y: MpPoint, k: float = 1.0):
    """``sqrt(k) arcosh(-<x, y>_L / k)`` in high precision (Eq. 1)."""
    with mpmath.workdps(MP_DIGITS):
        arg = -_mp_inner(x, y) / _mpf(k)
        return mpmath.sqrt(_mpf(k)) * mpmath.acosh(max(arg, mpmath.mpf(1)))


def mp_radius(x: MpPoint, k: float = 1.0):
    """Distance from the origin, ``sqrt(k) arsinh(||x_s|| / sqrt(k))``."""
    with mpmath.workdps(MP_DIGITS):
        sk = mpmath.sqrt(_mpf(k))
        return sk * mpmath.asinh(mpmath.sqrt(mpmath.fsum(c * c for c in x[1:])) / sk)


def mp_centroid(points: Sequence[MpPoint], weights: Sequence[float], k: float = 1.0) -> MpPoint:
    """Weighted Lorentz centroid, Eq. 4, in high precision."""
    with mpmath.workdps(MP_DIGITS):
        w = [_mpf(v) for v in weights]
        s = [mpmath.fsum(wi * p[j] for wi, p in zip(w, points)) for j in range(len(points[0]))]
        norm = mpmath.sqrt(abs(_mp_inner(s, s)))
        return [mpmath.sqrt(_mpf(k)) * c / norm for c in s]


def mp_gyroadd(x: MpPoint, y: MpPoint, k: float = 1.0) -> MpPoint:
    """Gyroaddition, Eq. 20, in high precision."""
    with mpmath.workdps(MP_DIGITS):
        sk = mpmath.sqrt(_mpf(k))
        dot = mpmath.fsum(a * b for a, b in zip(x[1:], y[1:]))
        coef = dot / (sk * (x[0] + sk)) + y[0] / sk
        z = [b + coef * a for a, b in zip(x[1:], y[1:])]
        return [mpmath.sqrt(_mpf(k) + mpmath.fsum(c * c for c in z))] + z


def mp_neg(x: MpPoint) -> MpPoint:
    """Gyro inverse: negate the space part."""
    return [x[0]] + [-c for c in x[1:]]


def mp_horoshift(x: MpPoint, t: float, ideal_axis: int, shift_axis: int) -> MpPoint:
    """Horospherical shift, Eq. 10, in high precision (space axes 0-based)."""
    with mpmath.workdps(MP_DIGITS):
        t = _mpf(t)
        i1, i2 = 1 + ideal_axis, 1 + shift_axis
        nu = x[0] - x[i1]
        lift = t * x[i2] + t * t * nu / 2
        out = list(x)
        out[0], out[i1], out[i2] = x[0] + lift, x[i1] + lift, x[i2] + t * nu
        return out


def geodesic_error_polar(r: Tensor, u: Tensor, ref: MpPoint, k: float = 1.0) -> float:
    """Geodesic distance between a computed polar point and the reference point."""
    return float(mp_distance(mp_point(float(r), u.tolist(), k), ref, k))


def geodesic_error_ambient(x: Tensor, ref: MpPoint, k: float = 1.0) -> float:
    """Geodesic distance between a computed ambient point (read through its space part) and ``ref``.

    A NaN or infinite coordinate counts as an infinite error.
    """
    if not bool(torch.isfinite(x).all()):
        return math.inf
    return float(mp_distance(mp_point_from_space(x[1:].tolist(), k), ref, k))


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    """Stored inputs: float32 polar points and the float32 rounding of their exact ambient form."""

    r: Tensor  # (M,) float32
    u: Tensor  # (M, n) float32
    x: Tensor  # (M, n+1) float32 ambient
    ref: list  # M exact points of (r, u) as MpPoint
    ref_ambient: list  # M exact points of the stored ambient x (through its space part)


def make_cluster(
    radius: float,
    n_points: int = 64,
    dim: int = 16,
    spread: float = 1.0,
    k: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Cluster:
    """``n_points`` points with geodesic spread ``spread`` around a centre at ``radius``.

    The points are ``exp_c(xi)`` with ``xi ~ N(0, (spread/2)^2 / dim I)`` in the tangent space at
    the centre ``c`` (so the cluster has diameter ~``spread``: points lie ~``spread/2`` from the
    centre and ~``0.7 spread`` from each other), computed in float64, then stored in ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    u_c = torch.randn(dim, generator=gen, dtype=f64)
    u_c = u_c / u_c.norm()
    xi = torch.randn(n_points, dim, generator=gen, dtype=f64) * (0.5 * spread / math.sqrt(dim))
    xi_r = xi @ u_c
    xi_perp = xi - xi_r[:, None] * u_c
    r_c = torch.full((n_points,), float(radius), dtype=f64)
    r64, u64 = geo.expmap(r_c, u_c.expand(n_points, dim), xi_r, xi_perp, k)
    r, u = r64.to(dtype), u64.to(dtype)
    x = geo.to_ambient(r.double(), u.double() / u.double().norm(dim=-1, keepdim=True), k).to(dtype)
    ref = [mp_point(float(ri), ui.tolist(), k) for ri, ui in zip(r, u)]
    ref_ambient = [mp_point_from_space(xi_[1:].tolist(), k) for xi_ in x]
    return Cluster(r, u, x, ref, ref_ambient)


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------
@dataclass
class PrecisionRow:
    """Errors at one radius (median over pairs / rows / points), ambient and polar."""

    radius: float
    sq_distance_ambient: float
    sq_distance_polar: float
    centroid_ambient: float
    centroid_polar: float
    centring_ambient: float
    centring_polar: float
    centroid_radius_ambient: float  # median radius of the ambient centroid output
    resolution_limit: float  # Proposition 2 with dtheta = 2^-24


def _median(values: list[float]) -> float:
    finite = sorted(values)
    return float(finite[len(finite) // 2]) if finite else math.nan


def _relative_sq_distance_errors(cl: Cluster, k: float) -> tuple[list[float], list[float]]:
    d2_polar = geo.pairwise_sq_distance(cl.r, cl.u, cl.r, cl.u, k)
    d2_amb = amb.pairwise_sq_distance(cl.x, cl.x, k)
    m = len(cl.ref)
    err_p, err_a = [], []
    for i in range(m):
        for j in range(i + 1, m):
            ref = mp_distance(cl.ref[i], cl.ref[j], k) ** 2
            ref_a = mp_distance(cl.ref_ambient[i], cl.ref_ambient[j], k) ** 2
            err_p.append(float(abs(d2_polar[i, j].item() - ref) / ref))
            value_a = d2_amb[i, j].item()
            err_a.append(float(abs(value_a - ref_a) / ref_a) if math.isfinite(value_a) else math.inf)
    return err_a, err_p


def _weights(n_rows: int, n_points: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.softmax(2.0 * torch.randn(n_rows, n_points, generator=gen), dim=-1)


def precision_row(
    radius: float, k: float = 1.0, n_points: int = 64, dim: int = 16, seed: int = 0, n_rows: int = 8
) -> PrecisionRow:
    """One row of Table 7: float32 ambient and polar errors against the mpmath reference."""
    cl = make_cluster(radius, n_points=n_points, dim=dim, k=k, seed=seed)
    err_a, err_p = _relative_sq_distance_errors(cl, k)

    # weighted centroid (attention-like softmax rows)
    w = _weights(n_rows, n_points, seed)
    r_mu, u_mu = geo.centroid(cl.r, cl.u, w, k)
    x_mu = amb.centroid(cl.x, w, k)
    cen_p, cen_a, cen_rad_a = [], [], []
    for row in range(n_rows):
        wl = w[row].tolist()
        cen_p.append(geodesic_error_polar(r_mu[row], u_mu[row], mp_centroid(cl.ref, wl, k), k))
        cen_a.append(geodesic_error_ambient(x_mu[row], mp_centroid(cl.ref_ambient, wl, k), k))
        xs = x_mu[row, 1:].double()
        cen_rad_a.append(float(math.sqrt(k) * torch.asinh(xs.norm() / math.sqrt(k))))

    # gyro-norm centring: (-)xbar (+) x_i with xbar the uniform centroid
    uniform = torch.full((1, n_points), 1.0 / n_points)
    r_bar, u_bar = geo.centroid(cl.r, cl.u, uniform, k)
    r_c, u_c = geo.gyrocenter(r_bar[0], u_bar[0], cl.r, cl.u, k)
    x_bar = amb.centroid(cl.x, uniform, k)[0]
    x_bar_neg = torch.cat([x_bar[:1], -x_bar[1:]])
    x_c = amb.gyroadd(x_bar_neg.expand_as(cl.x), cl.x, k)
    ref_bar = mp_neg(mp_centroid(cl.ref, [1.0 / n_points] * n_points, k))
    ref_bar_a = mp_neg(mp_centroid(cl.ref_ambient, [1.0 / n_points] * n_points, k))
    gyr_p = [geodesic_error_polar(r_c[i], u_c[i], mp_gyroadd(ref_bar, cl.ref[i], k), k) for i in range(n_points)]
    gyr_a = [geodesic_error_ambient(x_c[i], mp_gyroadd(ref_bar_a, cl.ref_ambient[i], k), k) for i in range(n_points)]

    limit = math.sqrt(k) * math.sinh(radius / math.sqrt(k)) * 2.0**-24
    return PrecisionRow(
        radius,
        _median(err_a),
        _median(err_p),
        _median(cen_a),
        _median(cen_p),
        _median(gyr_a),
        _median(gyr_p),
        _median(cen_rad_a),
        limit,
    )


def precision_table(radii: Sequence[float] = (2, 4, 6, 8, 10, 12, 14, 16), **kwargs) -> list[PrecisionRow]:
    """Table 7 for a range of radii."""
    return [precision_row(float(r), **kwargs) for r in radii]


@dataclass
class WeightDecayRow:
    """Manifold weight decay: centroid of ``{x, o}`` with weights ``(1 - w, w)`` (Appendix A)."""

    radius: float
    reference_radius: float
    polar_radius: float
    ambient_radius: float

    @property
    def step(self) -> float:
        return self.radius - self.reference_radius

    @property
    def polar_error_of_step(self) -> float:
        return abs(self.polar_radius - self.reference_radius) / abs(self.step)

    @property
    def ambient_error_of_step(self) -> float:
        return abs(self.ambient_radius - self.reference_radius) / abs(self.step)


def weight_decay_row(
    radius: float,
    decay: float = 1e-5,
    k: float = 1.0,
    dim: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> WeightDecayRow:
    """One manifold weight-decay step at ``radius`` in ``dtype``, polar and ambient, vs mpmath."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(dim, generator=gen, dtype=torch.float64)
    u = (u / u.norm()).to(dtype)
    r = torch.tensor([float(radius), 0.0], dtype=dtype)
    uu = torch.stack([u, u])
    w = torch.tensor([[1.0 - decay, decay]], dtype=dtype)
    r_new, _ = geo.centroid(r, uu, w, k)
    x = geo.to_ambient(r.double(), uu.double() / uu.double().norm(dim=-1, keepdim=True), k).to(dtype)
    x_new = amb.centroid(x, w, k)[0]
    ref = mp_centroid(
        [mp_point(float(r[0]), u.tolist(), k), mp_point(0.0, u.tolist(), k)], [float(w[0, 0]), float(w[0, 1])], k
    )
    amb_radius = (
        float(math.sqrt(k) * torch.asinh(x_new[1:].double().norm() / math.sqrt(k)))
        if bool(torch.isfinite(x_new).all())
        else math.nan
    )
    return WeightDecayRow(float(r[0]), float(mp_radius(ref, k)), float(r_new[0]), amb_radius)


def bf16_radius_limit(
    radii: Sequence[float] = tuple(x / 4 for x in range(4, 41)),
    k: float = 1.0,
    n_points: int = 32,
    dim: int = 16,
    seed: int = 0,
    threshold: float = 0.5,
    spread: float = 1.5,
) -> dict[str, float]:
    """Largest radius at which bfloat16 *storage* still resolves unit distances.

    Points of a cluster whose pairs are ~1 apart are stored in bfloat16, polar ``(r, u)`` or ambient ``x``; the
    squared distances are then computed in float32 and compared with the exact distances of the
    unrounded points.  Returns, per representation, the largest radius whose median relative
    error stays below ``threshold`` (theory, Proposition 1/2: ambient 2.8, polar 6.2).
    """
    limits = {"ambient": 0.0, "polar": 0.0}
    for radius in radii:
        cl = make_cluster(radius, n_points=n_points, dim=dim, spread=spread, k=k, seed=seed, dtype=torch.float64)
        d2_true = geo.pairwise_sq_distance(cl.r, cl.u, cl.r, cl.u, k)
        mask = ~torch.eye(n_points, dtype=torch.bool)
        r16 = cl.r.to(torch.bfloat16).float()
        u16 = cl.u.to(torch.bfloat16).float()
        d2_p = geo.pairwise_sq_distance(r16, u16, r16, u16, k).double()
        x16 = geo.to_ambient(cl.r, cl.u, k).to(torch.bfloat16).float()
        d2_a = amb.pairwise_sq_distance(x16, x16, k).double()
        for name, d2 in (("polar", d2_p), ("ambient", d2_a)):
            rel = ((d2 - d2_true).abs() / d2_true)[mask]
            if float(rel.median()) < threshold:
                limits[name] = max(limits[name], float(radius))
    return limits
