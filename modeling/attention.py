"""Polar attention core (paper Eq. 5, 6, 7, 9, 22): squared-distance scores, softmax, polar centroid.

``polar_attention`` works on per-head polar points: radii ``(B, H, N)`` and directions
``(B, H, N, d)``.  The score between query ``i`` and key ``j`` is ``-scale_h * d^2(q_i, k_j)``
(``scale = gamma / tau`` of Eq. 9) and the output is the polar centroid of the values with the
softmax weights.  The implementations live in a registry keyed by ``config.polar_attn_implementation``
(:class:`PolarAttentionInterface`, like transformers' ``AttentionInterface``): ``eager`` (the
reference), ``fused`` (one block, :mod:`fused_attention`), ``chunked`` (key blocks with an online softmax) and
``triton`` (CUDA kernels); ``PolarAttentionInterface.register(name, function)`` adds one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Union

import torch
from torch import Tensor
from transformers.utils.generic import GeneralInterface

from .cpu_kernels import first_order
from .fused_attention import CentredValues, fused_polar_attention, row_gradients
from .geometry import (
    asinhc_half,
    centroid,
    centroid_radius,
    chord,
    haversine_from_chord,
    pairwise_chord,
    pairwise_sq_distance,
    safe_normalize,
    sq_distance_from_c,
)
from .runtime import runtime_options
from .torch_internals import functorch_transforms_active
from .triton_attention import TRITON_AVAILABLE, triton_polar_attention

DEFAULT_BLOCK = 128

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


# ------------------------------------------------------------------------------------------------
# chunked: online softmax over key blocks, O(N * block) memory, recomputing backward
# ------------------------------------------------------------------------------------------------
def _haversine_block(a: Tensor, uq: Tensor, b: Tensor, uk: Tensor) -> tuple[Tensor, Tensor]:
    """``c`` of Eq. 5 for all query/key pairs of a block and the exact chords it used."""
    pair_chords = pairwise_chord(uq, uk)
    return haversine_from_chord(a.unsqueeze(-1), b.unsqueeze(-2), pair_chords), pair_chords


class _ChunkedPolarAttention(torch.autograd.Function):
    r"""Polar attention with an online softmax over key blocks and an exact single-pass centroid.

    Forward, per query row and key block ``J`` with running max ``m`` (weights ``w_j = e^{s_j - m}``):
    ``T, E, V`` and the normaliser are rescaled by ``e^{m_old - m_new}`` and accumulated as in
    FlashAttention.  The angular term ``S = sum_j w_j sinh b_j 1/2 ||v_j - u_hat||^2`` needs the
    final direction ``u_hat``; it is carried exactly through the blocks with the identity (for unit
    ``v_j``, ``X`` and ``u_hat = V / ||V||``)

        ``sum_j w_j sinh b_j 1/2 ||v_j - X||^2 = S(u_hat) + ||V|| 1/2 ||u_hat - X||^2``

    (proof: the difference of the two sides is ``sum w sinh b (v.u_hat - v.X) = V.(u_hat - X) =
    ||V|| (1 - u_hat.X)``).  Chords are exact differences (``torch.cdist``), never ``1 - u.v``.  With
    ``X = u_hat_new`` after the block:

        ``S_new = S_old + ||V_old|| 1/2 ||u_hat_old - u_hat_new||^2``
        ``        + sum_{j in J} w_j sinh b_j 1/2 ||v_j - u_hat_new||^2``,

    a sum of non-negative terms, so ``S`` keeps full relative precision; the radius then follows
    Eq. 22.  Backward recomputes the scores block by block from the saved row statistics; ``S``
    is stationary in ``u_hat`` in exact arithmetic, and the derivative through ``u_hat`` that rounding
    leaves is added from the centred value sums the forward accumulates
    (:func:`fused_attention.stationarity_correction`).
    The softmax row constant ``sum_j p_ij dL/dp_ij`` is summed in a first pass from the same
    recomputed values the second pass uses (not formed analytically), so it cancels exactly where
    the true score gradient vanishes (e.g. identical keys) instead of leaving ``eps cosh(b)`` noise.
    No tensor with ``N * N * d`` elements exists; the largest temporaries are ``(B, H, N, block)``.
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
        block: int,
    ) -> tuple[Tensor, Tensor]:
        sk = math.sqrt(k)
        a_q, a_k, b_v = rq / sk, rk / sk, rv / sk
        scale_v = scale.view(1, -1, 1, 1)
        batch, heads, n_q, dim = uq.shape
        m = torch.full((batch, heads, n_q), float("-inf"), dtype=uq.dtype, device=uq.device)
        norm = torch.zeros_like(m)
        big_t, big_e, big_s = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        big_v = uq.new_zeros(batch, heads, n_q, uv.shape[-1])
        u_hat, big_vc, big_w = torch.zeros_like(big_v), torch.zeros_like(big_v), torch.zeros_like(m)
        v_bar = uv.mean(dim=2, keepdim=True)  # centre of the value sums and of the chord gradient (Eq. 25)
        sinh_b, cosh_b, exp_b = torch.sinh(b_v), torch.cosh(b_v), torch.exp(-b_v)
        for start in range(0, uk.shape[2], block):
            blk = slice(start, start + block)
            c, _ = _haversine_block(a_q, uq, a_k[:, :, blk], uk[:, :, blk])
            scores = -scale_v * sq_distance_from_c(c, k)
            m_new = torch.maximum(m, scores.amax(-1))
            alpha = torch.exp(m - m_new)
            e = torch.exp(scores - m_new.unsqueeze(-1))
            w = e * sinh_b[:, :, None, blk]
            norm = norm * alpha + e.sum(-1)
            big_t = big_t * alpha + (e * cosh_b[:, :, None, blk]).sum(-1)
            big_e = big_e * alpha + (e * exp_b[:, :, None, blk]).sum(-1)
            v_old_norm = torch.linalg.vector_norm(big_v, dim=-1) * alpha
            big_v = big_v * alpha.unsqueeze(-1) + w @ uv[:, :, blk]
            big_vc = big_vc * alpha.unsqueeze(-1) + w @ (uv[:, :, blk] - v_bar)
            big_w = big_w * alpha + w.sum(-1)
            u_new = safe_normalize(big_v)
            big_s = (
                big_s * alpha + v_old_norm * chord(u_hat, u_new) + (w * pairwise_chord(u_new, uv[:, :, blk])).sum(-1)
            )
            u_hat, m = u_new, m_new
        v_norm = torch.linalg.vector_norm(big_v, dim=-1)
        a_mu = centroid_radius(big_t, big_e, big_s, v_norm, v_norm <= 0)
        stats = torch.stack([m, norm, big_t / norm, big_e / norm, big_s / norm, v_norm / norm])
        ctx.save_for_backward(
            rq, uq, rk, uk, rv, uv, scale, stats, a_mu, u_hat, big_w / norm, big_vc / norm.unsqueeze(-1)
        )
        ctx.k, ctx.block = k, block
        return sk * a_mu, u_hat

    @staticmethod
    @first_order
    def backward(ctx: Any, grad_r: Tensor, grad_u: Tensor) -> tuple:  # noqa: D102
        rq, uq, rk, uk, rv, uv, scale, stats, a_mu, u_hat, big_w, big_vc = ctx.saved_tensors
        k, block = ctx.k, ctx.block
        sk = math.sqrt(k)
        m, norm = stats[0], stats[1]
        v_bar = uv.mean(dim=2, keepdim=True)
        values = CentredValues(big_w, big_vc, v_bar)
        g_t, g_e, g_s, g_v, _ = row_gradients(grad_r, grad_u, stats, a_mu, u_hat, values, k)
        a_q, a_k, b_v = rq / sk, rk / sk, rv / sk
        scale_v = scale.view(1, -1, 1, 1)
        sinh_b, cosh_b, exp_b = torch.sinh(b_v), torch.cosh(b_v), torch.exp(-b_v)
        sinh_a = torch.sinh(a_q)

        def tile(blk: slice) -> tuple[Tensor, ...]:
            """Recompute one key block: probabilities and dL/dp (``g_S = g_E`` by Eq. 22)."""
            c, chord_qk = _haversine_block(a_q, uq, a_k[:, :, blk], uk[:, :, blk])
            d2 = sq_distance_from_c(c, k)
            p = torch.exp(-scale_v * d2 - m.unsqueeze(-1)) / norm.unsqueeze(-1)
            chord_v = pairwise_chord(u_hat, uv[:, :, blk])
            sb, cb, eb = sinh_b[:, :, None, blk], cosh_b[:, :, None, blk], exp_b[:, :, None, blk]
            gv_dot = g_v @ uv[:, :, blk].transpose(-1, -2)  # (B, H, Nq, bk)
            g_p = g_t.unsqueeze(-1) * cb + gv_dot * sb + g_e.unsqueeze(-1) * (eb + sb * chord_v)
            return c, chord_qk, d2, p, chord_v, sb, cb, eb, gv_dot, g_p

        blocks = [slice(start, start + block) for start in range(0, uk.shape[2], block)]
        # pass 1: the softmax row constant sum_j p_ij dL/dp_ij from the very values pass 2 uses
        row_dot = sum(((t[3] * t[9]).sum(-1) for t in map(tile, blocks)), torch.zeros_like(m))
        grads = {
            name: torch.zeros_like(t)
            for name, t in (("a_q", a_q), ("uq", uq), ("a_k", a_k), ("uk", uk), ("b_v", b_v), ("uv", uv))
        }
        g_scale = torch.zeros_like(scale)
        k_bar = uk.mean(dim=2, keepdim=True)  # centring of the chord gradient (Eq. 25)
        p_q, p_hat = uq - k_bar, u_hat - v_bar
        for blk in blocks:
            c, chord_qk, d2, p, chord_v, sb, cb, eb, gv_dot, g_p = tile(blk)
            g_score = p * (g_p - row_dot.unsqueeze(-1))
            g_scale -= (g_score * d2).sum(dim=(0, 2, 3))
            # values: radius and direction
            grads["b_v"][:, :, blk] += (
                p * (g_t.unsqueeze(-1) * sb + gv_dot * cb + g_e.unsqueeze(-1) * (cb * chord_v - eb))
            ).sum(2)
            w_s = p * (g_s.unsqueeze(-1) * sb)
            vb = uv[:, :, blk]
            grads["uv"][:, :, blk] += (p * sb).transpose(-1, -2) @ g_v + (
                (vb - v_bar) * w_s.sum(2).unsqueeze(-1) - w_s.transpose(-1, -2) @ p_hat
            )
            # scores -> squared distances -> Eq. 5 (with the Eq. 25 chord gradient)
            g_c = -scale_v * g_score * (2.0 * k) * asinhc_half(c) / torch.sqrt(1.0 + 0.5 * c)
            a, b = a_q.unsqueeze(-1), a_k[:, :, None, blk]
            sinh_b_k = torch.sinh(b)
            grads["a_q"] += (g_c * (torch.sinh(a - b) + torch.cosh(a) * sinh_b_k * chord_qk)).sum(-1)
            grads["a_k"][:, :, blk] += (
                g_c * (torch.sinh(b - a) + sinh_a.unsqueeze(-1) * torch.cosh(b) * chord_qk)
            ).sum(2)
            g_chord = g_c * sinh_a.unsqueeze(-1) * sinh_b_k
            q_k = uk[:, :, blk] - k_bar
            grads["uq"] += p_q * g_chord.sum(-1, keepdim=True) - g_chord @ q_k
            grads["uk"][:, :, blk] += q_k * g_chord.sum(2).unsqueeze(-1) - g_chord.transpose(-1, -2) @ p_q
        return (
            grads["a_q"] / sk,
            grads["uq"],
            grads["a_k"] / sk,
            grads["uk"],
            grads["b_v"] / sk,
            grads["uv"],
            g_scale,
            None,
            None,
        )


def chunked_polar_attention(
    rq: Tensor,
    uq: Tensor,
    rk: Tensor,
    uk: Tensor,
    rv: Tensor,
    uv: Tensor,
    scale: Scale,
    k: float = 1.0,
    block: int = DEFAULT_BLOCK,
) -> tuple[Tensor, Tensor]:
    """Memory-efficient polar attention (``O(N * block)``), exact forward and recomputing backward."""
    heads = uq.shape[1]
    scale_h = _scale_tensor(scale, heads, rq).reshape(-1).expand(heads).contiguous()
    return _ChunkedPolarAttention.apply(rq, uq, rk, uk, rv, uv, scale_h, float(k), int(block))


def _eager(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale_h: Tensor, k: float
) -> tuple[Tensor, Tensor, Tensor]:
    return eager_polar_attention(rq, uq, rk, uk, rv, uv, scale_h, k)


def _fused(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale_h: Tensor, k: float
) -> tuple[Tensor, Tensor, None]:
    return (*fused_polar_attention(rq, uq, rk, uk, rv, uv, scale_h, k), None)


def _chunked(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale_h: Tensor, k: float
) -> tuple[Tensor, Tensor, None]:
    return (*chunked_polar_attention(rq, uq, rk, uk, rv, uv, scale_h, k), None)


def _triton(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale_h: Tensor, k: float
) -> tuple[Tensor, Tensor, None]:
    return (*triton_polar_attention(rq, uq, rk, uk, rv, uv, scale_h, k), None)


class PolarAttentionInterface(GeneralInterface):
    """Registry of polar attention cores keyed by ``config.polar_attn_implementation``.

    Every function takes ``(rq, uq, rk, uk, rv, uv, scale_h, k)`` (radii ``(B, H, N)``, directions
    ``(B, H, N, d)``, ``scale_h`` an ``(H,)`` tensor) and returns ``(r, u, probs)``, with ``probs``
    ``None`` where the implementation never materialises them (all but ``eager``).
    """

    _global_mapping: dict[str, Callable] = {"eager": _eager, "fused": _fused, "chunked": _chunked, "triton": _triton}


POLAR_ATTENTION_FUNCTIONS = PolarAttentionInterface()
IMPLEMENTATIONS = tuple(POLAR_ATTENTION_FUNCTIONS)


def select_implementation(
    requested: str, output_attentions: bool, device: torch.device, num_tokens: int, fallback: str = "eager"
) -> str:
    """The implementation ``polar_attn_implementation`` resolves to.

    ``auto``: eager when attention probabilities are requested, Triton on CUDA (when available), ``fallback`` (the
    strategy's own core: ``fused`` for :class:`manifold_ops.FusedPolarOps`, ``eager`` for the reference) where it
    is ``fused`` on the CPU (it works in blocks of query rows at long sequences, its memory bounded at any length,
    and is the fastest core at every length: ``benchmarks/attention_speed.py``), else chunked for sequences of at
    least ``chunked_min_tokens`` tokens (:class:`runtime.RuntimeOptions`) and ``fallback`` below.  An explicit
    choice is kept, except that probabilities always need eager, and so do ``torch.func`` transforms (the eager core
    is made of transformable operators; the others are ``autograd.Function``s with hand-derived backward passes).
    """
    if output_attentions or functorch_transforms_active():
        return "eager"
    if requested != "auto":
        return requested
    if device.type == "cuda" and TRITON_AVAILABLE:
        return "triton"
    if num_tokens >= runtime_options().chunked_min_tokens and not (device.type == "cpu" and fallback == "fused"):
        return "chunked"
    return fallback


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
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Polar attention of Eq. 9: ``softmax_j(-scale d^2(q_i, k_j))`` and the polar centroid of the values.

    Shapes: radii ``(B, H, N)``, directions ``(B, H, N, d)``; ``scale`` is a float or an ``(H,)``
    tensor; ``impl`` a key of :class:`PolarAttentionInterface`.  Returns ``(r, u)`` of shapes
    ``(B, H, Nq)``, ``(B, H, Nq, d)``, and the probabilities ``(B, H, Nq, Nk)`` as a third element
    when ``return_probs`` is set (eager only).
    """
    _check_attention_shapes(rq, uq, rk, uk, rv, uv)
    if impl not in POLAR_ATTENTION_FUNCTIONS:
        raise ValueError(f"impl={impl!r} is not one of {tuple(POLAR_ATTENTION_FUNCTIONS)}")
    if return_probs and impl != "eager":
        raise ValueError(f"impl={impl!r} never materialises the attention probabilities; use impl='eager'")
    heads = uq.shape[1]
    scale_h = _scale_tensor(scale, heads, rq).reshape(-1).expand(heads).contiguous()
    r, u, probs = POLAR_ATTENTION_FUNCTIONS[impl](rq, uq, rk, uk, rv, uv, scale_h, float(k))
    return (r, u, probs) if return_probs else (r, u)


__all__ = [
    "IMPLEMENTATIONS",
    "POLAR_ATTENTION_FUNCTIONS",
    "PolarAttentionInterface",
    "chunked_polar_attention",
    "eager_polar_attention",
    "fused_polar_attention",
    "polar_attention",
    "select_implementation",
]
