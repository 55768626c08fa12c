"""Fused polar layers: ``torch.autograd.Function``s with hand-derived backward passes.

The reference layers (``PolarViTConfig(fused_ops=False)``) are written with the small functions of
:mod:`geometry` and differentiated by autograd, which saves every intermediate tensor and adds an
autograd node per elementwise operation.  The functions here compute the same formulas (same
equations, same non-negative sums, same log-domain radii) without autograd in the forward pass,
save only what their backward pass needs (inputs, outputs and a few per-token or per-row scalars)
and recompute the rest.

Hyperbolic functions are evaluated through ``exp`` / ``expm1`` / ``log1p`` (:func:`sinh_cosh`,
:func:`cosh_minus_one`, :func:`asinh_sqrt_half`): on the CPU, PyTorch's ``sinh``, ``cosh`` and
``asinh`` run element by element in scalar code (10x the time of ``exp`` on AVX2), and every
formula below keeps its terms of one sign, so nothing cancels.

When training in float32 on the CPU, the attention core's groups, the position encoding's per-token
scalars, the gyro layer norm, the head concatenation (:class:`RecomputedFunction`), the boost residual
and the Polar-FC epilogue run as inductor-compiled kernels (:func:`kernel`, :func:`use_kernels`; off
with ``POLAR_VIT_CPU_KERNELS=0``); everything else, and every other case, runs the same formulas eagerly.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and :mod:`geometry`.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
from torch import Tensor

from .geometry import _SERIES_C, asinh_exp, centroid_radius  # _SERIES_C: below it asinh(s)/s is a series

GROUP_ELEMENTS = 1 << 19  # H x N x M elements per group of samples (cache-sized)
GEMM_ALIGN = 8  # the Polar-FC's inner width n+1 is zero-padded to a multiple of this (MKL: odd widths run 2.3x slower)


# --------------------------------------------------------------------------------------------
# compiled kernels (CPU training)
# --------------------------------------------------------------------------------------------
_KERNELS = {"enabled": os.environ.get("POLAR_VIT_CPU_KERNELS", "1") != "0", "compiled": {}}


def set_cpu_kernels(enabled: bool) -> None:
    """Turn the compiled CPU kernels of the fused layers on or off for this process (on by default;
    ``POLAR_VIT_CPU_KERNELS=0`` in the environment starts with them off)."""
    _KERNELS["enabled"] = bool(enabled)


def cpu_kernels_enabled() -> bool:
    """Whether the fused layers may use their compiled CPU kernels (:func:`set_cpu_kernels`)."""
    return _KERNELS["enabled"]


KERNEL_MIN_ELEMENTS = 1 << 20  # below this, eager passes stay cache-resident and a compile would not pay off


def use_kernels(like: Tensor, training: bool, elements: int | None = None) -> bool:
    """Compiled kernels for a call: training (backward will run), float32 on the CPU, at least
    ``KERNEL_MIN_ELEMENTS`` elements in the call's largest tensors (``like``, or ``elements`` where those are
    temporaries, as the attention's pairs), not inside ``torch.compile``.

    Inference, float64 and small tensors (the demo, short runs) run the same formulas eagerly: no compile
    latency where it would not be won back (measured: the gains start near one million elements per tensor).
    """
    size = like.numel() if elements is None else elements
    return (_KERNELS["enabled"] and training and like.device.type == "cpu" and like.dtype == torch.float32
            and size >= KERNEL_MIN_ELEMENTS and not torch.compiler.is_compiling())


def kernel(fn):
    """``fn`` compiled by inductor with dynamic shapes (one compile per process and argument kind, reused
    from inductor's on-disk cache), or ``fn`` itself if compiling fails (no C++ compiler): a warning, then
    eager for the rest of the process.  The elementwise chains of a fused layer then run as a few loops
    instead of one pass over memory per operation."""
    compiled = _KERNELS["compiled"]
    if fn not in compiled:
        compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)

    def run(*args):
        if compiled[fn] is not fn:
            try:
                return compiled[fn](*args)
            except Exception as error:  # noqa: BLE001 - a compiler failure falls back to the same formulas
                warnings.warn(f"polar_vit_hf: compiled CPU kernels unavailable ({type(error).__name__}: "
                              f"{str(error)[:200]}); running eager", stacklevel=2)
                compiled[fn] = fn
        return fn(*args)
    return run


def _training(*inputs: Tensor | None) -> bool:
    """Whether autograd records a call on ``inputs`` (backward may follow), decided outside the Function."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def run_maybe_compiled(fn, training: bool, like: Tensor, *args, elements: int | None = None):
    """``fn(*args)``, through :func:`kernel` where :func:`use_kernels` says so."""
    return kernel(fn)(*args) if use_kernels(like, training, elements) else fn(*args)


class RecomputedFunction(torch.autograd.Function):
    """``fn(*tensors, *constants)``, a pure function of its tensors with one output, saving only its inputs:
    forward runs it, backward recomputes it and differentiates it with ``torch.func.vjp``; each a compiled
    kernel when training in float32 on the CPU (:func:`use_kernels`), so neither keeps an autograd graph of
    its intermediates."""

    @staticmethod
    def forward(ctx, fn, constants, training, *tensors):  # noqa: D102
        ctx.fn, ctx.constants = fn, constants
        ctx.save_for_backward(*tensors)
        return run_maybe_compiled(_bound(fn, constants), training, tensors[0], *tensors)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        tensors = ctx.saved_tensors
        gradients = run_maybe_compiled(_vjp(ctx.fn, ctx.constants), True, tensors[0], grad.contiguous(), *tensors)
        return (None, None, None, *gradients)


@functools.cache
def _bound(fn, constants: tuple):
    """``fn`` with its trailing ``constants`` bound (one function object per pair: one compiled kernel, the
    constants compiled in)."""
    return lambda *tensors: fn(*tensors, *constants)


@functools.cache
def _vjp(fn, constants: tuple):
    """``(grad, *tensors) -> gradients of fn(*tensors, *constants)`` by ``torch.func.vjp`` (one function object
    per pair: one compiled kernel)."""
    return lambda grad, *tensors: torch.func.vjp(lambda *args: fn(*args, *constants), *tensors)[1](grad)


def recomputed(fn, *tensors: Tensor, constants: tuple = ()) -> Tensor:
    """``fn(*tensors, *constants)`` through :class:`RecomputedFunction`."""
    return RecomputedFunction.apply(fn, tuple(constants), _training(*tensors), *tensors)


# --------------------------------------------------------------------------------------------
# scalar helpers (no input validation, no autograd of their own)
# --------------------------------------------------------------------------------------------
def sinh_cosh(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(sinh x, cosh x)`` from one ``expm1``: with ``t = e^{|x|} - 1 >= 0`` and ``q = e^{-|x|} = 1/(1 + t)``,

    ``sinh |x| = t (1 + q) / 2`` (a product of positive factors: no cancellation at small ``|x|``),
    ``cosh x = ((1 + t) + q) / 2``, and ``sinh x`` takes the sign of ``x``.  Using ``|x|`` keeps
    ``1 + t`` away from 0 (``expm1(x)`` rounds to ``-1`` below ``x ~ -17`` in float32).
    """
    t = torch.expm1(x.abs())
    q = torch.reciprocal(t + 1.0)
    return torch.copysign(0.5 * t * (1.0 + q), x), 0.5 * (t + 1.0 + q)


def sinh_cosh_smooth(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(sinh x, cosh x)`` from exponentials, for code differentiated by autograd (smooth at ``x = 0``).

    ``sinh x = (expm1(x) - expm1(-x)) / 2`` (two terms of one sign: no cancellation near 0),
    ``cosh x = (e^x + e^{-x}) / 2``; PyTorch's own ``sinh`` / ``cosh`` are scalar loops on the CPU.
    """
    return 0.5 * (torch.expm1(x) - torch.expm1(-x)), 0.5 * (torch.exp(x) + torch.exp(-x))


def cosh_minus_one(x: Tensor) -> tuple[Tensor, Tensor]:
    """``cosh x - 1 = 2 sinh^2(x/2) = t^2 e^{-|x|} / 2`` and ``sinh x``, from ``t = expm1(|x|)``.

    The first term of the law of haversines (Eq. 5) for ``x = a - b``; both results are products
    of positive factors (with the sign of ``x`` for ``sinh``).
    """
    t = torch.expm1(x.abs())
    q = torch.reciprocal(t + 1.0)
    return 0.5 * t * (t * q), torch.copysign(0.5 * t * (1.0 + q), x)


def asinh_sqrt_half(c: Tensor) -> tuple[Tensor, Tensor]:
    """``asinh(s)`` and ``sqrt(1 + s^2)`` for ``s = sqrt(c / 2)``, ``c >= 0``.

    ``asinh s = log1p(s + s^2 / (1 + sqrt(1 + s^2)))``: every term is non-negative and ``s^2 = c/2``
    is never formed by squaring, so it holds up to ``c`` at the float range.
    """
    s_sq = 0.5 * c
    root = torch.sqrt(1.0 + s_sq)
    return torch.log1p(torch.sqrt(s_sq) + s_sq / (1.0 + root)), root


def distance_slope(c: Tensor, asinh_s: Tensor, root: Tensor) -> Tensor:
    """``d(D^2)/dc = 2 asinh(s) / (s sqrt(1 + s^2))`` with ``D = 2 asinh(s)``, ``s = sqrt(c/2)``.

    Smooth down to ``c = 0`` (series ``2 (1 - s^2/6 + 3 s^4/40)`` below ``c = 1e-4``; eager, the series
    is evaluated only when some entry needs it).  Used in hand-derived backward passes (not differentiated).
    """
    s_sq = 0.5 * c
    slope = asinh_s / torch.sqrt(s_sq)
    if torch.compiler.is_compiling() or bool((c < _SERIES_C).any()):
        slope = torch.where(c < _SERIES_C, 1.0 - s_sq / 6.0 + 0.075 * s_sq * s_sq, slope)
    return 2.0 * slope / root


def centroid_row_gradients(
    grad_r: Tensor, grad_u: Tensor, big_t: Tensor, big_e: Tensor, big_s: Tensor, v_norm: Tensor, a_mu: Tensor,
    u_hat: Tensor, k: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of the centroid radius (Eq. 22) to the sums ``T, E, S`` (``g_S = g_E``) and the vector ``V``.

    With ``l = ln ||V|| - 1/2 ln(E + S) - 1/2 ln(T + ||V||)`` and ``d a_mu / d l = tanh(a_mu)``,
    returns ``(g_T, g_E, g_V, row_dot)`` where ``row_dot = g_T T + g_V . V + g_E (E + S)`` is the
    row constant of the softmax backward when the sums are softmax-weighted.  Rows with ``V = 0``
    (the origin) get zero gradients.
    """
    degenerate = v_norm <= 0
    v_safe = torch.where(degenerate, torch.ones_like(v_norm), v_norm)
    g_l = torch.where(degenerate, torch.zeros_like(a_mu), grad_r * math.sqrt(k) * torch.tanh(a_mu))
    g_t = -0.5 * g_l / (big_t + v_norm)
    g_e = -0.5 * g_l / (big_e + big_s)
    radial = g_l * (1.0 / v_safe - 0.5 / (big_t + v_norm))
    tangential = (grad_u - (grad_u * u_hat).sum(-1, keepdim=True) * u_hat) / v_safe.unsqueeze(-1)
    g_v = radial.unsqueeze(-1) * u_hat + torch.where(degenerate.unsqueeze(-1), 0.0, tangential)
    row_dot = g_t * big_t + (g_v * u_hat).sum(-1) * v_norm + g_e * (big_e + big_s)
    return g_t, g_e, g_v, row_dot


def row_gradients(grad_r: Tensor, grad_u: Tensor, stats: Tensor, a_mu: Tensor, u_hat: Tensor, k: float):
    """Per-row partials of an attention output with respect to its softmax-normalised sums (chunked, Triton).

    ``stats`` holds ``(m, l, T, E, S, ||V||)`` per row (sums divided by the softmax denominator ``l``);
    returns ``(g_T, g_E, g_S, g_V, sum_j p_ij g_p_ij)`` from :func:`centroid_row_gradients`
    (Eq. 22; ``g_S = g_E``), the last one the row constant of the softmax backward.
    """
    _, _, big_t, big_e, big_s, v_norm = stats
    g_t, g_e, g_v, row_dot = centroid_row_gradients(grad_r, grad_u, big_t, big_e, big_s, v_norm, a_mu, u_hat, k)
    return g_t, g_e, g_e, g_v, row_dot


# --------------------------------------------------------------------------------------------
# attention core
# --------------------------------------------------------------------------------------------
CHORD_PRODUCT_ABOVE = 1e-6  # chords from a float64 inner product at and above this value (error <= 2e-9 relative)


def chord_operands(u: Tensor, right: bool = False) -> Tensor:
    """Float64 operands whose product is every pair's chord ``1/2 |u_i|^2 + 1/2 |v_j|^2 - u_i.v_j`` (App. D.1).

    Left (``right=False``): ``[u, 1/2 |u|^2, 1]`` ``(G, N, d+2)``; right: ``[-v, 1, 1/2 |v|^2]`` transposed to
    ``(G, d+2, M)``: one float64 matrix product, no ``N x M`` addition.
    """
    dim = u.shape[-1]
    ops = u.new_empty(*u.shape[:-1], dim + 2, dtype=torch.float64)
    coords = ops[..., :dim]
    coords.copy_(u)
    ops[..., dim + (0 if right else 1)] = 1.0
    ops[..., dim + (1 if right else 0)] = 0.5 * coords.square().sum(-1)
    if not right:
        return ops
    coords.neg_()
    return ops.transpose(-1, -2)


def pair_chords(u: Tensor, v_t: Tensor) -> Tensor:
    """``1/2 ||u_i - v_j||^2`` ``(G, N, M)`` for all pairs of ``u (G, N, d)`` and ``v``, given transposed as
    ``v_t (G, d, M)``: never ``1 - u.v`` in the input precision (App. D.1), never an ``N x M x d`` tensor.

    Float64, and inside a compiled kernel (:func:`kernel`, ``torch.compile``): the exact coordinate
    differences, one square-add per coordinate (a compiled kernel runs them as one loop over ``M``).
    Float32 / half, eager: one float64 product of the :func:`chord_operands`, whose absolute error
    (``~d 2^-53``) is below ``2e-9`` of every chord ``>= CHORD_PRODUCT_ABOVE``, so the rounded result is the
    float32 value of the exact chord; the few pairs below that (nearly equal directions) are recomputed
    from their coordinate differences.
    """
    if u.dtype == torch.float64 or torch.compiler.is_compiling():
        out = (u[..., 0].unsqueeze(-1) - v_t[..., 0, :].unsqueeze(-2)).square()
        for coord in range(1, u.shape[-1]):
            diff = u[..., coord].unsqueeze(-1) - v_t[..., coord, :].unsqueeze(-2)
            out = out.addcmul(diff, diff)
        return 0.5 * out
    v = v_t.transpose(-1, -2)
    out = torch.bmm(chord_operands(u), chord_operands(v, right=True)).to(u.dtype)
    if bool(out.min() < CHORD_PRODUCT_ABOVE):  # nearly equal directions: exact differences for those pairs
        g, i, j = (out < CHORD_PRODUCT_ABOVE).nonzero(as_tuple=True)
        out[g, i, j] = 0.5 * (u[g, i] - v[g, j]).square().sum(-1)
    return out


def scaled_distances(chord: Tensor, rows: dict) -> dict:
    """Eq. 5 for all pairs of a group from their chords, and the scaled distances ``w`` (the score is ``-w^2``).

    ``c / 2 = s^2 = 1/4 t^2 / (1 + t) + 1/2 sinh a_i sinh b_j chord_ij`` with ``t = expm1(|a_i - b_j|)``
    (:func:`cosh_minus_one`; every term non-negative), ``asinh s = log1p(s + s^2 / (1 + sqrt(1 + s^2)))``
    (:func:`asinh_sqrt_half`) and ``w = sqrt(4 k scale) asinh s`` (``D = 2 asinh s``, Eq. 9).  Returns
    ``w``, ``asinh_s``, ``s``, ``s_sq``, ``root = sqrt(1 + s^2)``, ``t`` and ``diff = a_i - b_j``, all ``(G, N, M)``.
    """
    diff = rows["a"].unsqueeze(-1) - rows["b"].unsqueeze(-2)
    t = torch.expm1(diff.abs())
    s_sq = torch.addcdiv(chord * (0.5 * rows["sinh_b"]).unsqueeze(-2) * rows["sinh_a"].unsqueeze(-1),
                         t * t, 1.0 + t, value=0.25)
    root = torch.sqrt(1.0 + s_sq)
    s = torch.sqrt(s_sq)
    asinh_s = torch.log1p(torch.addcdiv(s, s_sq, 1.0 + root))
    return {"w": asinh_s * rows["root_coef"], "asinh_s": asinh_s, "s": s, "s_sq": s_sq, "root": root, "t": t,
            "diff": diff}


def _unit_directions(big_v: Tensor, v_norm: Tensor) -> Tensor:
    """``V / ||V||``, and ``e_0`` where ``V = 0`` (the centroid is the origin)."""
    nonzero = (v_norm > 0).unsqueeze(-1)
    e_0 = (torch.arange(big_v.shape[-1], device=big_v.device) == 0).to(big_v.dtype)
    return torch.where(nonzero, big_v / torch.where(nonzero, v_norm.unsqueeze(-1), 1.0), e_0)


def _attention_group_forward(rows: dict) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of :class:`FusedPolarAttention` on one group of slices: ``(lse, sums, ||V||, u_hat, S)`` with
    ``sums = (T, E, V)`` ``(G, N, d+2)``; the softmax unnormalised (``exp(w_min^2 - w^2)``, sums divided
    by the row total: one exp pass, no ``logsumexp``)."""
    rows = _group_operands(rows)
    w = scaled_distances(pair_chords(rows["uq"], rows["uk_t"]), rows)["w"]
    w_min_sq = w.amin(-1, keepdim=True).square()  # the largest score is -w_min^2
    probs = torch.exp(w_min_sq - w.square())
    total = probs.sum(-1, keepdim=True)
    sums = torch.bmm(probs, rows["values"]) / total  # (G, N, d+2): T, E, V
    v_norm = torch.linalg.vector_norm(sums[..., 2:], dim=-1)
    u_hat = _unit_directions(sums[..., 2:], v_norm)
    weighted = pair_chords(u_hat, rows["uv_t"]).mul_(probs).mul_(rows["sinh_beta"].unsqueeze(-2))
    total = total.squeeze(-1)
    return torch.log(total) - w_min_sq.squeeze(-1), sums, v_norm, u_hat, weighted.sum(-1) / total


def _attention_group_backward(rows: dict, saved: dict, grad_r: Tensor, grad_u: Tensor, k: float) -> tuple:
    """Backward of :class:`FusedPolarAttention` on one group of slices (see its docstring for the formulas):
    gradients of ``(rq, uq, rk, uk, rv, uv)`` and the per-slice scale gradient (all ``(G, ...)``)."""
    rows = _group_operands(rows)
    uq, uk, uv, u_hat, v_norm = rows["uq"], rows["uk"], rows["uv"], saved["u_hat"], saved["v_norm"]
    sinh_a, sinh_b, sinh_beta = rows["sinh_a"], rows["sinh_b"], rows["sinh_beta"].unsqueeze(-1)
    g_t, g_e, g_v, _ = centroid_row_gradients(grad_r, grad_u, saved["big_t"], saved["big_e"], saved["big_s"],
                                              v_norm, saved["a_mu"], u_hat, k)
    # recompute Eq. 5 and the probabilities from the saved log-sum-exp
    chord = pair_chords(uq, rows["uk_t"])
    d = scaled_distances(chord, rows)
    probs = torch.exp(-saved["lse"].unsqueeze(-1) - d["w"].square())
    sinh_x = torch.addcdiv(0.5 * d["t"], 0.5 * d["t"], 1.0 + d["t"]).copysign_(d["diff"])  # sinh(a_i - b_j)
    # S is stationary in u_hat only in exact arithmetic:
    # dS/du_hat = g_S (W (u_hat - v_bar) - sum_j w_ij (v_j - v_bar)), w_ij = P_ij sinh beta_j, W = sum_j w_ij,
    # measures the rounding of u_hat; carried through u_hat = V / |V|
    # it cancels that rounding in dL/dv (centred differences, Eq. 25, keep it exact for clustered values)
    v_bar = _centre(uv)
    centred_v = uv - v_bar
    sums = probs @ torch.cat([sinh_beta, sinh_beta * centred_v], dim=-1)
    drift = g_e.unsqueeze(-1) * (sums[..., :1] * (u_hat - v_bar) - sums[..., 1:])
    drift = drift - (drift * u_hat).sum(-1, keepdim=True) * u_hat
    g_v = g_v + drift / torch.where(v_norm > 0, v_norm, 1.0).unsqueeze(-1)
    # dL/dP = g_T cosh beta_j + g_E e^{-beta_j} + sinh beta_j (g_V . v_j + g_S chord(u_i, v_j))
    chord_e = pair_chords(u_hat, rows["uv_t"]).mul_(g_e.unsqueeze(-1))  # g_S chord(u_i, v_j)
    chord_terms = (chord_e * probs).sum(-2)  # sum_i P_ij g_S chord
    g_rows = torch.cat([g_t.unsqueeze(-1), g_e.unsqueeze(-1), g_v], dim=-1)  # (G, N, d+2)
    g_p = torch.baddbmm(chord_e.mul_(sinh_beta.transpose(-1, -2)), g_rows, rows["values"].transpose(-1, -2))
    # values: radius and direction (the value chord gradient centred on the mean value direction, Eq. 25)
    pt_g = probs.transpose(-1, -2) @ torch.cat([g_rows, g_e.unsqueeze(-1) * (u_hat - v_bar)], dim=-1)
    pt_gv, pt_gs = pt_g[..., 2:2 + uv.shape[-1]], pt_g[..., 2 + uv.shape[-1]:]
    g_beta = (sinh_beta.squeeze(-1) * pt_g[..., 0] - rows["exp_beta"] * pt_g[..., 1]
              + rows["cosh_beta"] * ((uv * pt_gv).sum(-1) + chord_terms))
    g_uv = sinh_beta * (pt_gv - pt_gs + centred_v * pt_g[..., 1:2])
    # softmax, scores and the scale: score = -scale k D^2, D^2 = 4 asinh(s)^2
    g_score = (g_p - (probs * g_p).sum(-1, keepdim=True)).mul_(probs)
    g_scale = (g_score * d["asinh_s"].square()).sum(dim=(1, 2)) * (-4.0 * k)
    g_c = g_score.mul_(distance_slope(2.0 * d["s_sq"], d["asinh_s"], d["root"]))  # dL/d(c) / (-scale k)
    # Eq. 5: radii and chords; the chord gradient centred on the mean key direction (Eq. 25)
    g_c_sinh_x = g_c * sinh_x
    chord_g = chord.mul_(g_c)  # sums weighted by sinh b_j / sinh a_i (elementwise: matrix-vector bmm is slow)
    g_a = g_c_sinh_x.sum(-1) + rows["cosh_a"] * (chord_g * sinh_b.unsqueeze(-2)).sum(-1)
    g_b = rows["cosh_b"] * (chord_g * sinh_a.unsqueeze(-1)).sum(-2) - g_c_sinh_x.sum(-2)
    k_bar = _centre(uk)
    p_q, q_k = uq - k_bar, uk - k_bar
    # g_chord_ij = g_c_ij sinh a_i sinh b_j, never formed: its sums over j and i as products
    by_key = g_c @ torch.cat([sinh_b.unsqueeze(-1), sinh_b.unsqueeze(-1) * q_k], dim=-1)  # (G, N, 1+d)
    by_query = g_c.transpose(-1, -2) @ torch.cat([sinh_a.unsqueeze(-1), sinh_a.unsqueeze(-1) * p_q], dim=-1)
    g_uq = sinh_a.unsqueeze(-1) * (p_q * by_key[..., :1] - by_key[..., 1:])
    g_uk = sinh_b.unsqueeze(-1) * (q_k * by_query[..., :1] - by_query[..., 1:])
    c_coef = rows["scale"].view(-1, 1) * -k  # dL/dc = -scale k g_c
    sk = math.sqrt(k)
    return (g_a * (c_coef / sk), g_uq * c_coef.unsqueeze(-1), g_b * (c_coef / sk), g_uk * c_coef.unsqueeze(-1),
            g_beta / sk, g_uv, g_scale)


def _centre(u: Tensor) -> Tensor:
    """Mean direction ``(G, 1, d)`` for the centred chord gradient (Eq. 25), summed in float64.

    Identical directions then give exactly their own value, so their centred differences vanish.
    """
    return u.double().mean(dim=-2, keepdim=True).to(u.dtype) if u.dtype != torch.float64 else u.mean(-2, keepdim=True)


def _batch_groups(batch: int, per_sample: int) -> list[slice]:
    """Groups of samples whose ``(head, N, M)`` temporaries stay cache-sized (``GROUP_ELEMENTS``;
    ``per_sample = H N M``)."""
    size = max(1, GROUP_ELEMENTS // max(1, per_sample))
    return [slice(start, min(start + size, batch)) for start in range(0, batch, size)]


def _group_operands(rows: dict) -> dict:
    """A group's rows with the value operand ``[cosh beta, e^{-beta}, sinh beta v]`` ``(G, M, d+2)`` of the
    centroid sums (Eq. 22), built inside the group's function (a compiled kernel: no pass of its own)."""
    values = torch.cat([rows["cosh_beta"].unsqueeze(-1), rows["exp_beta"].unsqueeze(-1),
                        rows["uv"] * rows["sinh_beta"].unsqueeze(-1)], dim=-1)
    return dict(rows, values=values)


class _AttentionRows:
    """Per-slice quantities of :class:`FusedPolarAttention`, computed once for all ``(batch, head)`` slices.

    Radii divided by ``sqrt(k)`` (``a`` queries, ``b`` keys, ``beta`` values), their ``sinh``/``cosh`` and
    ``sqrt(4 k scale)`` per slice (``score = -(sqrt(4 k scale) asinh s)^2``, Eq. 9), all ``(B, H, ...)``;
    the directions are the inputs themselves (views, never copied whole).  ``rows[group]`` holds a group
    of samples as ``G = g H`` contiguous slices (the copies of strided inputs made per group, in cache).
    """

    def __init__(self, rq, uq, rk, uk, rv, uv, scale, k: float):
        batch, heads = uq.shape[:2]
        sk = math.sqrt(k)
        self.uq, self.uk, self.uv = uq, uk, uv
        self.a, self.b, self.beta = rq / sk, rk / sk, rv / sk
        self.sinh_a, self.cosh_a = sinh_cosh(self.a)
        self.sinh_b, self.cosh_b = sinh_cosh(self.b)
        self.sinh_beta, self.cosh_beta = sinh_cosh(self.beta)
        self.exp_beta = torch.exp(-self.beta)
        scale_g = scale.view(1, heads, 1, 1).expand(batch, heads, 1, 1)
        self.scale, self.root_coef = scale_g, torch.sqrt(scale_g * (4.0 * k))

    def __getitem__(self, group: slice) -> dict:
        """The group's rows ``(G, ...)`` and its keys and values transposed, ``(G, d, M)`` (the inner loop of
        :func:`pair_chords` runs over ``M``)."""
        rows = {name: value[group].flatten(0, 1) for name, value in vars(self).items()}
        rows["uk_t"], rows["uv_t"] = (rows[name].transpose(-1, -2).contiguous() for name in ("uk", "uv"))
        return rows


class FusedPolarAttention(torch.autograd.Function):
    r"""Polar attention for sequences that fit one block: scores, softmax and centroid in one function.

    Forward (per batch and head; queries ``(a_i, q_i)``, keys ``(b_j, k_j)``, values ``(beta_j, v_j)``,
    radii divided by ``sqrt(k)``):

        c_ij = (cosh(a_i - b_j) - 1) + sinh a_i sinh b_j 1/2 ||q_i - k_j||^2          (Eq. 5)
        P_ij = softmax_j(-scale_h k D_ij^2),  D_ij = 2 asinh sqrt(c_ij / 2)              (Eq. 9)
        T = P cosh(beta), E = P e^{-beta}, V = P (sinh(beta) v), S_i = sum_j P_ij sinh beta_j 1/2 ||u_i - v_j||^2

    and the centroid radius of Eq. 22 with ``u_i = V_i / ||V_i||``.  Saved for backward: the inputs,
    the output and the per-row ``(lse, T, E, S, ||V||)``: nothing of size ``N x M``.  Backward
    recomputes ``P`` from ``lse`` and uses

        dL/dP_ij = g_T cosh beta_j + g_E e^{-beta_j} + sinh beta_j (g_V . v_j + g_S chord(u_i, v_j))
        dL/dscore_ij = P_ij (dL/dP_ij - sum_j' P_ij' dL/dP_ij')

    (``S`` is stationary in ``u_i``, so ``u_i`` is held fixed in it), ``dD^2/dc`` from
    :func:`distance_slope`, ``dc/da_i = sinh(a_i - b_j) + cosh a_i sinh b_j chord`` and the centred
    chord gradient of Eq. 25.  The softmax row constant is summed from the very values the gradient
    uses, so it cancels exactly where the score gradient vanishes (identical keys).  Quantities of one
    row (radii, their hyperbolic functions, operands) are computed once for all slices
    (:class:`_AttentionRows`); the samples are processed in groups whose ``(head, N, M)``
    temporaries stay cache-sized, each group by one function (a compiled kernel when training in
    float32 on the CPU, :func:`use_kernels`).
    """

    @staticmethod
    def forward(ctx, rq, uq, rk, uk, rv, uv, scale, k, training):  # noqa: D102
        batch, heads, n_q, _ = uq.shape
        rows = _AttentionRows(rq, uq, rk, uk, rv, uv, scale, k)
        pairs = batch * heads * n_q * uk.shape[2]
        parts = [run_maybe_compiled(_attention_group_forward, training, uq, rows[group], elements=pairs)
                 for group in _batch_groups(batch, heads * n_q * uk.shape[2])]
        lse, sums, v_norm, u_hat, big_s = (torch.cat(part) for part in zip(*parts))  # (B H, N, ...)
        big_t, big_e = sums[..., 0], sums[..., 1]
        a_mu = centroid_radius(big_t, big_e, big_s, v_norm, v_norm <= 0)
        ctx.save_for_backward(rq, uq, rk, uk, rv, uv, scale, a_mu, u_hat, lse, big_t, big_e, big_s, v_norm)
        ctx.k = k
        return (math.sqrt(k) * a_mu).view_as(rq), u_hat.view_as(uq)

    @staticmethod
    def backward(ctx, grad_r, grad_u):  # noqa: D102
        rq, uq, rk, uk, rv, uv, scale, a_mu, u_hat, lse, big_t, big_e, big_s, v_norm = ctx.saved_tensors
        batch, heads, n_q, _ = uq.shape
        rows = _AttentionRows(rq, uq, rk, uk, rv, uv, scale, ctx.k)
        saved = {"lse": lse, "big_t": big_t, "big_e": big_e, "big_s": big_s, "v_norm": v_norm, "a_mu": a_mu,
                 "u_hat": u_hat}
        parts = []
        for group in _batch_groups(batch, heads * n_q * uk.shape[2]):
            slots = slice(group.start * heads, group.stop * heads)
            parts.append(run_maybe_compiled(_attention_group_backward, True, uq, rows[group],
                                            {name: value[slots] for name, value in saved.items()},
                                            grad_r[group].flatten(0, 1), grad_u[group].flatten(0, 1), ctx.k,
                                            elements=batch * heads * n_q * uk.shape[2]))
        grads = [torch.cat(part) for part in zip(*parts)]
        shaped = [g.view_as(t) for g, t in zip(grads, (rq, uq, rk, uk, rv, uv))]
        return (*shaped, grads[-1].view(batch, heads).sum(0), None, None)


def fused_polar_attention(rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale: Tensor,
                          k: float = 1.0) -> tuple[Tensor, Tensor]:
    """Polar attention (Eq. 9) in one fused function; ``scale`` is an ``(H,)`` tensor
    (:class:`FusedPolarAttention`)."""
    return FusedPolarAttention.apply(rq, uq, rk, uk, rv, uv, scale, float(k),
                                     _training(rq, uq, rk, uk, rv, uv, scale))


# --------------------------------------------------------------------------------------------
# Polar-FC (Eq. 8)
# --------------------------------------------------------------------------------------------
def gemm_width(n: int) -> int:
    """``n`` rounded up to a multiple of ``GEMM_ALIGN``: the width of the Polar-FC's unit coordinates and weight.

    Matrix products whose inner or output width is odd (``n + 1 = 193`` for ``n = 192``) take a slow
    path in MKL on the CPU (2.3x the time of width 192 or 200); zero columns change no sum.
    """
    return -(-n // GEMM_ALIGN) * GEMM_ALIGN


def _unit_coords(r: Tensor, u: Tensor, sqrt_k: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x / sqrt(k) = (cosh a, sinh a u)`` (Eq. 2) as one ``(T, gemm_width(n+1))`` tensor (zeros after ``n+1``),
    with ``a``, ``sinh a``, ``cosh a``."""
    a = r / sqrt_k
    sinh_a, cosh_a = sinh_cosh(a)
    width = u.shape[-1] + 1
    x = u.new_empty(*u.shape[:-1], gemm_width(width))  # filled by slices (no out= into views: torch.compile)
    x[..., 0] = cosh_a
    x[..., 1:width] = u * sinh_a.unsqueeze(-1)
    x[..., width:] = 0.0
    return x, a, sinh_a, cosh_a


def _padded_weight(weight: Tensor) -> Tensor:
    """``weight (m, n+1)`` with zero columns up to :func:`gemm_width`."""
    return torch.nn.functional.pad(weight, (0, gemm_width(weight.shape[1]) - weight.shape[1]))


def _is_gelu(activation) -> bool:
    """transformers' exact ``GELUActivation`` (its backward is ``aten.gelu_backward``)."""
    return getattr(activation, "act", None) is torch.nn.functional.gelu


def _polar_fc_epilogue(pre: Tensor, a: Tensor, klein: Tensor | None, norm_power: Tensor | None,
                       radius_weight: Tensor | None, radius_bias: Tensor | None, sqrt_k: float,
                       gelu: bool) -> tuple[Tensor, Tensor]:
    """``([r', u'] (T, H, d+1), ||h|| (T, H))`` of Eq. 8 from the pre-activation ``pre = W x / sqrt(k)``.

    ``h = gelu(pre)`` (or ``pre``), ``u' = h / ||h||`` (``e_0`` where ``h = 0``), ``r' = sqrt(k) arsinh(e^l)`` with
    ``l = beta ln||h|| + lambda a + tanh(a) klein + varphi_0`` (``klein = u . varphi``), or ``l = ln||h||``
    without the radius rule.
    """
    h = torch.nn.functional.gelu(pre) if gelu else pre
    norm = torch.linalg.vector_norm(h, dim=-1)  # (T, H)
    log_radius = torch.log(norm.clamp_min(1e-30))
    if norm_power is not None:
        log_radius = torch.addcmul(radius_bias + radius_weight * a.unsqueeze(-1), norm_power, log_radius)
        log_radius = log_radius + torch.tanh(a).unsqueeze(-1) * klein
    nonzero = norm > 0
    direction = h / torch.where(nonzero, norm, torch.ones_like(norm)).unsqueeze(-1)
    first = torch.where(nonzero, direction[..., 0], torch.ones_like(norm))  # h = 0: direction e_0
    radius = asinh_exp(log_radius) * sqrt_k
    return torch.cat([radius.unsqueeze(-1), first.unsqueeze(-1), direction[..., 1:]], dim=-1), norm


def _polar_fc_epilogue_backward(grad_out: Tensor, out: Tensor, norm: Tensor, norm_power: Tensor | None,
                                pre: Tensor | None, sqrt_k: float) -> tuple[Tensor, Tensor]:
    """``(dL/dpre, g_l)`` of :func:`_polar_fc_epilogue` (``dL/dh`` where ``pre`` is ``None``), with
    ``g_l = sqrt(k) g_r' tanh(a')`` and ``g_h = (g_u' + (beta g_l - g_u'.u') u') / ||h||``."""
    u_out, g_u_out = out[..., 1:], grad_out[..., 1:]
    g_l = grad_out[..., 0] * sqrt_k * torch.tanh(out[..., 0] / sqrt_k)  # (T, H)
    coef = (g_l * norm_power if norm_power is not None else g_l) - (g_u_out * u_out).sum(-1)
    nonzero = norm > 0
    inv_norm = torch.where(nonzero, 1.0 / torch.where(nonzero, norm, torch.ones_like(norm)), torch.zeros_like(norm))
    g_h = torch.addcmul(g_u_out, coef.unsqueeze(-1), u_out) * inv_norm.unsqueeze(-1)
    return (g_h if pre is None else torch.ops.aten.gelu_backward(g_h, pre)), g_l


class FusedPolarFC(torch.autograd.Function):
    r"""``H`` Polar-FCs (Eq. 8) on tokens ``p = [r, u]`` ``(T, n+1)`` -> ``[r', u']`` ``(T, H, d+1)``.

    ``h = phi(W x / sqrt(k))``, ``u' = h / ||h||``, ``l = beta ln||h|| + lambda a + varphi . (tanh(a) u) + varphi_0``,
    ``r' = sqrt(k) arsinh(e^l)``; without the radius rule (``beta`` is ``None``) ``l = ln ||h||``.
    Saved: the input, the output, ``||h||`` per head and the pre-activation (only with an
    activation).  Backward, with ``g_l = sqrt(k) g_r' tanh(a')``:

        g_h = (g_u' + (beta g_l - g_u'.u') u') / ||h||,   g_W = g_pre^T x,   g_x = g_pre W
        g_a = g_x0 sinh a + cosh a (g_xs . u) + lambda . g_l + sech^2 a (u . varphi^T g_l),
        g_u = sinh a g_xs + tanh a varphi^T g_l.
    """

    @staticmethod
    def forward(ctx, p, weight, norm_power, radius_weight, klein_weight, radius_bias, sqrt_k, heads,  # noqa: D102
                activation, training):
        x, a, _, _ = _unit_coords(p[:, 0], p[:, 1:], sqrt_k)
        pre = (x @ _padded_weight(weight).t()).view(p.shape[0], heads, -1)  # (T, H, d)
        gelu = _is_gelu(activation)
        klein = None if norm_power is None else p[:, 1:] @ klein_weight.t()  # (T, H): u . varphi
        rule = (norm_power, radius_weight, radius_bias, sqrt_k)
        if activation is None or gelu:
            out, norm = run_maybe_compiled(_polar_fc_epilogue, training, pre, pre, a, klein, *rule, gelu)
        else:  # any other activation: applied eagerly, the epilogue without one
            out, norm = _polar_fc_epilogue(activation(pre), a, klein, *rule, False)
        ctx.save_for_backward(p, weight, norm_power, radius_weight, klein_weight, out, norm,
                              pre if activation is not None else None)
        ctx.sqrt_k, ctx.activation = sqrt_k, activation
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        p, weight, norm_power, radius_weight, klein_weight, out, norm, pre = ctx.saved_tensors
        sqrt_k = ctx.sqrt_k
        r, u = p[:, 0], p[:, 1:]
        x, a, sinh_a, cosh_a = _unit_coords(r, u, sqrt_k)
        if pre is None or _is_gelu(ctx.activation):
            g_pre, g_l = run_maybe_compiled(_polar_fc_epilogue_backward, True, out, grad_out, out, norm, norm_power,
                                            pre, sqrt_k)
        else:
            g_h, g_l = _polar_fc_epilogue_backward(grad_out, out, norm, norm_power, None, sqrt_k)
            with torch.enable_grad():
                leaf = pre.detach().requires_grad_(True)
                (g_pre,) = torch.autograd.grad(ctx.activation(leaf), leaf, g_h)
        g_pre = g_pre.flatten(1)  # (T, H d)
        width = p.shape[1]
        g_weight = (g_pre.t() @ x)[:, :width]
        g_x = (g_pre @ _padded_weight(weight))[:, :width]
        g_xs = g_x[:, 1:]
        g_a = g_x[:, 0] * sinh_a + cosh_a * (g_xs * u).sum(-1)
        g_u = g_xs.mul_(sinh_a.unsqueeze(-1))
        grads_rule = (None, None, None, None)
        if norm_power is not None:
            log_norm = torch.log(norm.clamp_min(1e-30))
            tanh_a = torch.tanh(a)
            g_klein = g_l @ klein_weight  # (T, n): varphi^T g_l
            g_a += g_l @ radius_weight + (u * g_klein).sum(-1) / cosh_a.square()
            g_u += tanh_a.unsqueeze(-1) * g_klein
            grads_rule = ((g_l * log_norm).sum(0), (g_l * a.unsqueeze(-1)).sum(0),
                          (g_l * tanh_a.unsqueeze(-1)).t() @ u, g_l.sum(0))
        g_p = g_x  # [g_a / sqrt(k), g_u] written over g_x (g_u is g_x[:, 1:] scaled in place)
        g_p[:, 0] = g_a / sqrt_k
        return (g_p, g_weight, *grads_rule, None, None, None, None)


def fused_polar_fc(p: Tensor, weight: Tensor, rule: tuple[Tensor, Tensor, Tensor, Tensor] | None, sqrt_k: float,
                   heads: int, activation=None) -> Tensor:
    """``heads`` Polar-FCs (Eq. 8) on ``p (..., n+1)`` -> ``(..., heads, d+1)``; ``rule`` is
    ``(beta, lambda, varphi, varphi_0)`` of shapes ``(H,), (H,), (H, n), (H,)`` or ``None`` (Lorentz FC)."""
    rule = rule if rule is not None else (None, None, None, None)
    out = FusedPolarFC.apply(p.reshape(-1, p.shape[-1]), weight, *rule, float(sqrt_k), int(heads), activation,
                             _training(p, weight, *rule))
    return out.view(*p.shape[:-1], heads, -1)


# --------------------------------------------------------------------------------------------
# gyrovector pieces shared by the gyro layer norm (Sec. 4.4, Eq. 20, 21)
# --------------------------------------------------------------------------------------------
def _polar_from_z(z: Tensor, sqrt_k: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(r, u, ||z||)`` of the point with space coordinates ``sqrt(k) z``: ``r = sqrt(k) asinh ||z||``,
    ``u = z/||z||``."""
    norm = torch.linalg.vector_norm(z, dim=-1)
    u = _unit_directions(z, norm)  # the origin: direction e_0
    asinh_norm = torch.log1p(norm + norm * norm / (1.0 + torch.sqrt(1.0 + norm * norm)))
    return sqrt_k * asinh_norm, u, norm


def _polar_from_z_backward(g_r: Tensor, g_u: Tensor, u: Tensor, norm: Tensor, sqrt_k: float) -> Tensor:
    """``dL/dz`` of :func:`_polar_from_z`: ``sqrt(k) g_r / sqrt(1 + |z|^2) u + (g_u - (g_u.u) u) / |z|``,
    0 at ``z = 0``."""
    nonzero = norm > 0
    inv = torch.where(nonzero, 1.0 / torch.where(nonzero, norm, torch.ones_like(norm)), torch.zeros_like(norm))
    radial = torch.where(nonzero, sqrt_k * g_r / torch.sqrt(1.0 + norm * norm), torch.zeros_like(norm))
    coef = radial - (g_u * u).sum(-1) * inv
    return torch.addcmul(g_u * inv.unsqueeze(-1), coef.unsqueeze(-1), u)


def _gyroadd_z(a: Tensor, u1: Tensor, b: Tensor, v: Tensor) -> tuple[Tensor, tuple]:
    """``z`` of ``x (+) y`` (Eq. 20, 21; :func:`geometry.gyroadd`), ``x = (a, u1)``, ``y = (b, v)``,
    radii / ``sqrt(k)``, with the direction ``u1`` shared by the tokens of ``v (..., N, n)``: ``(n,)`` or
    ``(..., 1, n)``.

    ``d = v - s u1`` (``s = sign(u1 . v)``), ``h = 1/2 ||d||^2``, ``v_perp = d + s h u1``;
    ``z_par = sinh a cosh b + cosh a sinh b (1 - h)`` (``s > 0``) or ``sinh(a - b) + cosh a sinh b h``;
    ``z = z_par u1 + sinh b v_perp``.  Returns ``z`` and what the backward pass needs
    (:func:`_gyroadd_vectors` rebuilds its vectors ``d``, ``v_perp`` from its scalars).
    """
    sinh_a, cosh_a = sinh_cosh(a)
    sinh_b, cosh_b = sinh_cosh(b)
    sign = torch.where(_dot_tokens(v, u1) >= 0, 1.0, -1.0).to(v.dtype)
    d = torch.addcmul(v, sign.unsqueeze(-1), u1, value=-1.0)
    h = 0.5 * d.square().sum(-1)
    sinh_ab, cosh_ab = sinh_cosh(a - b)
    aligned = sign > 0
    z_par = torch.where(aligned, sinh_a * cosh_b + cosh_a * sinh_b * (1.0 - h), sinh_ab + cosh_a * sinh_b * h)
    saved = (sinh_a, cosh_a, sinh_b, cosh_b, cosh_ab, sign, d, h, None, z_par, aligned)
    d, v_perp, z = _gyroadd_vectors(u1, v, saved)
    return z, saved[:6] + (d, h, v_perp) + saved[9:]


def _gyroadd_vectors(u1: Tensor, v: Tensor, saved: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """``(d, v_perp, z)`` of :func:`_gyroadd_z` from its per-token scalars (``d`` taken from ``saved``
    where present): ``d = v - s u1``, ``v_perp = d + s h u1``, ``z = z_par u1 + sinh b v_perp``."""
    sinh_b, sign, d, h, z_par = saved[2], saved[5], saved[6], saved[7], saved[9]
    d = torch.addcmul(v, sign.unsqueeze(-1), u1, value=-1.0) if d is None else d
    v_perp = torch.addcmul(d, (sign * h).unsqueeze(-1), u1)
    return d, v_perp, torch.addcmul(z_par.unsqueeze(-1) * u1, sinh_b.unsqueeze(-1), v_perp)


def _dot_tokens(x: Tensor, c: Tensor) -> Tensor:
    """``x . c`` per token for ``x (..., N, n)`` and a direction shared by the tokens, ``c (n,)`` or
    ``(..., 1, n)``: one matrix product."""
    return x @ c if c.dim() == 1 else (x @ c.transpose(-1, -2)).squeeze(-1)


def _sum_tokens(w: Tensor, x: Tensor, like: Tensor) -> Tensor:
    """``sum_tokens w x`` for ``w (..., N)``, ``x (..., N, n)``, summed to the shape of a shared direction
    ``like`` (``(n,)``: over every token; ``(..., 1, n)``: over each sample's)."""
    if like.dim() == 1:
        return w.reshape(-1) @ x.reshape(-1, x.shape[-1])
    return w.unsqueeze(-2) @ x


def _gyroadd_backward(g_z: Tensor, u1: Tensor, saved: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dL/da, dL/du1, dL/db, dL/dv)`` of :func:`_gyroadd_z` for a direction ``u1`` shared by the tokens:
    ``dL/du1`` summed over them (the shape of ``u1``), the others per token.

    With ``g_vperp = sinh b g_z``: ``g_z . v_perp = g_z . d + s h (g_z . u1)``,
    ``g_d = g_vperp + g_h d`` and ``g_u1 = g_z z_par + s h g_vperp - s g_d``, summed as products.
    """
    sinh_a, cosh_a, sinh_b, cosh_b, cosh_ab, sign, d, h, _, z_par, aligned = saved
    g_zpar = _dot_tokens(g_z, u1)
    g_sinh_b = (g_z * d).sum(-1) + sign * h * g_zpar
    # z_par: the two branches of Eq. 20 / 21
    g_a = g_zpar * torch.where(aligned, cosh_a * cosh_b + sinh_a * sinh_b * (1.0 - h), cosh_ab + sinh_a * sinh_b * h)
    g_b = g_zpar * torch.where(aligned, sinh_a * sinh_b + cosh_a * cosh_b * (1.0 - h), cosh_a * cosh_b * h - cosh_ab)
    g_h = g_zpar * torch.where(aligned, -cosh_a * sinh_b, cosh_a * sinh_b)
    g_b = g_b + g_sinh_b * cosh_b
    # v_perp = d + s h u1, h = 1/2 |d|^2, d = v - s u1
    g_h = g_h + sign * sinh_b * g_zpar
    g_d = torch.addcmul(g_z * sinh_b.unsqueeze(-1), g_h.unsqueeze(-1), d)
    g_u1 = _sum_tokens(z_par + sign * sinh_b * (h - 1.0), g_z, u1) - _sum_tokens(sign * g_h, d, u1)
    return g_a, g_u1, g_b, g_d


# --------------------------------------------------------------------------------------------
# gyro layer normalisation (Sec. 4.4)
# --------------------------------------------------------------------------------------------
def _gyro_norm_forward(p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> tuple[Tensor, dict]:
    """Forward of :class:`FusedGyroLayerNorm`: the output ``(B, N, n+1)`` and the intermediates of its backward."""
    sk = math.sqrt(k)
    u = p[..., 1:]
    a = p[..., 0] / sk
    tokens = a.shape[-1]
    sinh_a, cosh_a = sinh_cosh(a)
    exp_a = torch.exp(-a)
    # centroid of the sample's tokens with weights 1/N (Eq. 6, 7, 22)
    big_t, big_e = cosh_a.mean(-1), exp_a.mean(-1)
    big_v = (sinh_a.unsqueeze(-2) @ u).squeeze(-2) / tokens  # (B, n)
    v_norm = torch.linalg.vector_norm(big_v, dim=-1)
    nonzero = v_norm > 0
    u_hat = big_v / torch.where(nonzero, v_norm, torch.ones_like(v_norm)).unsqueeze(-1)
    u_hat[..., 0] = torch.where(nonzero, u_hat[..., 0], torch.ones_like(v_norm))
    diff = u - u_hat.unsqueeze(-2)  # exact differences for the chords (App. D.1)
    chord = 0.5 * diff.square().sum(-1)  # (B, N)
    big_s = (sinh_a * chord).mean(-1)
    a_m = centroid_radius(big_t, big_e, big_s, v_norm, ~nonzero)
    sinh_m, cosh_m = sinh_cosh(a_m)
    # dispersion: mean squared distance to the centroid (Eq. 5)
    c, sinh_x = cosh_minus_one(a - a_m.unsqueeze(-1))
    c += sinh_a * sinh_m.unsqueeze(-1) * chord
    asinh_s, root = asinh_sqrt_half(c)
    variance = asinh_s.square().mean(-1) * (4.0 * k)
    # centring (-)m (+) x (Eq. 21), radius scaling, bias point b (+) . (Eq. 20)
    z1, saved1 = _gyroadd_z(a_m.unsqueeze(-1), -u_hat.unsqueeze(-2), a, u)
    r_y, u_y, norm1 = _polar_from_z(z1, sk)
    factor = torch.exp(log_gain) / torch.sqrt(variance + eps)  # (B,)
    b = r_y * factor.unsqueeze(-1) / sk
    big_x = bias / sk
    x_sq = big_x.square().sum()
    near = x_sq <= 1.0
    # eager: only the branch in use; under torch.compile both, selected by torch.where (no data-dependent if)
    branches = ("near", "far") if torch.compiler.is_compiling() else (("near",) if near else ("far",))
    z_parts, saved2 = {}, {}
    if "near" in branches:  # near the origin: Eq. 20 directly (smooth at b = o), as geometry.gyroadd_space
        sinh_b, cosh_b = sinh_cosh(b)
        x_dot_u = u_y @ big_x
        denom = torch.sqrt(1.0 + x_sq) + 1.0
        coef = x_dot_u * sinh_b / denom + cosh_b
        z_parts["near"] = sinh_b.unsqueeze(-1) * u_y + coef.unsqueeze(-1) * big_x
        saved2["near"] = (sinh_b, cosh_b, x_dot_u, denom, coef)
    if "far" in branches:  # beyond: the polar gyroaddition (Eq. 21) with the bias point in polar form
        far_x = torch.where(near, torch.ones_like(big_x), big_x)
        far_norm = torch.linalg.vector_norm(far_x)
        z_parts["far"], saved2["far"] = _gyroadd_z(torch.asinh(far_norm), far_x / far_norm, b, u_y)
        saved2["far_x"] = (far_x, far_norm)
    z2 = z_parts[branches[0]] if len(branches) == 1 else torch.where(near, z_parts["near"], z_parts["far"])
    r_out, u_out, norm2 = _polar_from_z(z2, sk)
    out = torch.cat([r_out.unsqueeze(-1), u_out], dim=-1)
    state = dict(a=a, u=u, sinh_a=sinh_a, cosh_a=cosh_a, exp_a=exp_a, big_t=big_t, big_e=big_e, big_s=big_s,
                 v_norm=v_norm, u_hat=u_hat, diff=diff, chord=chord, a_m=a_m, sinh_m=sinh_m, cosh_m=cosh_m, c=c,
                 sinh_x=sinh_x, asinh_s=asinh_s, root=root, variance=variance, saved1=saved1, r_y=r_y, u_y=u_y,
                 norm1=norm1, factor=factor, b=b, big_x=big_x, x_sq=x_sq, near=near, saved2=saved2, u_out=u_out,
                 norm2=norm2)
    return out, state


def _gyro_norm_backward(grad: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float, st: dict):
    """Backward of :class:`FusedGyroLayerNorm`, from the intermediates of :func:`_gyro_norm_forward`."""
    sk = math.sqrt(k)
    tokens = st["a"].shape[-1]
    g_z2 = _polar_from_z_backward(grad[..., 0], grad[..., 1:], st["u_out"], st["norm2"], sk)
    big_x, u_y, near, saved2 = st["big_x"], st["u_y"], st["near"], st["saved2"]
    both = len(saved2) > 2
    g_b, g_u_y, g_bias = 0.0, 0.0, 0.0
    if "near" in saved2:
        sinh_b, cosh_b, x_dot_u, denom, coef = saved2["near"]
        g_z = torch.where(near, g_z2, 0.0) if both else g_z2
        g_coef = g_z @ big_x
        g_x_dot_u = g_coef * sinh_b / denom
        g_sinh_b = (g_z * u_y).sum(-1) + g_coef * x_dot_u / denom
        g_denom = -(g_coef * x_dot_u * sinh_b).sum() / denom**2
        g_big_x = (coef.unsqueeze(-1) * g_z + g_x_dot_u.unsqueeze(-1) * u_y).flatten(0, -2).sum(0)
        g_big_x = g_big_x + big_x * (g_denom / torch.sqrt(1.0 + st["x_sq"]))
        g_u_y = g_u_y + torch.addcmul(g_z * sinh_b.unsqueeze(-1), g_x_dot_u.unsqueeze(-1), big_x)
        g_b = g_b + g_sinh_b * cosh_b + g_coef * sinh_b
        g_bias = g_bias + (torch.where(near, g_big_x, 0.0) if both else g_big_x) / sk
    if "far" in saved2:
        far_x, far_norm = saved2["far_x"]
        u_bias = far_x / far_norm
        g_z = torch.where(near, 0.0, g_z2) if both else g_z2
        g_a_bias, g_u_bias, g_b_far, g_u_far = _gyroadd_backward(g_z, u_bias, saved2["far"])
        g_a_bias = g_a_bias.sum()
        g_far_x = (g_a_bias / torch.sqrt(1.0 + far_norm**2)) * u_bias + (
            g_u_bias - (g_u_bias @ u_bias) * u_bias) / far_norm
        g_b, g_u_y = g_b + g_b_far, g_u_y + g_u_far
        g_bias = g_bias + (torch.where(near, 0.0, g_far_x) if both else g_far_x) / sk
    # radius scaling r_y -> factor r_y, factor = e^{log_gain} / sqrt(variance + eps)
    factor = st["factor"]
    g_r_y = g_b * factor.unsqueeze(-1) / sk
    g_factor = (g_b * st["r_y"]).sum(-1) / sk
    g_log_gain = (g_factor * factor).sum()
    g_variance = -0.5 * g_factor * factor / (st["variance"] + eps)
    # centring
    g_z1 = _polar_from_z_backward(g_r_y, g_u_y, u_y, st["norm1"], sk)
    u_hat = st["u_hat"]
    g_a_m, g_u1, g_a, g_u = _gyroadd_backward(g_z1, -u_hat.unsqueeze(-2), st["saved1"])
    g_a_m = g_a_m.sum(-1)
    g_u_hat = -g_u1.squeeze(-2)
    # dispersion
    g_c = (g_variance * (k / tokens)).unsqueeze(-1) * distance_slope(st["c"], st["asinh_s"], st["root"])
    sinh_a, cosh_a, chord = st["sinh_a"], st["cosh_a"], st["chord"]
    g_a = g_a + g_c * (st["sinh_x"] + cosh_a * st["sinh_m"].unsqueeze(-1) * chord)
    g_a_m = g_a_m + (g_c * (sinh_a * st["cosh_m"].unsqueeze(-1) * chord - st["sinh_x"])).sum(-1)
    g_chord = g_c * sinh_a * st["sinh_m"].unsqueeze(-1)
    g_u_hat = g_u_hat - (g_chord.unsqueeze(-2) @ st["diff"]).squeeze(-2)
    # centroid (Eq. 22): T, E, S with weights 1/N; S is stationary in u_hat
    g_t, g_e, g_v, _ = centroid_row_gradients(g_a_m / sk, g_u_hat, st["big_t"], st["big_e"], st["big_s"],
                                              st["v_norm"], st["a_m"], u_hat, k)
    g_chord = g_chord + (g_e / tokens).unsqueeze(-1) * sinh_a
    u = st["u"]
    g_a = g_a + (g_t.unsqueeze(-1) * sinh_a - g_e.unsqueeze(-1) * st["exp_a"] + g_e.unsqueeze(-1) * cosh_a * chord
                 + cosh_a * (u @ g_v.unsqueeze(-1)).squeeze(-1)) / tokens
    g_u = g_u + g_chord.unsqueeze(-1) * st["diff"] + sinh_a.unsqueeze(-1) * g_v.unsqueeze(-2) / tokens
    return torch.cat([(g_a / sk).unsqueeze(-1), g_u], dim=-1), g_log_gain, g_bias


_GYRO_NORM_WIDE = ("u", "diff", "u_y", "u_out", "saved1", "saved2")  # rebuilt by _gyro_norm_rebuild


def _gyro_norm_rebuild(p: Tensor, out: Tensor, small: dict, k: float) -> dict:
    """The intermediates of :func:`_gyro_norm_forward` from its input, output and per-token / per-sample
    scalars: the token-by-coordinate tensors are recomputed with the same operations (a few passes)
    instead of saved or recomputed with the whole forward."""
    st = dict(small, u=p[..., 1:], u_out=out[..., 1:])
    u_hat = st["u_hat"]
    st["diff"] = p[..., 1:] - u_hat.unsqueeze(-2)
    saved1 = tuple(small[f"saved1_{i}"] for i in range(11))
    d, v_perp, z1 = _gyroadd_vectors(-u_hat.unsqueeze(-2), st["u"], saved1)
    st["saved1"] = saved1[:6] + (d, saved1[7], v_perp) + saved1[9:]
    st["u_y"] = _polar_from_z(z1, math.sqrt(k))[1]
    saved2 = {}
    if "near_0" in small:
        saved2["near"] = tuple(small[f"near_{i}"] for i in range(5))
    if "far_x" in small:
        far_x, far_norm = small["far_x"], small["far_norm"]
        saved2["far_x"] = (far_x, far_norm)
        saved2["far"] = _gyroadd_z(torch.asinh(far_norm), far_x / far_norm, st["b"], st["u_y"])[1]
    st["saved2"] = saved2
    return st


def _gyro_norm_small(st: dict) -> dict:
    """The per-token and per-sample scalars of the intermediates of :func:`_gyro_norm_forward` (what
    :func:`_gyro_norm_rebuild` needs besides the input and the output)."""
    small = {name: value for name, value in st.items() if name not in _GYRO_NORM_WIDE}
    small.update({f"saved1_{i}": value for i, value in enumerate(st["saved1"]) if i not in (6, 8)})
    small["saved1_6"] = small["saved1_8"] = None  # d, v_perp: rebuilt
    if "near" in st["saved2"]:
        small.update({f"near_{i}": value for i, value in enumerate(st["saved2"]["near"])})
    if "far" in st["saved2"]:
        small["far_x"], small["far_norm"] = st["saved2"]["far_x"]
    return small


def _gyro_norm_saved(p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> tuple[Tensor, dict]:
    """The output of :func:`_gyro_norm_forward` and the scalars its backward keeps (:func:`_gyro_norm_small`)."""
    out, state = _gyro_norm_forward(p, log_gain, bias, k, eps)
    return out, _gyro_norm_small(state)


def _gyro_norm_gradients(grad: Tensor, p: Tensor, out: Tensor, log_gain: Tensor, bias: Tensor, small: dict, k: float,
                         eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :class:`FusedGyroLayerNorm` from its input, output and saved scalars
    (:func:`_gyro_norm_rebuild`, :func:`_gyro_norm_backward`)."""
    return _gyro_norm_backward(grad, log_gain, bias, k, eps, _gyro_norm_rebuild(p, out, small, k))


class FusedGyroLayerNorm(torch.autograd.Function):
    r"""Gyro layer normalisation (Sec. 4.4) as one function: ``b (+) (gamma / sqrt(sigma^2 + eps) (x) ((-)m (+) x))``.

    ``m`` is the polar centroid of the sample's tokens (Eq. 22), ``sigma^2`` their mean squared
    distance to it (Eq. 5, the chords shared with the centroid's ``S``), the centring uses Eq. 21
    and the bias point Eq. 20 (``geometry.gyroadd_space``).  Saved: the input, the output,
    ``log_gain``, the bias point and the per-token / per-sample scalars of the forward pass; the
    backward pass rebuilds the token-by-coordinate intermediates from them (:func:`_gyro_norm_rebuild`)
    and differentiates by hand (:func:`_gyroadd_backward`, :func:`centroid_row_gradients`,
    :func:`distance_slope`).  Forward and backward are each one compiled kernel when training in float32
    on the CPU (:func:`use_kernels`).
    """

    @staticmethod
    def forward(ctx, p, log_gain, bias, k, eps, training):  # noqa: D102
        out, small = run_maybe_compiled(_gyro_norm_saved, training, p, p, log_gain, bias, k, eps)
        ctx.names = list(small)
        ctx.save_for_backward(p, log_gain, bias, out, *small.values())
        ctx.k, ctx.eps = k, eps
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        p, log_gain, bias, out, *small = ctx.saved_tensors
        g_p, g_log_gain, g_bias = run_maybe_compiled(_gyro_norm_gradients, True, p, grad.contiguous(), p, out,
                                                     log_gain, bias, dict(zip(ctx.names, small)), ctx.k, ctx.eps)
        return g_p, g_log_gain, g_bias, None, None, None


def fused_gyro_layer_norm(p: Tensor, log_gain: Tensor, bias: Tensor, k: float, eps: float) -> Tensor:
    """Gyro layer norm of ``p (B, N, n+1)`` over its tokens; see :class:`FusedGyroLayerNorm`."""
    return FusedGyroLayerNorm.apply(p, log_gain, bias, float(k), float(eps), _training(p, log_gain, bias))


# --------------------------------------------------------------------------------------------
# relative position encodings on the reserved axes (Eq. 10, 11, App. C; HoPE boost; HOPE rotation)
# --------------------------------------------------------------------------------------------
def _horoshift_scalars(x: list[Tensor], rest: Tensor, nu: Tensor, t: Tensor, ideal: int, shift: int) -> list[Tensor]:
    """One horospherical shift (Eq. 10, :func:`geometry.horoshift`) on the four reserved coordinates.

    ``x`` holds the reserved space coordinates ``x_0..x_3`` over ``sqrt(k)``, ``rest`` the sum of
    squares of all the others and ``nu`` the Busemann coordinate over ``sqrt(k)`` (:func:`_busemann`).
    ``x_shift += t nu`` and ``x_ideal = ((1 + |rest of x|^2) / nu - nu) / 2``: sums of non-negative terms.
    """
    others = [x[c].square() for c in range(4) if c not in (ideal, shift)]
    moved = x[shift] + t * nu
    out = list(x)
    out[shift] = moved
    out[ideal] = 0.5 * ((1.0 + rest + others[0] + others[1] + moved.square()) / nu - nu)
    return out


def _busemann(exp_minus_a: Tensor, scale: Tensor, y: list[Tensor], rest: Tensor, norm: Tensor, ideal: int) -> Tensor:
    """``nu / sqrt(k) = e^{-a} + scale (|y| - y_ideal)`` (Eq. 10, :func:`geometry.busemann_nu`).

    ``|y| - y_ideal = (|y|^2 - y_ideal^2) / (|y| + y_ideal)`` for ``y_ideal >= 0`` (the numerator summed
    from the other coordinates, ``rest`` their tail), else ``|y| - y_ideal``: no cancellation.
    ``y`` is the unit direction (``scale = sinh a``, ``norm = 1``) or the space coordinates
    (``scale = 1``, ``norm = |y|``).
    """
    off_axis = rest + sum(y[c].square() for c in range(4) if c != ideal)
    denom = norm + y[ideal].abs()  # 0 only at the origin, where the numerator is 0 too
    gap = torch.where(y[ideal] >= 0, off_axis / torch.where(denom > 0, denom, torch.ones_like(denom)),
                      norm - y[ideal])
    return exp_minus_a + scale * gap


def _safe_sqrt(sq: Tensor) -> Tensor:
    """``sqrt(sq)`` with a zero (sub)gradient at ``sq = 0`` (as ``geometry._safe_norm``)."""
    positive = sq > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, sq, torch.ones_like(sq))), torch.zeros_like(sq))


def _boost_scalars(x: list[Tensor], cosh_a: Tensor, t: Tensor, axis: int) -> list[Tensor]:
    """Lorentz boost of rapidity ``t`` along ``axis`` (:func:`geometry.boost`):
    ``x_i <- sinh t cosh a + cosh t x_i``."""
    sinh_t, cosh_t = sinh_cosh_smooth(t)  # differentiated by autograd; (N, H)-sized
    out = list(x)
    out[axis] = sinh_t * cosh_a + cosh_t * x[axis]
    return out


def _reserved_axes_scalars(kind: str, r: Tensor, u4: Tensor, rest_sq: Tensor, t_rows: Tensor, t_cols: Tensor,
                           sqrt_k: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token scalar part of the 2-D encoding: ``(r', u'_0..3 (4, ...), scale)`` with ``u'_m = scale u_m``
    for ``m >= 4``.

    ``u4 (4, ...)`` holds the reserved direction coordinates (coordinate first: each one contiguous),
    ``rest_sq`` the sum of squares of the others.
    """
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
        norm = _safe_sqrt(rest + sum(c.square() for c in x))
        exp_minus = 1.0 / (torch.sqrt(1.0 + norm.square()) + norm)  # e^{-a} of the shifted point
        x = _horoshift_scalars(x, rest, _busemann(exp_minus, 1.0, x, rest, norm, 2), t_cols, 2, 3)
    else:  # boost (HoPE) along axes 0 and 2
        x = _boost_scalars(x, cosh_a, t_rows, 0)
        norm = _safe_sqrt(rest + sum(c.square() for c in x))
        x = _boost_scalars(x, torch.sqrt(1.0 + norm.square()), t_cols, 2)
    norm = _safe_sqrt(rest + sum(c.square() for c in x))
    nonzero = norm > 0
    inv = 1.0 / torch.where(nonzero, norm, torch.ones_like(norm))
    e_0 = torch.zeros_like(u4)
    e_0[0] = 1.0  # the origin: direction e_0, zero gradient (as geometry.safe_normalize)
    direction = torch.where(nonzero, torch.stack(x) * inv, e_0)
    asinh_norm = torch.log1p(norm + norm.square() / (1.0 + torch.sqrt(1.0 + norm.square())))
    return sqrt_k * asinh_norm, direction, torch.where(nonzero, sinh_a * inv, torch.zeros_like(norm))


def _reserved_axes_scalar_gradients(kind: str, r: Tensor, u4: Tensor, rest_sq: Tensor, t_rows: Tensor,
                                    t_cols: Tensor, sqrt_k: float, grads: tuple[Tensor, Tensor, Tensor]) -> tuple:
    """``(scale, gradients)``: the ``scale`` output of :func:`_reserved_axes_scalars` and its gradients with
    respect to ``(r, u4, rest_sq, t_rows, t_cols)`` for the incoming ``grads`` of its three outputs; the
    forward recomputed and differentiated by ``torch.func.vjp`` (one compiled kernel when training in
    float32 on the CPU: nothing saved, no autograd graph)."""
    outputs, vjp = torch.func.vjp(lambda *args: _reserved_axes_scalars(kind, *args, sqrt_k), r, u4, rest_sq, t_rows,
                                  t_cols)
    return outputs[2], vjp(grads)


class FusedReservedAxesEncoding(torch.autograd.Function):
    r"""The 2-D relative position encoding of every head (``horoshift`` Eq. 10 / ``boost`` / ``rotation``) as one
    function.

    The two moves (rows on the reserved axes ``(0, 1)``, columns on ``(2, 3)``) change only the
    four reserved coordinates and the radius; every other space coordinate ``x_m = sqrt(k) sinh a u_m``
    is unchanged, so its direction coordinate is only rescaled, ``u'_m = (sinh a / sinh a') u_m``.
    The per-token scalars (radius, four coordinates, the sum of squares of the others) carry the
    whole computation (:func:`_reserved_axes_scalars`, on contiguous ``(B, N, H)`` tensors; a compiled
    kernel when training in float32 on the CPU); the ``d``-wide vectors are touched once forward and
    once backward.  Saved: the input; backward recomputes the scalar part and differentiates it with
    ``torch.func.vjp`` (:func:`_reserved_axes_scalar_gradients`), the vector part by hand.
    """

    @staticmethod
    def forward(ctx, p, t_rows, t_cols, kind, sqrt_k, training):  # noqa: D102
        u_rest = p[..., 5:]
        scalars = (p[..., 0].contiguous(), p[..., 1:5].movedim(-1, 0).contiguous(), u_rest.square().sum(-1))
        r_out, u4, scale = run_maybe_compiled(_reserved_axes_scalars, training, p, kind, *scalars, t_rows,
                                              t_cols, sqrt_k)
        ctx.save_for_backward(p, t_rows, t_cols)
        ctx.kind, ctx.sqrt_k = kind, sqrt_k
        return torch.cat([r_out.unsqueeze(-1), u4.movedim(0, -1), u_rest * scale.unsqueeze(-1)], dim=-1)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        p, t_rows, t_cols = ctx.saved_tensors
        u_rest, g_rest = p[..., 5:], grad[..., 5:]
        scalars = (p[..., 0].contiguous(), p[..., 1:5].movedim(-1, 0).contiguous(), u_rest.square().sum(-1))
        outputs = (grad[..., 0].contiguous(), grad[..., 1:5].movedim(-1, 0).contiguous(), (g_rest * u_rest).sum(-1))
        scale, (g_r, g_u4, g_rest_sq, g_t_rows, g_t_cols) = run_maybe_compiled(
            _reserved_axes_scalar_gradients, True, p, ctx.kind, *scalars, t_rows, t_cols,
            ctx.sqrt_k, outputs)
        g_p = torch.cat([g_r.unsqueeze(-1), g_u4.movedim(0, -1),
                         torch.addcmul(g_rest * scale.unsqueeze(-1), u_rest, 2.0 * g_rest_sq.unsqueeze(-1))], dim=-1)
        return g_p, g_t_rows, g_t_cols, None, None, None


def fused_reserved_axes_encoding(p: Tensor, t_rows: Tensor, t_cols: Tensor, kind: str, sqrt_k: float) -> Tensor:
    """Relative position encoding of ``p (B, N, H, d+1)`` with per-token, per-head moves ``t (N, H)``."""
    return FusedReservedAxesEncoding.apply(p, t_rows, t_cols, kind, float(sqrt_k), _training(p, t_rows, t_cols))


# --------------------------------------------------------------------------------------------
# boost residual (Eq. 12)
# --------------------------------------------------------------------------------------------
def _boost_residual_forward(x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float):
    """Forward of :class:`FusedBoostResidual`: the output ``(B, N, n+1)`` and the intermediates of its backward."""
    u, v = x[..., 1:], f[..., 1:]
    a = x[..., 0] / sqrt_k
    b = f[..., 0] / sqrt_k
    if strength is not None:
        b = b * strength
    # v_perp = d + s h u with d = v - s u, h = |d|^2 / 2, s = sign(u . v) (geometry.perp)
    cos = (u * v).sum(-1)
    sign = torch.where(cos >= 0, 1.0, -1.0).to(v.dtype)
    d = v - sign.unsqueeze(-1) * u
    h = 0.5 * d.square().sum(-1)
    v_perp = torch.addcmul(d, (sign * h).unsqueeze(-1), u)
    b_par = b * cos
    a_new = a + alpha * (b_par - b_par.mean(-1, keepdim=True))
    step = alpha * b  # the perpendicular step is step * v_perp
    omega_sq = step.square() * v_perp.square().sum(-1)
    small = omega_sq < 1e-8  # as geometry.cosh_sinhc_sq
    w = torch.sqrt(torch.where(small, torch.ones_like(omega_sq), omega_sq))
    sinh_w, cosh_w = sinh_cosh(w)
    sinhc = torch.where(small, 1.0 + omega_sq / 6.0, sinh_w / w)
    tanh_a = torch.tanh(a)
    big_d = torch.addcmul(tanh_a.unsqueeze(-1) * u, (sinhc * step).unsqueeze(-1), v_perp)
    norm = torch.linalg.vector_norm(big_d, dim=-1)
    nonzero = norm > 0
    direction = big_d / torch.where(nonzero, norm, torch.ones_like(norm)).unsqueeze(-1)
    direction[..., 0] = torch.where(nonzero, direction[..., 0], torch.ones_like(norm))
    flip = torch.where(a_new < 0, -1.0, 1.0).to(direction.dtype)
    out = torch.cat([(sqrt_k * a_new.abs()).unsqueeze(-1), flip.unsqueeze(-1) * direction], dim=-1)
    state = dict(u=u, v=v, b=b, cos=cos, sign=sign, d=d, h=h, v_perp=v_perp, b_par=b_par, step=step,
                 omega_sq=omega_sq, small=small, w=w, cosh_w=cosh_w, sinhc=sinhc, tanh_a=tanh_a, norm=norm,
                 direction=direction, flip=flip, a_new=a_new)
    return out, state


def _boost_residual_backward(grad: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float, st: dict):
    """``(dL/dx, dL/df, dL/dalpha)`` of :func:`_boost_residual_forward`."""
    u, v, b, sign, d, v_perp, step = st["u"], st["v"], st["b"], st["sign"], st["d"], st["v_perp"], st["step"]
    flip = st["flip"]
    g_a_new = grad[..., 0] * sqrt_k * torch.sign(st["a_new"])  # d|a'|/da' = sign(a') (0 at 0, as torch.abs)
    g_dir = grad[..., 1:] * flip.unsqueeze(-1)
    # direction = D / |D| with D = tanh(a) u + sinhc(omega) step v_perp
    norm, direction = st["norm"], st["direction"]
    nonzero = norm > 0
    inv = torch.where(nonzero, 1.0 / torch.where(nonzero, norm, torch.ones_like(norm)), torch.zeros_like(norm))
    g_big_d = (g_dir - (g_dir * direction).sum(-1, keepdim=True) * direction) * inv.unsqueeze(-1)
    tanh_a, sinhc = st["tanh_a"], st["sinhc"]
    g_a = (1.0 - tanh_a.square()) * (g_big_d * u).sum(-1)
    g_u = tanh_a.unsqueeze(-1) * g_big_d
    g_vperp_dot = (g_big_d * v_perp).sum(-1)  # dL/d(sinhc step) per token
    # sinhc(omega) as a function of omega^2: d sinhc / d omega^2 = (cosh w - sinhc) / (2 w^2)
    omega_sq = st["omega_sq"]
    slope = torch.where(st["small"], torch.full_like(omega_sq, 1.0 / 6.0),
                        (st["cosh_w"] - sinhc) / (2.0 * torch.where(st["small"], torch.ones_like(omega_sq), omega_sq)))
    g_omega_sq = g_vperp_dot * step * slope
    vperp_sq = v_perp.square().sum(-1)
    g_step = g_vperp_dot * sinhc + g_omega_sq * 2.0 * step * vperp_sq
    g_vperp = (sinhc * step).unsqueeze(-1) * g_big_d + (g_omega_sq * 2.0 * step.square()).unsqueeze(-1) * v_perp
    # a' = a + alpha (b_par - mean b_par), b_par = b (u . v), step = alpha b
    b_par = st["b_par"]
    g_a = g_a + g_a_new
    g_b_par = alpha * (g_a_new - g_a_new.mean(-1, keepdim=True))
    g_alpha = (g_a_new * (b_par - b_par.mean(-1, keepdim=True))).sum() + (g_step * b).sum()
    g_b = g_b_par * st["cos"] + g_step * alpha
    g_cos = g_b_par * b
    # v_perp = d + s h u, h = |d|^2 / 2, d = v - s u
    g_h = sign * (g_vperp * u).sum(-1)
    g_d = torch.addcmul(g_vperp, g_h.unsqueeze(-1), d)
    g_u = g_u + (sign * st["h"]).unsqueeze(-1) * g_vperp - sign.unsqueeze(-1) * g_d + g_cos.unsqueeze(-1) * v
    g_v = g_d + g_cos.unsqueeze(-1) * u
    if strength is not None:
        g_b = g_b * strength
    g_x = torch.cat([(g_a / sqrt_k).unsqueeze(-1), g_u], dim=-1)
    g_f = torch.cat([(g_b / sqrt_k).unsqueeze(-1), g_v], dim=-1)
    return g_x, g_f, g_alpha


def _boost_residual_output(x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float) -> Tensor:
    """The output of :func:`_boost_residual_forward` alone."""
    return _boost_residual_forward(x, f, alpha, strength, sqrt_k)[0]


def _boost_residual_gradients(grad: Tensor, x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None,
                              sqrt_k: float):
    """The forward recomputed, then :func:`_boost_residual_backward`: ``(dL/dx, dL/df, dL/dalpha)``."""
    return _boost_residual_backward(grad, alpha, strength, sqrt_k, _boost_residual_forward(x, f, alpha, strength,
                                                                                           sqrt_k)[1])


class FusedBoostResidual(torch.autograd.Function):
    r"""The boost residual of Eq. 12 as one function: ``a' = a + alpha (b_par - mean_N b_par)``,
    ``u' = normalize(tanh(a) u + sinhc(alpha b |v_perp|) alpha b v_perp)`` with ``b_par = b (u . v)`` and the
    stable ``v_perp`` of :func:`geometry.perp`; a negative ``a'`` flips the direction.

    Saved: the two inputs, ``alpha`` and the stochastic-depth strength; backward recomputes the
    per-token forward and differentiates it by hand.
    """

    @staticmethod
    def forward(ctx, x, f, alpha, strength, sqrt_k, training):  # noqa: D102
        out = run_maybe_compiled(_boost_residual_output, training, x, x, f, alpha, strength, sqrt_k)
        ctx.save_for_backward(x, f, alpha, strength)
        ctx.sqrt_k = sqrt_k
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, f, alpha, strength = ctx.saved_tensors
        g_x, g_f, g_alpha = run_maybe_compiled(_boost_residual_gradients, True, x, grad, x, f, alpha, strength,
                                               ctx.sqrt_k)
        return g_x, g_f, g_alpha, None, None, None


def fused_boost_residual(x: Tensor, f: Tensor, alpha: Tensor, strength: Tensor | None, sqrt_k: float) -> Tensor:
    """Boost residual (Eq. 12) of ``x, f (B, N, n+1)``; ``strength (B, 1)`` or ``None``.

    See :class:`FusedBoostResidual`.
    """
    return FusedBoostResidual.apply(x, f, alpha, strength, float(sqrt_k), _training(x, f, alpha))
