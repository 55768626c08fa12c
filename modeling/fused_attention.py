"""The fused polar attention core (Eq. 5, 9, 22, 25): scores, softmax and centroid in one autograd Function.

:class:`FusedPolarAttention` computes the attention of every ``(batch, head)`` slice without keeping anything of
size ``N x M`` for backward: it saves the inputs, the output and per-row scalars, and its hand-derived backward
recomputes the rest.  The slices are processed in blocks whose temporaries stay cache-sized
(:func:`group_elements`; :class:`Block`): groups of samples, or at long sequences one sample's heads or one head's
query rows, so that its memory is bounded at any length.  Each
block is computed by one pure function: a compiled kernel in float32 on the CPU (:mod:`cpu_kernels`).
:class:`FusedPolarAttentionHeads` runs the same core on the heads as the attention layer holds them (token-major
and packed, queries and keys side by side) and writes its output and the gradients of its inputs in those
layouts; :class:`FusedAmbientAttention` and :class:`FusedAmbientAttentionHeads` are the ambient twin's.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and sibling modules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .ambient import (
    acosh_slope,
    lorentz_normalize,
    lorentz_normalize_backward,
    norm_floor,
    pairwise_minus_inner,
)
from .cpu_kernels import first_order, run_maybe_compiled
from .geometry import centroid_radius
from .operators import fused_apply, registered_operators
from .runtime import runtime_options
from .stable_math import (
    distance_slope,
    exp_weights,
    kernel_acosh,
    pair_cosh_minus_one,
    pair_sinh,
    safe_normalize,
    sinh_cosh,
)

CHORD_PRODUCT_ABOVE = 1e-6  # chords from a float64 inner product at and above this value (error <= 2e-9 relative)
PAIR_TERMS = 2  # per-pair terms the group backward returns last, so that its kernel stores them once
GROUP_ELEMENTS = (1 << 19, 1 << 20)  # the fewest and the most score elements of a block of the automatic size
GROUP_SLICES = 24  # (batch, head) slices a block of the automatic size holds where the most elements allow

__all__ = [
    "CHORD_PRODUCT_ABOVE",
    "GROUP_ELEMENTS",
    "GROUP_SLICES",
    "PAIR_TERMS",
    "FusedAmbientAttention",
    "FusedAmbientAttentionHeads",
    "FusedPolarAttention",
    "FusedPolarAttentionHeads",
    "AmbientScores",
    "Block",
    "CentredValues",
    "ambient_scores",
    "centroid_row_gradients",
    "chord_operands",
    "fused_ambient_attention",
    "fused_ambient_attention_heads",
    "fused_polar_attention",
    "fused_polar_attention_heads",
    "group_elements",
    "head_major",
    "narrow_product",
    "pair_chords",
    "radius_differences",
    "row_gradients",
    "stationarity_correction",
]


# --------------------------------------------------------------------------------------------
# chords and distances of all pairs of a group
# --------------------------------------------------------------------------------------------
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

    Float64, inside a compiled kernel and off the CPU: the exact coordinate differences, one square-add per
    coordinate (a compiled kernel runs them as one loop over ``M``; on a GPU no value is read back to choose the
    pairs).  Float32 / half, eager on the CPU: one float64 product of the
    :func:`chord_operands`, whose absolute error (``~d 2^-53``) is below ``2e-9`` of every chord
    ``>= CHORD_PRODUCT_ABOVE``, so the rounded result is the float32 value of the exact chord; the few pairs
    below that (nearly equal directions) are recomputed from their coordinate differences.
    """
    if u.dtype == torch.float64 or torch.compiler.is_compiling() or u.device.type != "cpu":
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


def narrow_product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` ``(G, N, w)`` for pair weights ``a (G, N, M)`` and a narrow ``b (G, M, w)`` (``w`` about the head
    width: ``d + 1``, ``d + 2``, ``2 d + 2``), computed as ``(b^T a^T)^T``: the product then runs along the ``N``
    rows, which fill the CPU's vector registers, instead of along ``w``, whose ``d + 1`` or ``d + 2`` columns leave
    most of a vector register empty; the result is a transposed view."""
    return torch.bmm(b.transpose(-1, -2), a.transpose(-1, -2)).transpose(-1, -2)


class RowScalars(NamedTuple):
    """The per-slice quantities of :class:`AttentionRows`, all contiguous ``(B, H, ...)`` (a group's ``(G, ...)``):
    radii over ``sqrt(k)`` (``a`` queries, ``b`` keys, ``beta`` values), their hyperbolic functions, ``e^{+-a}``
    and ``e^{+-b}`` (whose products are every pair's ``e^{+-(a_i - b_j)}``, :func:`stable_math.pair_cosh_minus_one`),
    ``e^{-beta}``, the per-slice ``scale`` and ``sqrt(4 k scale)``."""

    a: Tensor
    b: Tensor
    beta: Tensor
    sinh_a: Tensor
    cosh_a: Tensor
    exp_a: Tensor
    exp_minus_a: Tensor
    sinh_b: Tensor
    cosh_b: Tensor
    exp_b: Tensor
    exp_minus_b: Tensor
    sinh_beta: Tensor
    cosh_beta: Tensor
    exp_beta: Tensor
    scale: Tensor
    root_coef: Tensor


class GroupRows(NamedTuple):
    """One group of ``G`` contiguous ``(batch, head)`` slices: directions (keys and values also transposed to
    ``(G, d, M)``) and the group's :class:`RowScalars`."""

    uq: Tensor
    uk: Tensor
    uv: Tensor
    uk_t: Tensor
    uv_t: Tensor
    scalars: RowScalars


class PairDistances(NamedTuple):
    """Eq. 5 for all pairs of a group (all ``(G, N, M)``): the scaled distance ``w`` (the score is ``-w^2``),
    ``asinh s``, ``s^2 = c/2`` and ``sqrt(1 + s^2)``."""

    w: Tensor
    asinh_s: Tensor
    s_sq: Tensor
    root: Tensor


class RowStatistics(NamedTuple):
    """What the forward keeps per row for backward: ``log-sum-exp`` of the scores, the softmax-normalised sums
    ``T, E, S`` and ``||V||`` (Eq. 22), the centroid radius over ``sqrt(k)`` and direction."""

    lse: Tensor
    big_t: Tensor
    big_e: Tensor
    big_s: Tensor
    v_norm: Tensor
    a_mu: Tensor
    u_hat: Tensor


def radius_differences(rows: GroupRows) -> tuple[Tensor, Tensor, Tensor]:
    """``(a_i - b_j, e^{a_i - b_j}, e^{b_j - a_i})`` ``(G, N, M)`` for all pairs of a group, the exponentials as
    products of the rows' (:func:`stable_math.pair_cosh_minus_one`, :func:`stable_math.pair_sinh`)."""
    row = rows.scalars
    return (
        row.a.unsqueeze(-1) - row.b.unsqueeze(-2),
        row.exp_a.unsqueeze(-1) * row.exp_minus_b.unsqueeze(-2),
        row.exp_minus_a.unsqueeze(-1) * row.exp_b.unsqueeze(-2),
    )


def scaled_distances(chord: Tensor, rows: GroupRows) -> PairDistances:
    """Eq. 5 for all pairs of a group from their chords: ``c / 2 = s^2 = 1/2 (cosh(a_i - b_j) - 1) + 1/2 sinh a_i
    sinh b_j chord_ij`` (every term non-negative; the first from the radii's exponentials and a series,
    :func:`stable_math.pair_cosh_minus_one`: no transcendental function per pair), ``asinh s`` in its non-negative
    form (:func:`stable_math.asinh_nonneg`, spelled with ``addcdiv``) and ``w = sqrt(4 k scale) asinh s`` (Eq. 9)."""
    row = rows.scalars
    cosh_minus = pair_cosh_minus_one(*radius_differences(rows))
    s_sq = torch.addcmul(0.5 * cosh_minus, chord * (0.5 * row.sinh_b).unsqueeze(-2), row.sinh_a.unsqueeze(-1))
    root = torch.sqrt(1.0 + s_sq)
    asinh_s = torch.log1p(torch.addcdiv(torch.sqrt(s_sq), s_sq, 1.0 + root))
    return PairDistances(asinh_s * row.root_coef, asinh_s, s_sq, root)


def value_operand(rows: GroupRows) -> Tensor:
    """``[cosh beta, e^{-beta}, sinh beta v]`` ``(G, M, d+2)``: the operand of the centroid sums (Eq. 22), built
    inside the group's function (a compiled kernel: no pass of its own)."""
    row = rows.scalars
    return torch.cat(
        [row.cosh_beta.unsqueeze(-1), row.exp_beta.unsqueeze(-1), rows.uv * row.sinh_beta.unsqueeze(-1)], dim=-1
    )


# --------------------------------------------------------------------------------------------
# the centroid's row gradients (Eq. 22), shared with the chunked and Triton cores
# --------------------------------------------------------------------------------------------
def centroid_row_gradients(
    grad_r: Tensor,
    grad_u: Tensor,
    big_t: Tensor,
    big_e: Tensor,
    big_s: Tensor,
    v_norm: Tensor,
    a_mu: Tensor,
    u_hat: Tensor,
    k: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of the centroid radius (Eq. 22) to the sums ``T, E, S`` (``g_S = g_E``) and the vector ``V``.

    With ``l = ln ||V|| - 1/2 ln(E + S) - 1/2 ln(T + ||V||)`` and ``d a_mu / d l = tanh(a_mu)``, returns
    ``(g_T, g_E, g_V, row_dot)`` where ``row_dot = g_T T + g_V . V + g_E (E + S)`` is the row constant of the
    softmax backward when the sums are softmax-weighted.  Rows with ``V = 0`` (the origin) get zero gradients.
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


class CentredValues(NamedTuple):
    """Per row, softmax-normalised: ``W = sum_j p_ij sinh b_j`` and ``sum_j p_ij sinh b_j (v_j - v_bar)``, with the
    centre ``v_bar`` (the mean value direction) they were summed about."""

    weight: Tensor
    centred: Tensor
    v_bar: Tensor


def stationarity_correction(g_v: Tensor, g_e: Tensor, u_hat: Tensor, v_norm: Tensor, values: CentredValues) -> Tensor:
    """``g_V`` plus the derivative of ``S`` (Eq. 22) through ``u_hat = V / ||V||``.

    ``S = sum_j w_ij 1/2 ||v_j - u_hat||^2`` (``w_ij = p_ij sinh b_j``) is stationary in ``u_hat`` in exact
    arithmetic only: ``dS/du_hat = W (u_hat - v_bar) - sum_j w_ij (v_j - v_bar)`` measures the rounding of
    ``u_hat``.  Carried back through ``u_hat`` (the tangential projection over ``||V||``) it cancels that rounding
    in ``dL/dv_j``, where ``g_S w_ij (v_j - u_hat)`` carries it with the factor ``g_S``, which grows without bound
    as ``E + S -> 0`` (clustered values far out).  Centred differences (Eq. 25) keep it exact for clustered values.
    """
    drift = g_e.unsqueeze(-1) * (values.weight.unsqueeze(-1) * (u_hat - values.v_bar) - values.centred)
    drift = drift - (drift * u_hat).sum(-1, keepdim=True) * u_hat
    return g_v + drift / torch.where(v_norm > 0, v_norm, 1.0).unsqueeze(-1)


def row_gradients(
    grad_r: Tensor,
    grad_u: Tensor,
    stats: Tensor,
    a_mu: Tensor,
    u_hat: Tensor,
    values: CentredValues,
    k: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-row partials of an attention output with respect to its softmax-normalised sums (chunked, Triton).

    ``stats`` holds ``(m, l, T, E, S, ||V||)`` per row (sums divided by the softmax denominator ``l``); returns
    ``(g_T, g_E, g_S, g_V, sum_j p_ij g_p_ij)`` from :func:`centroid_row_gradients` (``g_S = g_E``), ``g_V`` with
    :func:`stationarity_correction` (orthogonal to ``V``: the row constant is unchanged).
    """
    _, _, big_t, big_e, big_s, v_norm = stats
    g_t, g_e, g_v, row_dot = centroid_row_gradients(grad_r, grad_u, big_t, big_e, big_s, v_norm, a_mu, u_hat, k)
    g_v = stationarity_correction(g_v, g_e, u_hat, v_norm, values)
    return g_t, g_e, g_e, g_v, row_dot


# --------------------------------------------------------------------------------------------
# one group of slices, forward and backward (pure functions: compiled kernels on the CPU)
# --------------------------------------------------------------------------------------------
def _attention_group_forward(rows: GroupRows) -> RowStatistics:
    """Forward of :class:`FusedPolarAttention` on one group: the :class:`RowStatistics` it keeps, the centroid's
    radius and direction among them; the softmax unnormalised (``exp(w_min^2 - w^2)``, sums divided by the row
    total: one exp pass, no ``logsumexp``)."""
    w = scaled_distances(pair_chords(rows.uq, rows.uk_t), rows).w
    w_min_sq = w.amin(-1, keepdim=True).square()  # the largest score is -w_min^2
    probs = exp_weights(w_min_sq - w.square())
    total = probs.sum(-1, keepdim=True)
    sums = narrow_product(probs, value_operand(rows)) / total  # (G, N, d+2): T, E, V
    v_norm = torch.linalg.vector_norm(sums[..., 2:], dim=-1)
    u_hat = safe_normalize(sums[..., 2:], v_norm)
    weighted = pair_chords(u_hat, rows.uv_t).mul_(probs).mul_(rows.scalars.sinh_beta.unsqueeze(-2))
    total = total.squeeze(-1)
    big_t, big_e, big_s = sums[..., 0], sums[..., 1], weighted.sum(-1) / total
    a_mu = centroid_radius(big_t, big_e, big_s, v_norm, v_norm <= 0)
    return RowStatistics(torch.log(total) - w_min_sq.squeeze(-1), big_t, big_e, big_s, v_norm, a_mu, u_hat)


def _centre(u: Tensor) -> Tensor:
    """Mean direction ``(G, 1, d)`` for the centred chord gradient (Eq. 25), summed in float64: identical
    directions then give exactly their own value, so their centred differences vanish."""
    return u.double().mean(dim=-2, keepdim=True).to(u.dtype) if u.dtype != torch.float64 else u.mean(-2, keepdim=True)


def _attention_group_backward(
    rows: GroupRows,
    saved: RowStatistics,
    grad_r: Tensor,
    grad_u: Tensor,
    k: float,
) -> tuple[Tensor, ...]:
    """Backward of :class:`FusedPolarAttention` on one group (formulas in its docstring): gradients of ``(rq, uq,
    rk, uk, rv, uv)``, the per-slice scale gradient (all ``(G, ...)``) and, last, the pairs' ``sinh(a_i - b_j)`` and
    ``dD^2/dc`` ``(G, N, M)``, which the caller drops: as outputs, a compiled kernel stores them in the loop that
    evaluates Eq. 5 instead of evaluating Eq. 5's series, ``sqrt`` and their divisions again in each loop that
    sums them (:data:`PAIR_TERMS`)."""
    uq, uk, uv, u_hat, v_norm = rows.uq, rows.uk, rows.uv, saved.u_hat, saved.v_norm
    row = rows.scalars
    sinh_a, sinh_b, sinh_beta = row.sinh_a, row.sinh_b, row.sinh_beta.unsqueeze(-1)
    values = value_operand(rows)
    g_t, g_e, g_v, _ = centroid_row_gradients(
        grad_r, grad_u, saved.big_t, saved.big_e, saved.big_s, v_norm, saved.a_mu, u_hat, k
    )
    # recompute Eq. 5 and the probabilities from the saved log-sum-exp
    chord = pair_chords(uq, rows.uk_t)
    d = scaled_distances(chord, rows)
    probs = exp_weights(-saved.lse.unsqueeze(-1) - d.w.square())
    sinh_x = pair_sinh(*radius_differences(rows))  # sinh(a_i - b_j)
    v_bar = _centre(uv)
    centred_v = uv - v_bar
    sums = narrow_product(probs, torch.cat([sinh_beta, sinh_beta * centred_v], dim=-1))
    g_v = stationarity_correction(g_v, g_e, u_hat, v_norm, CentredValues(sums[..., 0], sums[..., 1:], v_bar))
    # dL/dP = g_T cosh beta_j + g_E e^{-beta_j} + sinh beta_j (g_V . v_j + g_S chord(u_i, v_j))
    chord_e = pair_chords(u_hat, rows.uv_t).mul_(g_e.unsqueeze(-1))  # g_S chord(u_i, v_j)
    chord_terms = (chord_e * probs).sum(-2)  # sum_i P_ij g_S chord
    g_rows = torch.cat([g_t.unsqueeze(-1), g_e.unsqueeze(-1), g_v], dim=-1)  # (G, N, d+2)
    g_p = torch.baddbmm(chord_e.mul_(sinh_beta.transpose(-1, -2)), g_rows, values.transpose(-1, -2))
    # values: radius and direction (the value chord gradient centred on the mean value direction, Eq. 25)
    pt_g = narrow_product(probs.transpose(-1, -2), torch.cat([g_rows, g_e.unsqueeze(-1) * (u_hat - v_bar)], dim=-1))
    pt_gv, pt_gs = pt_g[..., 2 : 2 + uv.shape[-1]], pt_g[..., 2 + uv.shape[-1] :]
    g_beta = (
        sinh_beta.squeeze(-1) * pt_g[..., 0]
        - row.exp_beta * pt_g[..., 1]
        + row.cosh_beta * ((uv * pt_gv).sum(-1) + chord_terms)
    )
    g_uv = sinh_beta * (pt_gv - pt_gs + centred_v * pt_g[..., 1:2])
    # softmax, scores and the scale: score = -scale k D^2, D^2 = 4 asinh(s)^2
    g_score = (g_p - (probs * g_p).sum(-1, keepdim=True)).mul_(probs)
    g_scale = (g_score * d.asinh_s.square()).sum(dim=(1, 2)) * (-4.0 * k)
    slope = distance_slope(d.s_sq, d.asinh_s, d.root)
    g_c = g_score.mul_(slope)  # dL/d(c) / (-scale k)
    # Eq. 5: radii and chords; the chord gradient centred on the mean key direction (Eq. 25)
    g_c_sinh_x = g_c * sinh_x
    chord_g = chord.mul_(g_c)  # sums weighted by sinh b_j / sinh a_i (elementwise: matrix-vector bmm is slow)
    g_a = g_c_sinh_x.sum(-1) + row.cosh_a * (chord_g * sinh_b.unsqueeze(-2)).sum(-1)
    g_b = row.cosh_b * (chord_g * sinh_a.unsqueeze(-1)).sum(-2) - g_c_sinh_x.sum(-2)
    k_bar = _centre(uk)
    p_q, q_k = uq - k_bar, uk - k_bar
    # g_chord_ij = g_c_ij sinh a_i sinh b_j, never formed: its sums over j and i as products
    by_key = narrow_product(g_c, torch.cat([sinh_b.unsqueeze(-1), sinh_b.unsqueeze(-1) * q_k], dim=-1))  # (G, N, 1+d)
    by_query = narrow_product(
        g_c.transpose(-1, -2), torch.cat([sinh_a.unsqueeze(-1), sinh_a.unsqueeze(-1) * p_q], dim=-1)
    )
    g_uq = sinh_a.unsqueeze(-1) * (p_q * by_key[..., :1] - by_key[..., 1:])
    g_uk = sinh_b.unsqueeze(-1) * (q_k * by_query[..., :1] - by_query[..., 1:])
    c_coef = row.scale.view(-1, 1) * -k  # dL/dc = -scale k g_c
    sk = math.sqrt(k)
    return (
        g_a * (c_coef / sk),
        g_uq * c_coef.unsqueeze(-1),
        g_b * (c_coef / sk),
        g_uk * c_coef.unsqueeze(-1),
        g_beta / sk,
        g_uv,
        g_scale,
        sinh_x,
        slope,
    )


# --------------------------------------------------------------------------------------------
# the autograd Function
# --------------------------------------------------------------------------------------------
class Block(NamedTuple):
    """A block of the attention's ``(batch, head)`` slices: samples, heads and query rows, computed by one call of
    the group functions.  Every block sees all keys; the gradients of keys and values from a block of some of the
    query rows are its share of their sums over the rows."""

    samples: slice
    heads: slice = slice(None)
    rows: slice = slice(None)

    def slices(self, t: Tensor) -> Tensor:
        """The block's ``(G = g h, ...)`` slices of a per-slice tensor ``(B, H, ...)`` (keys, values, scales)."""
        return self.region(t, rows=False).flatten(0, 1)

    def queries(self, t: Tensor) -> Tensor:
        """The block's ``(G, n, ...)`` query rows of a per-row tensor ``(B, H, N, ...)``."""
        return self.region(t, rows=True).flatten(0, 1)

    def region(self, t: Tensor, rows: bool) -> Tensor:
        """The block's place ``(g, h[, n], ...)`` in a head-major tensor ``(B, H, N, ...)``: its query rows
        (``rows``) or all of its slices' rows (keys, values)."""
        return t[self.samples, self.heads, self.rows] if rows else t[self.samples, self.heads]

    @property
    def first(self) -> bool:
        """Whether the block holds its slices' first query row (it writes their key and value gradients; the
        blocks of later rows add to them)."""
        return self.rows.start in (None, 0)


def group_elements(per_head: int) -> int:
    """Score elements per block for slices of ``per_head = N M`` pairs: ``attention_group_elements`` where it is
    set, else :data:`GROUP_ELEMENTS`' fewest raised to hold :data:`GROUP_SLICES` slices, at most its most.  Fewer
    slices per block cost more than their temporaries' cache misses save, and a slice's query rows split into
    blocks cost most.  At most ``2^20``: more gains no time at 1024 tokens and raises the step's peak tensors
    (``benchmarks/attention_groups.py``)."""
    chosen = runtime_options().attention_group_elements
    if chosen is not None:
        return chosen
    fewest, most = GROUP_ELEMENTS
    return min(max(fewest, GROUP_SLICES * per_head), most)


def _blocks(queries: Tensor, keys: Tensor) -> tuple[int, list[Block]]:
    """``(B H N M, blocks)`` for queries ``(B, H, N, ...)`` and keys ``(B, H, M, ...)``: the score elements of the
    call (what decides its compiled kernels, :func:`cpu_kernels.kernel_use`) and the blocks (:class:`Block`) whose
    ``(G, n, M)`` temporaries stay cache-sized (:func:`group_elements`): groups of whole samples where one sample
    fits, else groups of one sample's heads, else one slice's query rows in blocks of near-equal size, so that
    memory stays bounded at any sequence length.  Traced (``torch.compile``, or a fused layer's operator computing
    its output shapes) one block of every slice: the compiler fuses the temporaries."""
    batch, heads, n_q = queries.shape[:3]
    per_head = n_q * keys.shape[2]
    budget = group_elements(per_head)
    pairs = batch * heads * per_head
    if torch.compiler.is_compiling():  # traced: one block (no Python loop over the sizes, which may be symbolic)
        return pairs, [Block(slice(None))]
    if heads * per_head <= budget:
        size = budget // max(1, heads * per_head)
        return pairs, [Block(slice(start, min(start + size, batch))) for start in range(0, batch, size)]
    samples = [slice(b, b + 1) for b in range(batch)]
    if per_head <= budget:
        size = budget // per_head
        return pairs, [Block(s, slice(h, min(h + size, heads))) for s in samples for h in range(0, heads, size)]
    rows = -(-n_q // -(-per_head // budget))  # ceil(N / number of row blocks)
    return pairs, [
        Block(s, slice(h, h + 1), slice(r, min(r + rows, n_q)))
        for s in samples
        for h in range(heads)
        for r in range(0, n_q, rows)
    ]


def _place_rows(shape: torch.Size, blocks: Iterable[Block], parts: Iterable[tuple[Tensor, ...]]) -> list[Tensor]:
    """Every block's per-row results ``(G, n, ...)`` in their places in ``(B, H, N, ...)`` tensors (``shape = (B,
    H, N)``), written as the blocks finish."""
    outs: list[Tensor] = []
    for block, part in zip(blocks, parts):
        outs = outs or [value.new_empty(*shape, *value.shape[2:]) for value in part]
        for out, value in zip(outs, part):
            region = block.region(out, rows=True)
            region.copy_(value.view(region.shape))
    return outs


def _write_gradients(
    targets: list[Tensor], queries: int, gradients: Iterator[tuple[Block, tuple[Tensor, ...]]]
) -> Tensor:
    """Each block's gradients written into head-major ``targets (B, H, ...)``: the first ``queries`` at its query
    rows, the others (keys', values') over all rows, written by a slice's first row block and added to by the
    later ones; the block's last gradient is the per-slice scale's ``(G,)``, summed here into ``(H,)``."""
    g_scale: Tensor | None = None
    for block, grads in gradients:
        for index, (target, value) in enumerate(zip(targets, grads)):
            region = block.region(target, rows=index < queries)
            if index < queries or block.first:
                region.copy_(value.view(region.shape))
            else:
                region.add_(value.view(region.shape))
        g_scale = grads[-1].new_zeros(targets[0].shape[:2]) if g_scale is None else g_scale
        per_slice = block.region(g_scale, rows=False)
        per_slice.add_(grads[-1].view(per_slice.shape))
    assert g_scale is not None  # at least one block
    return g_scale.sum(0)


def row_scalars(rq: Tensor, rk: Tensor, rv: Tensor, scale: Tensor, k: float) -> RowScalars:
    """:class:`RowScalars` of radii ``(B, H, N)`` (views of the strided heads, gathered here) and the per-head
    ``scale (H,)``: ``score = -(sqrt(4 k scale) asinh s)^2`` (Eq. 9).  One compiled kernel on the CPU in place of a
    dozen eager passes."""
    sk = math.sqrt(k)
    a, b, beta = (r.contiguous() / sk for r in (rq, rk, rv))  # (B, H, N) contiguous: blocks are views
    sinh_a, cosh_a = sinh_cosh(a)
    sinh_b, cosh_b = sinh_cosh(b)
    sinh_beta, cosh_beta = sinh_cosh(beta)
    scale_g = scale.view(1, -1, 1, 1).expand(rq.shape[0], -1, 1, 1).contiguous()
    exp_beta, root_coef = torch.exp(-beta), torch.sqrt(scale_g * (4.0 * k))
    return RowScalars(
        a,
        b,
        beta,
        sinh_a,
        cosh_a,
        torch.exp(a),
        torch.exp(-a),
        sinh_b,
        cosh_b,
        torch.exp(b),
        torch.exp(-b),
        sinh_beta,
        cosh_beta,
        exp_beta,
        scale_g,
        root_coef,
    )


QUERY_SCALARS = ("a", "sinh_a", "cosh_a", "exp_a", "exp_minus_a")  # the fields of RowScalars over the query rows


class AttentionRows:
    """Per-slice quantities of :class:`FusedPolarAttention`, computed once for all ``(batch, head)`` slices
    (:class:`RowScalars`); the directions are the inputs themselves (views, never copied whole).  ``rows[block]``
    is the :class:`GroupRows` of a :class:`Block` (strided inputs copied per block, in cache)."""

    def __init__(
        self, rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale: Tensor, k: float
    ) -> None:
        self.uq, self.uk, self.uv = uq, uk, uv
        pairs = uq.shape[0] * uq.shape[1] * uq.shape[2] * uk.shape[2]
        self.scalars = run_maybe_compiled(row_scalars, uq, rq, rk, rv, scale, k, elements=pairs)

    def __getitem__(self, block: Block) -> GroupRows:
        uk, uv = block.slices(self.uk), block.slices(self.uv)
        scalars = (
            block.queries(value) if name in QUERY_SCALARS else block.slices(value)
            for name, value in zip(RowScalars._fields, self.scalars)
        )
        return GroupRows(
            block.queries(self.uq),
            uk,
            uv,
            uk.transpose(-1, -2).contiguous(),
            uv.transpose(-1, -2).contiguous(),
            RowScalars(*scalars),
        )


class HeadViews(NamedTuple):
    """The fused core's inputs: radii ``(B, H, N)`` and directions ``(B, H, N, d)`` of the queries, keys and values
    (views of the heads, any strides)."""

    rq: Tensor
    uq: Tensor
    rk: Tensor
    uk: Tensor
    rv: Tensor
    uv: Tensor


def _core_forward(views: HeadViews, scale: Tensor, k: float) -> RowStatistics:
    """The forward of :class:`FusedPolarAttention`, block by block: the :class:`RowStatistics` of every row
    ``(B, H, N, ...)``."""
    rows = AttentionRows(*views, scale, k)
    pairs, blocks = _blocks(views.uq, views.uk)
    parts = (run_maybe_compiled(_attention_group_forward, views.uq, rows[block], elements=pairs) for block in blocks)
    return RowStatistics(*_place_rows(views.rq.shape, blocks, parts))


def _core_gradients(
    views: HeadViews, scale: Tensor, saved: RowStatistics, grad_r: Tensor, grad_u: Tensor, k: float
) -> Iterator[tuple[Block, tuple[Tensor, ...]]]:
    """The backward of :class:`FusedPolarAttention`, block by block: each :class:`Block` with the gradients of its
    ``(rq, uq, rk, uk, rv, uv)`` ``(G, ...)`` (of its query rows and, for keys and values, the block's share) and
    the per-slice scale gradient ``(G,)``, from contiguous cotangents ``grad_r (B, H, N)`` and ``grad_u (B, H, N,
    d)``."""
    rows = AttentionRows(*views, scale, k)
    pairs, blocks = _blocks(views.uq, views.uk)
    for block in blocks:
        grads = run_maybe_compiled(
            _attention_group_backward,
            views.uq,
            rows[block],
            RowStatistics(*(block.queries(value) for value in saved)),
            block.queries(grad_r),
            block.queries(grad_u),
            k,
            elements=pairs,
        )
        yield block, grads[:-PAIR_TERMS]


@registered_operators(outputs=2)
class FusedPolarAttention(torch.autograd.Function):
    r"""Polar attention: scores, softmax and centroid in one function, block by block (:class:`Block`).

    Forward (per batch and head; queries ``(a_i, q_i)``, keys ``(b_j, k_j)``, values ``(beta_j, v_j)``, radii
    divided by ``sqrt(k)``):

        c_ij = (cosh(a_i - b_j) - 1) + sinh a_i sinh b_j 1/2 ||q_i - k_j||^2          (Eq. 5)
        P_ij = softmax_j(-scale_h k D_ij^2),  D_ij = 2 asinh sqrt(c_ij / 2)              (Eq. 9)
        T = P cosh(beta), E = P e^{-beta}, V = P (sinh(beta) v), S_i = sum_j P_ij sinh beta_j 1/2 ||u_i - v_j||^2

    and the centroid radius of Eq. 22 with ``u_i = V_i / ||V_i||``.  Saved for backward: the inputs, the output
    and the per-row :class:`RowStatistics`: nothing of size ``N x M``.  Backward recomputes ``P`` from ``lse`` and
    uses

        dL/dP_ij = g_T cosh beta_j + g_E e^{-beta_j} + sinh beta_j (g_V . v_j + g_S chord(u_i, v_j))
        dL/dscore_ij = P_ij (dL/dP_ij - sum_j' P_ij' dL/dP_ij')

    (``S`` is stationary in ``u_i``, so ``u_i`` is held fixed in it), ``dD^2/dc`` from
    :func:`stable_math.distance_slope`, ``dc/da_i = sinh(a_i - b_j) + cosh a_i sinh b_j chord`` and the centred
    chord gradient of Eq. 25.  The softmax row constant is summed from the very values the gradient uses, so it
    cancels exactly where the score gradient vanishes (identical keys).
    """

    @staticmethod
    def forward(
        ctx: Any,
        rq: Tensor,
        uq: Tensor,
        rk: Tensor,
        uk: Tensor,
        rv: Tensor,
        uv: Tensor,  # noqa: D102
        scale: Tensor,
        k: float,
    ) -> tuple[Tensor, Tensor]:
        saved = _core_forward(HeadViews(rq, uq, rk, uk, rv, uv), scale, k)
        ctx.save_for_backward(rq, uq, rk, uk, rv, uv, scale, *saved)
        ctx.k = k
        return (math.sqrt(k) * saved.a_mu).view_as(rq), saved.u_hat.view_as(uq)

    @staticmethod
    @first_order
    def backward(ctx: Any, grad_r: Tensor, grad_u: Tensor) -> tuple:  # noqa: D102
        rq, uq, rk, uk, rv, uv, scale, *statistics = ctx.saved_tensors
        views = HeadViews(rq, uq, rk, uk, rv, uv)
        # (under torch.compile the cotangents arrive as views of one packed gradient; the kernels are guarded on
        # strides, so contiguous ones serve eager and compiled models with the same variant)
        grads = [t.new_empty(t.shape) for t in views]
        gradients = _core_gradients(
            views, scale, RowStatistics(*statistics), grad_r.contiguous(), grad_u.contiguous(), ctx.k
        )
        return (*grads, _write_gradients(grads, 2, gradients), None)


def fused_polar_attention(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale: Tensor, k: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Polar attention (Eq. 9) in one fused function (:class:`FusedPolarAttention`); ``scale`` is an ``(H,)``
    tensor."""
    return fused_apply(FusedPolarAttention, rq, uq, rk, uk, rv, uv, scale, float(k))


def head_major(qk: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values ``(B, H, N, w)`` as views of token-major heads: queries and keys side by side
    ``qk (B, N, 2H, w)``, values ``v (B, N, H, w)``."""
    heads = v.shape[2]
    q, keys, values = (t.transpose(1, 2) for t in (qk[:, :, :heads], qk[:, :, heads:], v))
    return q, keys, values


def _packed_views(qk: Tensor, v: Tensor) -> HeadViews:
    """:class:`HeadViews` of token-major packed heads (:func:`head_major`)."""
    q, keys, values = head_major(qk, v)
    return HeadViews(q[..., 0], q[..., 1:], keys[..., 0], keys[..., 1:], values[..., 0], values[..., 1:])


def _token_major_gradients(
    qk: Tensor, v: Tensor, gradients: Iterator[tuple[Block, tuple[Tensor, ...]]], packed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(g_qk, g_v, g_scale (H,))`` of a token-major heads Function from its core's gradients block by block
    (queries', keys', values', then the per-slice scale's), each written in place as its block finishes
    (:func:`_write_gradients`); ``packed``: each of the three given as a radius part and a direction part (the polar
    core's)."""
    g_qk, g_v = qk.new_empty(qk.shape), v.new_empty(v.shape)
    targets = list(head_major(g_qk, g_v))
    if packed:
        targets = [part for t in targets for part in (t[..., 0], t[..., 1:])]
    return g_qk, g_v, _write_gradients(targets, 2 if packed else 1, gradients)


@registered_operators()
class FusedPolarAttentionHeads(torch.autograd.Function):
    """:class:`FusedPolarAttention` on the heads as a layer holds them, token-major and packed: queries and keys side
    by side ``qk (B, N, 2H, d+1)`` (one projection's output, or the position encoding's), values ``v (B, N, H, d+1)``
    -> heads ``(B, N, H, d+1)``, the layout the heads' concatenation reads.  The same core, block by block; the
    output and the gradients of ``qk`` and ``v`` are written in their layouts as the blocks finish, so no gradient
    of a radius or direction view, transpose or split is assembled by autograd (zero-filled tensors and
    concatenations of the whole heads).  Saved: the inputs and the :class:`RowStatistics`."""

    @staticmethod
    def forward(ctx: Any, qk: Tensor, v: Tensor, scale: Tensor, k: float) -> Tensor:  # noqa: D102
        saved = _core_forward(_packed_views(qk, v), scale, k)
        out = v.new_empty(v.shape)
        heads = out.transpose(1, 2)
        heads[..., 0].copy_(math.sqrt(k) * saved.a_mu)
        heads[..., 1:].copy_(saved.u_hat)
        ctx.save_for_backward(qk, v, scale, *saved)
        ctx.k = k
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        qk, v, scale, *statistics = ctx.saved_tensors
        grad_heads = grad.transpose(1, 2)
        grad_r, grad_u = grad_heads[..., 0].contiguous(), grad_heads[..., 1:].contiguous()
        gradients = _core_gradients(_packed_views(qk, v), scale, RowStatistics(*statistics), grad_r, grad_u, ctx.k)
        return *_token_major_gradients(qk, v, gradients, packed=True), None


def fused_polar_attention_heads(qk: Tensor, v: Tensor, scale: Tensor, k: float = 1.0) -> Tensor:
    """Polar attention (Eq. 9) of token-major heads ``qk (B, N, 2H, d+1)`` (queries, then keys) and ``v (B, N, H,
    d+1)`` -> ``(B, N, H, d+1)`` (:class:`FusedPolarAttentionHeads`); ``scale`` is an ``(H,)`` tensor."""
    return fused_apply(FusedPolarAttentionHeads, qk, v, scale, float(k))


# --------------------------------------------------------------------------------------------
# the ambient twin (Eq. 1, 4, 9 in ambient coordinates)
# --------------------------------------------------------------------------------------------
class AmbientScores(NamedTuple):
    """Eq. 1 for all pairs of a group (all ``(G, N, M)``): ``A = -<q_i, k_j>_L / k``, ``A`` floored at ``1 + 1e-8``,
    ``arcosh`` of the floored value and the squared distance ``k arcosh^2``."""

    arg: Tensor
    floored: Tensor
    acosh: Tensor
    sq_dist: Tensor


def ambient_scores(q: Tensor, keys: Tensor, key_times: Tensor, k: float) -> AmbientScores:
    """:class:`AmbientScores` of queries ``(G, N, d+1)`` and keys ``(G, M, d+1)`` with their time coordinates
    ``key_times (G, M)`` contiguous (:func:`ambient.pairwise_minus_inner`): the formula of
    :func:`ambient.pairwise_sq_distance`, ``arcosh`` through ``log`` in compiled kernels
    (:func:`stable_math.kernel_acosh`)."""
    arg = pairwise_minus_inner(q, keys, key_times) / k
    floored = arg.clamp_min(1.0 + norm_floor())
    acosh = kernel_acosh(floored)
    return AmbientScores(arg, floored, acosh, k * acosh.square())


def _ambient_group_forward(
    q: Tensor, keys: Tensor, key_times: Tensor, v: Tensor, scale: Tensor, k: float
) -> tuple[Tensor, Tensor]:
    """Forward of :class:`FusedAmbientAttention` on one group of slices ``(G, N, d+1)`` (the keys' time coordinates
    also as ``key_times (G, M)``, :func:`ambient_scores`): ``(lse (G, N), sums (G, N, d+1))``, ``sums = P v`` before
    the Lorentz normalisation."""
    logits = -scale * ambient_scores(q, keys, key_times, k).sq_dist
    top = logits.amax(-1, keepdim=True)
    probs = exp_weights(logits - top)
    total = probs.sum(-1, keepdim=True)
    return (torch.log(total) + top).squeeze(-1), narrow_product(probs, v) / total


def _ambient_group_backward(
    q: Tensor,
    keys: Tensor,
    key_times: Tensor,
    v: Tensor,
    scale: Tensor,
    lse: Tensor,
    sums: Tensor,
    grad: Tensor,
    k: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of :class:`FusedAmbientAttention` on one group (formulas in its docstring): gradients of ``(q, keys,
    v)`` and the per-slice scale gradient ``(G,)``."""
    scores = ambient_scores(q, keys, key_times, k)
    probs = exp_weights(-scale * scores.sq_dist - lse.unsqueeze(-1))
    g_sums = lorentz_normalize_backward(sums, grad, k)
    g_probs = g_sums @ v.transpose(-1, -2)
    g_logits = probs * (g_probs - (probs * g_probs).sum(-1, keepdim=True))
    g_scale = -(g_logits * scores.sq_dist).sum(dim=(1, 2))
    # d(k arcosh(M / k)^2) / dM = 2 arcosh(A) / sqrt(A^2 - 1), zero where the argument is floored
    slope = acosh_slope(scores.floored, scores.acosh)
    g_inner = torch.where(scores.arg >= scores.floored, (-2.0 * scale) * g_logits * slope, 0.0)
    flip = lambda x: torch.cat([x[..., :1], -x[..., 1:]], dim=-1)  # noqa: E731 - J'x, with -<x, y>_L = (J'x) . y
    return (
        narrow_product(g_inner, flip(keys)),
        narrow_product(g_inner.transpose(-1, -2), flip(q)),
        narrow_product(probs.transpose(-1, -2), g_sums),
        g_scale,
    )


def _ambient_core_forward(q: Tensor, keys: Tensor, v: Tensor, scale: Tensor, k: float) -> tuple[Tensor, Tensor]:
    """The forward of :class:`FusedAmbientAttention` on ``(B, H, N, d+1)`` heads (any strides), block by block:
    ``(lse (B, H, N), sums (B, H, N, d+1))``."""
    batch, heads = q.shape[:2]
    scales = scale.view(1, heads, 1, 1).expand(batch, heads, 1, 1)
    key_times = keys[..., 0].contiguous()
    pairs, blocks = _blocks(q, keys)
    parts = (
        run_maybe_compiled(
            _ambient_group_forward,
            q,
            block.queries(q),
            *(block.slices(t) for t in (keys, key_times, v, scales)),
            k,
            elements=pairs,
        )
        for block in blocks
    )
    lse, sums = _place_rows(q.shape[:3], blocks, parts)
    return lse, sums


def _ambient_core_gradients(
    q: Tensor, keys: Tensor, v: Tensor, scale: Tensor, lse: Tensor, sums: Tensor, grad: Tensor, k: float
) -> Iterator[tuple[Block, tuple[Tensor, ...]]]:
    """The backward of :class:`FusedAmbientAttention`, block by block: each :class:`Block` with the gradients of its
    ``(q, keys, v)`` ``(G, ...)`` (of its query rows and, for keys and values, the block's share) and the
    per-slice scale gradient ``(G,)``."""
    batch, heads = q.shape[:2]
    scales = scale.view(1, heads, 1, 1).expand(batch, heads, 1, 1)
    key_times = keys[..., 0].contiguous()
    pairs, blocks = _blocks(q, keys)
    for block in blocks:
        rows = (block.queries(t) for t in (lse, sums, grad))
        inputs = (block.queries(q), *(block.slices(t) for t in (keys, key_times, v, scales)))
        grads = run_maybe_compiled(_ambient_group_backward, q, *inputs, *rows, k, elements=pairs)
        yield block, grads


@registered_operators()
class FusedAmbientAttention(torch.autograd.Function):
    r"""Ambient attention (Eq. 9 with the distance of Eq. 1 and the centroid of Eq. 4): the ambient twin's scores,
    softmax and centroid in one function.

    Forward per batch and head: ``M_ij = -<q_i, k_j>_L``, ``D_ij^2 = k arcosh(max(M_ij / k, 1 + 1e-8))^2``,
    ``P = softmax_j(-scale_h D^2)``, ``s = P v``, ``mu = sqrt(k) s / sqrt(|<s, s>_L|)``: the formulas of
    :meth:`manifold_ops.AmbientOps.attention`, in the same order.  Saved: the inputs, the log-sum-exp per row and
    ``s``: nothing of size ``N x M``.  Backward recomputes ``P`` and uses ``g_s`` from
    :func:`ambient.lorentz_normalize_backward`, ``g_P = g_s v^T``, ``g_v = P^T g_s``, ``g_logit = P (g_P - sum_j
    P g_P)``, ``dD^2 / dM = 2 arcosh(A) / sqrt(A^2 - 1)`` (:func:`ambient.acosh_slope`), ``g_q = g_M J'k``,
    ``g_k = g_M^T J'q`` with ``J' = diag(1, -1, ..., -1)``.
    """

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any, q: Tensor, keys: Tensor, v: Tensor, scale: Tensor, k: float
    ) -> Tensor:
        lse, sums = _ambient_core_forward(q, keys, v, scale, k)
        ctx.save_for_backward(q, keys, v, scale, lse, sums)
        ctx.k = k
        return lorentz_normalize(sums, k).view_as(q)

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        q, keys, v, scale, lse, sums = ctx.saved_tensors
        grads = [t.new_empty(t.shape) for t in (q, keys, v)]
        g_scale = _write_gradients(grads, 1, _ambient_core_gradients(q, keys, v, scale, lse, sums, grad, ctx.k))
        return *grads, g_scale, None


def fused_ambient_attention(q: Tensor, keys: Tensor, v: Tensor, scale: Tensor, k: float = 1.0) -> Tensor:
    """Ambient attention (Eq. 9 in ambient coordinates) of ``(B, H, N, d+1)`` points in one fused function
    (:class:`FusedAmbientAttention`); ``scale`` is an ``(H,)`` tensor."""
    return fused_apply(FusedAmbientAttention, q, keys, v, scale, float(k))


@registered_operators()
class FusedAmbientAttentionHeads(torch.autograd.Function):
    """:class:`FusedAmbientAttention` on the heads as a layer holds them (as :class:`FusedPolarAttentionHeads`):
    ``qk (B, N, 2H, d+1)``, ``v (B, N, H, d+1)`` -> heads ``(B, N, H, d+1)``, the output and the gradients of ``qk``
    and ``v`` written in their layouts.  Saved: the inputs, the log-sum-exp per row and ``s``."""

    @staticmethod
    def forward(ctx: Any, qk: Tensor, v: Tensor, scale: Tensor, k: float) -> Tensor:  # noqa: D102
        lse, sums = _ambient_core_forward(*head_major(qk, v), scale, k)
        out = v.new_empty(v.shape)
        out.transpose(1, 2).copy_(lorentz_normalize(sums, k))
        ctx.save_for_backward(qk, v, scale, lse, sums)
        ctx.k = k
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        qk, v, scale, lse, sums = ctx.saved_tensors
        gradients = _ambient_core_gradients(*head_major(qk, v), scale, lse, sums, grad.transpose(1, 2), ctx.k)
        return *_token_major_gradients(qk, v, gradients, packed=False), None


def fused_ambient_attention_heads(qk: Tensor, v: Tensor, scale: Tensor, k: float = 1.0) -> Tensor:
    """Ambient attention (Eq. 9 in ambient coordinates) of token-major heads ``qk (B, N, 2H, d+1)`` (queries, then
    keys) and ``v (B, N, H, d+1)`` -> ``(B, N, H, d+1)`` (:class:`FusedAmbientAttentionHeads`); ``scale`` is an
    ``(H,)`` tensor."""
    return fused_apply(FusedAmbientAttentionHeads, qk, v, scale, float(k))
