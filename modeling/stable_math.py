"""Scalar functions of the polar geometry in forms that never cancel: the one home of each.

Every function here evaluates a hyperbolic or inverse-hyperbolic quantity as a sum or product of terms of
one sign (paper Section 3.2), through ``exp`` / ``expm1`` / ``log1p`` / ``sqrt`` only: on the CPU PyTorch's
``sinh``, ``cosh`` and ``asinh`` run in scalar code (``benchmarks/vector_math.py``), and these forms
are accurate to a few ulp in float32 and float64.  The geometry (:mod:`geometry`), the fused layers
(:mod:`fused_attention`, :mod:`fused_gyro_norm`, :mod:`fused_layers`) and the chunked attention call them;
the Triton kernels (:mod:`triton_kernels`) spell the same formulas in Triton and take
:data:`SERIES_CUTOFF` from here.

This module is part of the remote code of exported checkpoints: it imports only ``torch``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def series_cutoff() -> float:
    """``1e-4``: below this value of ``c`` (Eq. 5), ``asinh(s)/s`` and the distance slope use their Taylor series
    (a function, not a module float, so compiled kernels hold it as a constant and not as a guarded global)."""
    return 1e-4


SERIES_CUTOFF = series_cutoff()


def sinhc_series_cutoff() -> float:
    """``1e-8``: below this ``w^2``, ``sinh(w)/w`` and ``cosh(w)`` use their Taylor series (a function, not a
    module float, so compiled kernels hold it as a constant and not as a guarded global)."""
    return 1e-8


SINHC_SERIES_CUTOFF = sinhc_series_cutoff()

# one of every kind of input the vectorised functions treat apart: signed zeros, subnormals, the extremes, -1
SPECIAL_INPUTS = (-0.0, 0.0, 1e-40, -1e-40, 1e-10, -1e-10, 0.5, -0.5, 1.0, -1.0, -2.0, 3.0, 100.0, -100.0, 1e30, -1e30)

__all__ = [
    "SERIES_CUTOFF",
    "SPECIAL_INPUTS",
    "asinh_exp",
    "asinh_nonneg",
    "asinh_sqrt_half",
    "asinhc_half",
    "asinhc_series",
    "cosh_minus_one",
    "cosh_sinhc_sq",
    "difference_series_below",
    "distance_slope",
    "inverse_or_zero",
    "exp_weights",
    "half_angle_series",
    "weight_cutoff",
    "kernel_acosh",
    "kernel_log1p",
    "page_in_vector_math",
    "pair_cosh_minus_one",
    "pair_sinh",
    "perp",
    "perp_parts",
    "safe_norm",
    "safe_normalize",
    "safe_sqrt",
    "scaled_sinh_cosh",
    "sinh_cosh",
    "sinh_cosh_smooth",
    "sinhc_sq",
]


def weight_cutoff(dtype: torch.dtype) -> float:
    """``ln(tiny) / 2`` of ``dtype`` (``-43.7`` in float32, ``-354`` in float64): the softmax exponent below which
    :func:`exp_weights` is zero, the weight ``sqrt(tiny)``."""
    return 0.5 * math.log(torch.finfo(dtype).tiny)


def exp_weights(x: Tensor) -> Tensor:
    """``exp(x)`` of the softmax exponents ``x <= 0`` of the attention kernels, exactly zero below ``sqrt(tiny)``
    (``x <`` :func:`weight_cutoff`).

    Far pairs of sharp attention give weights of ``1e-30`` and less; their products with gradients or distances
    fall below ``tiny`` (``1.2e-38`` in float32), into subnormal numbers, on which x86 arithmetic runs far slower
    (``benchmarks/attention_speed.py --sharpness``).  A weight below ``sqrt(tiny)`` moves a softmax-weighted sum
    of ``M`` terms, whose largest weight is ``>= 1/M``, by less than ``M^2 sqrt(tiny)`` relative (``4e-16`` at
    ``M = 64`` in float32): far below the rounding of the sum, so as an exact zero it changes no result.
    """
    cutoff = weight_cutoff(x.dtype)
    return torch.where(x < cutoff, 0.0, torch.exp(x.clamp_min(cutoff)))  # exp never rounds to a subnormal


def _log1p_through(x: Tensor, u: Tensor, log_u: Tensor) -> Tensor:
    """``log(1 + x)`` from ``u = 1 + x`` and ``log(u)``: ``log(u) x / (u - 1)``, ``x`` where ``u = 1`` (Goldberg 1991,
    Theorem 4: the quotient corrects the rounding of ``1 + x``)."""
    return torch.where(u == 1.0, x, log_u * (x / (u - 1.0)))


def kernel_log1p(x: Tensor) -> Tensor:
    """``log(1 + x)`` for ``x > -1``, through ``log``, inside compiled kernels: ``u = 1 + x``, ``log(u) x / (u - 1)``
    (``x`` where ``u = 1``; Goldberg 1991, Theorem 4), within 1.4 ulp in float32; in the ambient attention kernels
    on AVX-512 it takes half the time of ``torch.log1p`` there; eager, ``torch.log1p``.  For hand-derived backward
    passes only: the derivative of this form through ``u - 1`` is wrong near 0."""
    if not torch.compiler.is_compiling():
        return torch.log1p(x)
    u = 1.0 + x
    return _log1p_through(x, u, torch.log(u))


def kernel_acosh(x: Tensor) -> Tensor:
    """``arcosh(x)`` for ``x >= 1``, through one ``log``, inside compiled kernels: ``log1p(w)``, ``w = t + sqrt(t (t +
    2))`` with ``t = x - 1`` (:func:`kernel_log1p`'s form), ``ln x + ln 2`` from ``x = 2^26`` (where ``sqrt(x^2 - 1)``
    rounds to ``x``): the ``log`` of ``x`` there and of ``1 + w`` below, one ``log`` for both branches (a kernel
    evaluates both branches of a ``where``); eager, ``torch.acosh`` (scalar code on the CPU).  For hand-derived
    backward passes only."""
    if not torch.compiler.is_compiling():
        return torch.acosh(x)
    t = x - 1.0
    far = x >= 67108864.0
    w = t + torch.sqrt(t * (t + 2.0))
    u = torch.where(far, x, 1.0 + w)
    log_u = torch.log(u)
    return torch.where(far, log_u + math.log(2.0), _log1p_through(w, u, log_u))


def asinh_nonneg(s: Tensor) -> Tensor:
    """``asinh(s)`` for ``s >= 0``: ``log1p(s + s^2 / (1 + sqrt(1 + s^2)))`` (every term non-negative, exact to a few
    ulp from ``s = 0`` to the float range)."""
    s_sq = s * s
    return torch.log1p(s + s_sq / (1.0 + torch.sqrt(1.0 + s_sq)))


def asinh_exp(log_value: Tensor) -> Tensor:
    """``arsinh(exp(l))`` without overflow: ``l + log1p(sqrt(1 + e^{-2l}))`` for ``l > 0``, else
    :func:`asinh_nonneg` of ``e^l <= 1``; ``l = -inf`` gives 0.

    This is how every log-domain radius becomes a radius (Eq. 8, Eq. 22).
    """
    positive = log_value > 0
    zero = torch.zeros_like(log_value)
    pos = torch.where(positive, log_value, zero)  # (torch.where, not clamp: full gradient at l = 0)
    e_neg = torch.exp(-pos)  # e^{-l} for l > 0
    large = pos + torch.log1p(torch.sqrt(1.0 + e_neg * e_neg))
    small = asinh_nonneg(torch.exp(torch.where(positive, zero, log_value)))  # e^{l} for l <= 0
    return torch.where(positive, large, small)


def asinh_sqrt_half(c: Tensor) -> tuple[Tensor, Tensor]:
    """``asinh(s)`` and ``sqrt(1 + s^2)`` for ``s = sqrt(c / 2)``, ``c >= 0`` (Eq. 5: ``D = 2 asinh s``).

    ``s^2 = c / 2`` is never formed by squaring, so it holds up to ``c`` at the float range.
    """
    s_sq = 0.5 * c
    root = torch.sqrt(1.0 + s_sq)
    return torch.log1p(torch.sqrt(s_sq) + s_sq / (1.0 + root)), root


def asinhc_series(s_sq: Tensor) -> Tensor:
    """``asinh(s) / s = 1 - s^2/6 + 3 s^4/40 - 5 s^6/112`` (Horner in ``s^2``) for ``s^2 < SERIES_CUTOFF / 2``,
    where the first omitted term, ``35 s^8 / 1152``, is below ``2e-19``: within rounding in float32 and float64."""
    return 1.0 + s_sq * (-1.0 / 6.0 + s_sq * (0.075 - s_sq * (5.0 / 112.0)))


def asinhc_half(c: Tensor) -> Tensor:
    """``asinh(s) / s`` with ``s = sqrt(c / 2)``, smooth in ``c`` down to ``c = 0`` (:func:`asinhc_series` below
    :data:`SERIES_CUTOFF`)."""
    small = c < series_cutoff()
    c_safe = torch.where(small, torch.ones_like(c), c)
    s = torch.sqrt(0.5 * c_safe)
    exact = asinh_nonneg(s) / s
    return torch.where(small, asinhc_series(0.5 * c), exact)


def distance_slope(s_sq: Tensor, asinh_s: Tensor, root: Tensor) -> Tensor:
    """``d(D^2)/dc = 2 asinh(s) / (s sqrt(1 + s^2))`` with ``D = 2 asinh(s)``, ``s^2 = c/2`` (Eq. 5), from ``s^2``,
    ``asinh(s)`` and ``sqrt(1 + s^2)``.

    Smooth down to ``c = 0`` (:func:`asinhc_series` below :data:`SERIES_CUTOFF` of ``c``, chosen per entry on the
    device: no branch on the values, so no wait for them).  ``sqrt(s^2)`` is the expression the ``asinh`` of Eq. 5
    evaluates (:func:`asinh_sqrt_half`, the attention's scaled distances), so a compiled kernel evaluates it once.
    Used in hand-derived backward passes (not differentiated).
    """
    slope = torch.where(s_sq < 0.5 * series_cutoff(), asinhc_series(s_sq), asinh_s / torch.sqrt(s_sq))
    return 2.0 * slope / root


def signed_like(magnitude: Tensor, x: Tensor) -> Tensor:
    """``magnitude >= 0`` with the sign of ``x`` (``copysign`` up to the sign of zero): a selection, which every
    exporter translates (ONNX has no ``signbit``)."""
    return torch.where(x < 0, -magnitude, magnitude)


def sinh_cosh(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(sinh x, cosh x)`` from one ``expm1``: with ``t = e^{|x|} - 1 >= 0`` and ``q = e^{-|x|} = 1/(1 + t)``,

    ``sinh |x| = t (1 + q) / 2`` (a product of positive factors: no cancellation at small ``|x|``),
    ``cosh x = ((1 + t) + q) / 2``, and ``sinh x`` takes the sign of ``x``.  Using ``|x|`` keeps ``1 + t`` away
    from 0 (``expm1(x)`` rounds to ``-1`` below ``x ~ -17`` in float32).  For hand-derived backward passes.
    """
    t = torch.expm1(x.abs())
    q = torch.reciprocal(t + 1.0)
    return signed_like(0.5 * t * (1.0 + q), x), 0.5 * (t + 1.0 + q)


def sinh_cosh_smooth(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(sinh x, cosh x)`` for code differentiated by autograd (smooth at ``x = 0``):
    ``sinh x = (expm1(x) - expm1(-x)) / 2`` (two terms of one sign), ``cosh x = (e^x + e^{-x}) / 2``."""
    return 0.5 * (torch.expm1(x) - torch.expm1(-x)), 0.5 * (torch.exp(x) + torch.exp(-x))


def scaled_sinh_cosh(a: Tensor, top: Tensor) -> tuple[Tensor, Tensor]:
    """``(sinh a e^{-top}, cosh a e^{-top})`` for ``0 <= a <= top`` (a radius and the largest of its group):
    ``e^{a - top} (1 -+ e^{-2a}) / 2`` with ``1 - e^{-2a} = -expm1(-2a)``.  Every factor is at most 1 (no overflow
    at any radius) and of one sign (no cancellation at small ``a``, where ``e^{a - top} - e^{-a - top}`` loses the
    digits of ``a``); smooth in ``a`` (autograd differentiates it)."""
    one_minus = -torch.expm1(-2.0 * a)
    half_scale = 0.5 * torch.exp(a - top)
    return half_scale * one_minus, half_scale * (2.0 - one_minus)


def cosh_minus_one(x: Tensor) -> tuple[Tensor, Tensor]:
    """``cosh x - 1 = 2 sinh^2(x/2) = t^2 e^{-|x|} / 2`` and ``sinh x``, from ``t = expm1(|x|)``.

    The first term of the law of haversines (Eq. 5) for ``x = a - b``; both results are products of positive
    factors (with the sign of ``x`` for ``sinh``).
    """
    t = torch.expm1(x.abs())
    q = torch.reciprocal(t + 1.0)
    return 0.5 * t * (t * q), signed_like(0.5 * t * (1.0 + q), x)


def difference_series_below() -> float:
    """``3``: below this ``|x|``, :func:`pair_cosh_minus_one` takes its series (a function, not a module float, so
    compiled kernels hold it as a constant and not as a guarded global)."""
    return 3.0


def half_angle_series(z: Tensor, odd: bool) -> Tensor:
    """``sinh(y) / y`` (``odd``) or ``cosh y`` of ``z = y^2 <= 9/4`` by their Taylor series ``sum_k z^k / (2k +
    odd)!`` (Horner, in place: eagerly no tensor per term), truncated where the first term left out is below the
    dtype's rounding: 7 terms in float32 (``2.25^7 / 14! = 3e-9``), 11 in float64 (``2.25^11 / 22! = 7e-18``)."""
    terms = 11 if z.dtype == torch.float64 else 7
    coefficients = [1.0 / math.factorial(2 * k + int(odd)) for k in range(terms)]
    out = z * coefficients[-1] + coefficients[-2]
    for coefficient in reversed(coefficients[:-2]):
        out.mul_(z).add_(coefficient)
    return out


def pair_cosh_minus_one(x: Tensor, exp_x: Tensor, exp_minus_x: Tensor) -> Tensor:
    """``cosh x - 1`` for the radius differences ``x = a_i - b_j`` of all pairs (the first term of the law of
    haversines, Eq. 5) without a transcendental function per pair, given ``e^x = e^{a_i} e^{-b_j}`` and ``e^{-x} =
    e^{-a_i} e^{b_j}`` as products of per-radius exponentials (each to a few ulp: no cancellation in a product).

    ``|x| >=`` :func:`difference_series_below`: ``(e^x + e^{-x}) / 2 - 1`` (the subtraction amplifies the rounding at
    most ``cosh 3 / (cosh 3 - 1) = 1.11`` times).  Below: ``2 sinh^2(x/2)`` by :func:`half_angle_series`, a product
    of factors of one sign, exact to a few ulp down to ``x = 0``.  The value of :func:`cosh_minus_one` (one ``expm1``
    and a division per pair) to a few ulp at any radius whose ``e^r`` is finite; in a compiled kernel both forms are
    evaluated for every pair and one is selected.
    """
    y = 0.5 * x
    sinh_y = y * half_angle_series(y * y, odd=True)
    near = x.abs() < difference_series_below()
    return torch.where(near, 2.0 * sinh_y * sinh_y, 0.5 * (exp_x + exp_minus_x) - 1.0)


def pair_sinh(x: Tensor, exp_x: Tensor, exp_minus_x: Tensor) -> Tensor:
    """``sinh x`` for the radius differences of all pairs (the radii's term of Eq. 5's derivative), from the same
    inputs as :func:`pair_cosh_minus_one`: ``(e^x - e^{-x}) / 2`` where ``|x| >=`` :func:`difference_series_below`
    (rounding amplified at most ``coth 3 = 1.005`` times), below ``2 sinh(x/2) cosh(x/2)`` by
    :func:`half_angle_series`."""
    y = 0.5 * x
    z = y * y
    series = 2.0 * y * half_angle_series(z, odd=True) * half_angle_series(z, odd=False)
    return torch.where(x.abs() < difference_series_below(), series, 0.5 * (exp_x - exp_minus_x))


def sinhc_sq(omega_sq: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(sinh(w)/w, cosh w, w, small)`` as smooth functions of ``w^2`` (even in ``w``; the series
    ``1 + w^2/6`` and ``1 + w^2/2`` where ``small``, below :data:`SINHC_SERIES_CUTOFF`)."""
    small = omega_sq < sinhc_series_cutoff()
    w = torch.sqrt(torch.where(small, torch.ones_like(omega_sq), omega_sq))
    sinh_w, cosh_w = sinh_cosh(w)
    sinhc = torch.where(small, 1.0 + omega_sq / 6.0, sinh_w / w)
    return sinhc, torch.where(small, 1.0 + 0.5 * omega_sq, cosh_w), w, small


def cosh_sinhc_sq(omega_sq: Tensor) -> tuple[Tensor, Tensor]:
    """``cosh(w)`` and ``sinh(w)/w`` as smooth functions of ``w^2`` (:func:`sinhc_sq`; differentiable)."""
    small = omega_sq < sinhc_series_cutoff()
    w = torch.sqrt(torch.where(small, torch.ones_like(omega_sq), omega_sq))
    sinh_w, cosh_w = sinh_cosh_smooth(w)
    return (torch.where(small, 1.0 + 0.5 * omega_sq, cosh_w), torch.where(small, 1.0 + omega_sq / 6.0, sinh_w / w))


def safe_sqrt(sq: Tensor) -> Tensor:
    """``sqrt(sq)`` with a zero (sub)gradient at ``sq = 0``."""
    positive = sq > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, sq, torch.ones_like(sq))), torch.zeros_like(sq))


def safe_norm(v: Tensor) -> Tensor:
    """``||v||`` along the last axis with a zero (sub)gradient at ``v = 0``."""
    return safe_sqrt(v.square().sum(-1))


def inverse_or_zero(norm: Tensor) -> Tensor:
    """``1 / norm`` where ``norm > 0``, else 0: the factor of a normalisation's backward, zero (the subgradient) at
    the zero vector."""
    positive = norm > 0
    return torch.where(positive, torch.reciprocal(torch.where(positive, norm, 1.0)), 0.0)


def safe_normalize(v: Tensor, norm: Tensor | None = None) -> Tensor:
    """``v / ||v||`` along the last axis; a zero vector maps to ``e_0`` (the direction of the origin) with a finite
    gradient.  ``norm`` (``(...)``) may be given when it is known."""
    norm = torch.linalg.vector_norm(v, dim=-1) if norm is None else norm
    nonzero = (norm > 0).unsqueeze(-1)
    e_0 = (torch.arange(v.shape[-1], device=v.device) == 0).to(v.dtype)
    return torch.where(nonzero, v / torch.where(nonzero, norm.unsqueeze(-1), 1.0), e_0)


def perp_parts(v: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stable ``v - (v.u) u`` for unit ``u``, ``v`` (the boost residual, Eq. 12, and gyroaddition, Eq. 20, 21).

    With ``s = sign(u.v)``: ``v - (v.u) u = d + s h u`` with ``d = v - s u`` and ``h = 1/2 ||d||^2 = 1 - s (u.v)``,
    so both for nearly aligned and nearly opposite directions only the small difference ``d`` is formed.
    Returns ``(v_perp, s, h, d)``.
    """
    s = torch.where((u * v).sum(-1) >= 0, 1.0, -1.0).to(v.dtype).detach()
    d = v - s.unsqueeze(-1) * u
    h = 0.5 * d.square().sum(-1)
    return torch.addcmul(d, (s * h).unsqueeze(-1), u), s, h, d


def perp(v: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(v_perp, s, h)`` of :func:`perp_parts`."""
    return perp_parts(v, u)[:3]


def page_in_vector_math() -> None:
    """Run ``exp``, ``expm1``, ``log``, ``log1p`` and ``sqrt`` once on :data:`SPECIAL_INPUTS` and the non-finite
    values, in float32 and float64: called once, when this module is imported.

    The vectorised ``expm1`` and ``log1p`` of PyTorch's CPU builds (the Sleef functions that eager operations and
    inductor's compiled kernels both call) end with a masked load of a constant for one kind of special input
    (``expm1(-0) = -0``), from a page of read-only data that nothing else reads.  With an all-false mask the load
    does not fault, so the page is never mapped, and every call on ordinary inputs pays a microcode assist for the
    suppressed fault, which multiplies the time of float32 ``expm1`` and ``log1p`` (``python
    benchmarks/vector_math.py``).  One call whose
    mask is true maps the page for the whole process, for eager operations and compiled kernels alike.
    """
    values = torch.tensor([*SPECIAL_INPUTS, math.inf, -math.inf, math.nan]).repeat(4)  # every lane, every width
    for dtype in (torch.float32, torch.float64):
        x = values.to(dtype)
        for fn in (torch.exp, torch.expm1, torch.log, torch.log1p, torch.sqrt):
            fn(x)


page_in_vector_math()
