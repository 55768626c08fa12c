"""The Triton polar attention before its FlashAttention-2 rewrite: the baseline column of
``benchmarks/attention_kernel.py`` (its PTX figures, and its time on a GPU), kept until the kernels of
``modeling/triton_kernels.py`` have been timed against it.

Chords summed from one coordinate column of each side at a time (loads per pair and coordinate), every ``tl.dot``
in IEEE float32 on the FMA units, a ``sinh`` that evaluates both of its branches, the backward's query kernel
recomputing the scores twice (its first pass rebuilds the softmax row constant), blocks of 16-64 with 8 warps
and one stage.  :func:`baseline_polar_attention` runs it (forward and backward, float32, CUDA or the interpreter).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from polar_vit_hf.modeling.fused_attention import CentredValues, row_gradients
from polar_vit_hf.modeling.stable_math import SERIES_CUTOFF
from polar_vit_hf.modeling.triton_kernels import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    SERIES_CUTOFF_TL = tl.constexpr(SERIES_CUTOFF)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and padded head width; dk/dv in two launches from 128
LAUNCH_CONFIGS: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "fwd": {16: (64, 32, 8, 1), 32: (64, 16, 8, 1), 64: (32, 16, 8, 1), 128: (16, 32, 8, 1)},
    "bwd_q": {16: (32, 32, 8, 1), 32: (32, 32, 8, 1), 64: (32, 16, 8, 1), 128: (32, 16, 8, 1)},
    "bwd_kv": {16: (32, 32, 8, 1), 32: (16, 32, 8, 1), 64: (32, 16, 8, 1), 128: (16, 32, 8, 1)},
}

if TRITON_AVAILABLE:

    @triton.jit
    def _sinh(x):
        """``sinh`` with full relative precision near 0 (series below 0.5)."""
        x2 = x * x
        series = x * (1.0 + x2 * (1.0 / 6.0 + x2 * (1.0 / 120.0 + x2 * (1.0 / 5040.0 + x2 / 362880.0))))
        return tl.where(tl.abs(x) < 0.5, series, 0.5 * (tl.exp(x) - tl.exp(-x)))

    @triton.jit
    def _cosh(x):
        return 0.5 * (tl.exp(x) + tl.exp(-x))

    @triton.jit
    def _log1p(x):
        """``log(1 + x)`` by Kahan's trick."""
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * x / tl.where(u == 1.0, 1.0, u - 1.0))

    @triton.jit
    def _asinhc_half(c):
        """``asinh(s) / s`` with ``s = sqrt(c/2)``, ``c >= 0``: :func:`stable_math.asinhc_half` in Triton (the
        non-negative ``asinh`` of :func:`stable_math.asinh_nonneg`, its series below ``SERIES_CUTOFF``)."""
        s2 = 0.5 * c
        s = tl.sqrt(s2)
        big = s > 1e15
        s_mid = tl.where(big, 1.0, s)
        asinh_mid = _log1p(s_mid + s2 / (1.0 + tl.sqrt(1.0 + s2)))
        asinh = tl.where(big, tl.log(tl.where(big, s, 1.0)) + 0.6931471805599453, asinh_mid)
        exact = asinh / tl.where(s > 0, s, 1.0)
        series = 1.0 + s2 * (-1.0 / 6.0 + s2 * (0.075 - s2 * (5.0 / 112.0)))  # stable_math.asinhc_series
        return tl.where(c < SERIES_CUTOFF_TL, series, exact)

    @triton.jit
    def _asinh_exp(ell):
        """``asinh(exp(l))`` without overflow: :func:`stable_math.asinh_exp` in Triton."""
        pos = tl.maximum(ell, 0.0)
        neg = tl.minimum(ell, 0.0)
        large = pos + tl.log(1.0 + tl.sqrt(1.0 + tl.exp(-2.0 * pos)))
        y = tl.exp(neg)
        small = _log1p(y + y * y / (1.0 + tl.sqrt(1.0 + y * y)))
        return tl.where(ell > 0, large, small)

    @triton.jit
    def _chord(U, offs_m, mask_m, V, offs_n, mask_n, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Exact ``1/2 ||u_i - v_j||^2`` from the coordinate differences (rows of ``U`` and ``V`` in memory).

        Each coordinate is loaded as a column ``(BLOCK_M, 1)`` and a row ``(1, BLOCK_N)`` of the tile's
        own layout, so the broadcast difference needs no layout conversion (no shared-memory trip).
        """
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for dd in range(D):
            u = tl.load(U + offs_m[:, None] * D + dd, mask=mask_m[:, None], other=0.0)
            v = tl.load(V + offs_n[None, :] * D + dd, mask=mask_n[None, :], other=0.0)
            diff = u - v
            acc += diff * diff
        return 0.5 * acc

    @triton.jit
    def _scores_block(
        a_q,
        sinh_a,
        UQ,
        offs_m,
        mask_m,
        RK,
        UK,
        offs_n,
        mask_n,
        sqrt_k,
        k_val,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Haversine ``c`` (Eq. 5), query/key chord, squared distance and key radii of one tile."""
        a_k = tl.load(RK + offs_n, mask=mask_n, other=0.0) / sqrt_k
        chord = _chord(UQ, offs_m, mask_m, UK, offs_n, mask_n, D, BLOCK_M, BLOCK_N)
        gap = _sinh(0.5 * (a_q[:, None] - a_k[None, :]))
        c = 2.0 * gap * gap + sinh_a[:, None] * _sinh(a_k)[None, :] * chord
        d2 = 2.0 * k_val * c * _asinhc_half(c) * _asinhc_half(c)
        return c, chord, d2, a_k

    @triton.jit(do_not_specialize=["n_q", "n_k"])
    def _polar_attention_fwd(
        RQ,
        UQ,
        RK,
        UK,
        RV,
        UV,
        VBAR,
        SCALE,
        ROUT,
        UOUT,
        VCOUT,
        STATS,
        n_q,
        n_k,
        heads,
        sqrt_k,
        k_val,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)  # (batch, head) slices on grid axis 0 (2^31 - 1 programs)
        pid_m = tl.program_id(1)
        scale = tl.load(SCALE + bh % heads)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        mask_m, mask_d = offs_m < n_q, offs_d < D
        tile_m = offs_m[:, None] * D + offs_d[None, :]
        mask_md = mask_m[:, None] & mask_d[None, :]
        RQ, UQ, ROUT, UOUT = RQ + bh * n_q, UQ + bh * n_q * D, ROUT + bh * n_q, UOUT + bh * n_q * D
        RK, UK, RV, UV = RK + bh * n_k, UK + bh * n_k * D, RV + bh * n_k, UV + bh * n_k * D
        vbar = tl.load(VBAR + bh * D + offs_d, mask=mask_d, other=0.0)
        a_q = tl.load(RQ + offs_m, mask=mask_m, other=0.0) / sqrt_k
        sinh_a = _sinh(a_q)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        t_i = tl.zeros((BLOCK_M,), tl.float32)
        e_i = tl.zeros((BLOCK_M,), tl.float32)
        s_i = tl.zeros((BLOCK_M,), tl.float32)
        w_i = tl.zeros((BLOCK_M,), tl.float32)
        v_norm = tl.zeros((BLOCK_M,), tl.float32)
        # V = sum_j w_j v_j is carried centred on the mean value direction, V = Vc + W v_bar: the stationarity
        # correction of the backward needs Vc = sum_j w_j (v_j - v_bar) itself (exact for clustered values)
        vc_acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
        # the running direction u_hat lives in this program's rows of UOUT: the value chords read it
        # column by column (as _chord does), and it is the output direction at the end
        tl.store(UOUT + tile_m, tl.zeros((BLOCK_M, D_PAD), tl.float32), mask=mask_md)
        for start in range(0, n_k, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_k
            c, chord, d2, a_k = _scores_block(
                a_q, sinh_a, UQ, offs_m, mask_m, RK, UK, offs_n, mask_n, sqrt_k, k_val, D, BLOCK_M, BLOCK_N
            )
            scores = tl.where(mask_n[None, :], -scale * d2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            e = tl.exp(scores - m_new[:, None])
            b = tl.load(RV + offs_n, mask=mask_n, other=0.0) / sqrt_k
            mask_nd = mask_n[:, None] & mask_d[None, :]
            uv = tl.load(UV + offs_n[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0)
            w = e * _sinh(b)[None, :]
            l_i = l_i * alpha + tl.sum(e, axis=1)
            t_i = t_i * alpha + tl.sum(e * _cosh(b)[None, :], axis=1)
            e_i = e_i * alpha + tl.sum(e * tl.exp(-b)[None, :], axis=1)
            w_i = w_i * alpha + tl.sum(w, axis=1)
            v_old_norm = v_norm * alpha
            # padded keys have w = 0, padded columns uv = v_bar = 0: no mask needed
            vc_acc = vc_acc * alpha[:, None] + tl.dot(w, uv - vbar[None, :], input_precision="ieee")
            v_acc = vc_acc + w_i[:, None] * vbar[None, :]
            v_norm = tl.sqrt(tl.sum(v_acc * v_acc, axis=1))
            u_new = v_acc / tl.where(v_norm > 0, v_norm, 1.0)[:, None]
            step = tl.load(UOUT + tile_m, mask=mask_md, other=0.0) - u_new
            step_sq = tl.sum(step * step, axis=1)
            tl.debug_barrier()  # every thread has read the old direction ...
            tl.store(UOUT + tile_m, u_new, mask=mask_md)
            tl.debug_barrier()  # ... and sees the new one
            chord_v = _chord(UOUT, offs_m, mask_m, UV, offs_n, mask_n, D, BLOCK_M, BLOCK_N)
            s_i = s_i * alpha + v_old_norm * 0.5 * step_sq + tl.sum(w * chord_v, axis=1)
            m_i = m_new
        degenerate = v_norm <= 0
        log_sinh = tl.log(tl.where(degenerate, 1.0, v_norm)) - 0.5 * tl.log(e_i + s_i) - 0.5 * tl.log(t_i + v_norm)
        a_mu = tl.where(degenerate, 0.0, _asinh_exp(log_sinh))
        tl.store(ROUT + offs_m, a_mu * sqrt_k, mask=mask_m)
        rows = tl.num_programs(0).to(tl.int64) * n_q  # stride between the statistics
        base = STATS + bh * n_q + offs_m
        tl.store(base, m_i, mask=mask_m)
        tl.store(base + rows, l_i, mask=mask_m)
        tl.store(base + 2 * rows, t_i / l_i, mask=mask_m)
        tl.store(base + 3 * rows, e_i / l_i, mask=mask_m)
        tl.store(base + 4 * rows, s_i / l_i, mask=mask_m)
        tl.store(base + 5 * rows, v_norm / l_i, mask=mask_m)
        tl.store(base + 6 * rows, w_i / l_i, mask=mask_m)
        tl.store(VCOUT + bh * n_q * D + tile_m, vc_acc / l_i[:, None], mask=mask_md)

    @triton.jit
    def _tile_backward(
        RQ,
        UQ,
        RK,
        UK,
        RV,
        UV,
        UHAT,
        STATS,
        GT,
        GE,
        GV,
        ROWDOT,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        offs_d,
        mask_d,
        rows,
        scale,
        sqrt_k,
        k_val,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Recompute one (query block, key block) tile: probabilities, dL/dp and dL/dc (pointers offset to b, h)."""
        valid = mask_m[:, None] & mask_n[None, :]
        a_q = tl.load(RQ + offs_m, mask=mask_m, other=0.0) / sqrt_k
        sinh_a = _sinh(a_q)
        c, chord, d2, a_k = _scores_block(
            a_q, sinh_a, UQ, offs_m, mask_m, RK, UK, offs_n, mask_n, sqrt_k, k_val, D, BLOCK_M, BLOCK_N
        )
        m_i = tl.load(STATS + offs_m, mask=mask_m, other=0.0)
        l_i = tl.load(STATS + rows + offs_m, mask=mask_m, other=1.0)
        p = tl.where(valid, tl.exp(-scale * d2 - m_i[:, None]) / l_i[:, None], 0.0)
        b = tl.load(RV + offs_n, mask=mask_n, other=0.0) / sqrt_k
        uv = tl.load(UV + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        chord_v = _chord(UHAT, offs_m, mask_m, UV, offs_n, mask_n, D, BLOCK_M, BLOCK_N)
        sinh_b, cosh_b, exp_b = _sinh(b), _cosh(b), tl.exp(-b)
        g_t = tl.load(GT + offs_m, mask=mask_m, other=0.0)
        g_e = tl.load(GE + offs_m, mask=mask_m, other=0.0)  # g_S = g_E (Eq. 22)
        g_v = tl.load(GV + offs_m[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        gv_dot = tl.dot(g_v, tl.trans(uv), input_precision="ieee")
        g_p = (
            g_t[:, None] * cosh_b[None, :]
            + gv_dot * sinh_b[None, :]
            + g_e[:, None] * exp_b[None, :]
            + g_e[:, None] * sinh_b[None, :] * chord_v
        )
        row_dot = tl.load(ROWDOT + offs_m, mask=mask_m, other=0.0)
        g_score = p * (g_p - row_dot[:, None])
        ratio = _asinhc_half(c) / tl.sqrt(1.0 + 0.5 * c)  # D / sinh D
        g_c = tl.where(valid, -scale * g_score * 2.0 * k_val * ratio, 0.0)
        return (
            p,
            g_p,
            g_score,
            g_c,
            chord,
            d2,
            a_q,
            sinh_a,
            a_k,
            uv,
            gv_dot,
            chord_v,
            sinh_b,
            cosh_b,
            exp_b,
            g_t,
            g_e,
            g_v,
        )

    @triton.jit(do_not_specialize=["n_q", "n_k"])
    def _polar_attention_bwd_q(
        RQ,
        UQ,
        RK,
        UK,
        RV,
        UV,
        KBAR,
        SCALE,
        STATS,
        UHAT,
        GT,
        GE,
        GV,
        ROWDOT,
        GAQ,
        GUQ,
        GSCALE,
        n_q,
        n_k,
        heads,
        sqrt_k,
        k_val,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        pid_m = tl.program_id(1)
        scale = tl.load(SCALE + bh % heads)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        mask_m, mask_d = offs_m < n_q, offs_d < D
        rows = tl.num_programs(0).to(tl.int64) * n_q
        RQ, UQ, UHAT, STATS, GT, GE, GV, ROWDOT = (
            RQ + bh * n_q,
            UQ + bh * n_q * D,
            UHAT + bh * n_q * D,
            STATS + bh * n_q,
            GT + bh * n_q,
            GE + bh * n_q,
            GV + bh * n_q * D,
            ROWDOT + bh * n_q,
        )
        RK, UK, RV, UV, KBAR = RK + bh * n_k, UK + bh * n_k * D, RV + bh * n_k, UV + bh * n_k * D, KBAR + bh * D
        # pass 1: the softmax row constant sum_j p_ij dL/dp_ij from the very values pass 2 uses
        row_dot = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, n_k, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            tile = _tile_backward(
                RQ,
                UQ,
                RK,
                UK,
                RV,
                UV,
                UHAT,
                STATS,
                GT,
                GE,
                GV,
                ROWDOT,
                offs_m,
                mask_m,
                offs_n,
                offs_n < n_k,
                offs_d,
                mask_d,
                rows,
                scale,
                sqrt_k,
                k_val,
                D,
                BLOCK_M,
                BLOCK_N,
            )
            row_dot += tl.sum(tile[0] * tile[1], axis=1)
        tl.store(ROWDOT + offs_m, row_dot, mask=mask_m)
        tl.debug_barrier()
        kbar = tl.load(KBAR + offs_d, mask=mask_d, other=0.0)
        uq = tl.load(UQ + offs_m[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        pq = tl.where(mask_d[None, :], uq - kbar[None, :], 0.0)
        g_a = tl.zeros((BLOCK_M,), tl.float32)
        g_u = tl.zeros((BLOCK_M, D_PAD), tl.float32)
        g_scale = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, n_k, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_k
            (
                p,
                g_p,
                g_score,
                g_c,
                chord,
                d2,
                a_q,
                sinh_a,
                a_k,
                uv,
                gv_dot,
                chord_v,
                sinh_b,
                cosh_b,
                exp_b,
                g_t,
                g_e,
                g_v,
            ) = _tile_backward(
                RQ,
                UQ,
                RK,
                UK,
                RV,
                UV,
                UHAT,
                STATS,
                GT,
                GE,
                GV,
                ROWDOT,
                offs_m,
                mask_m,
                offs_n,
                mask_n,
                offs_d,
                mask_d,
                rows,
                scale,
                sqrt_k,
                k_val,
                D,
                BLOCK_M,
                BLOCK_N,
            )
            g_scale += tl.sum(g_score * d2, axis=1)
            sinh_bk = _sinh(a_k)
            g_a += tl.sum(
                g_c * (_sinh(a_q[:, None] - a_k[None, :]) + _cosh(a_q)[:, None] * sinh_bk[None, :] * chord), axis=1
            )
            g_chord = g_c * sinh_a[:, None] * sinh_bk[None, :]
            uk = tl.load(UK + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            qk = tl.where(mask_d[None, :], uk - kbar[None, :], 0.0)
            g_u += pq * tl.sum(g_chord, axis=1)[:, None] - tl.dot(g_chord, qk, input_precision="ieee")
        tl.store(GAQ + bh * n_q + offs_m, g_a / sqrt_k, mask=mask_m)  # outputs: offset here
        tl.store(
            GUQ + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :], g_u, mask=mask_m[:, None] & mask_d[None, :]
        )
        tl.store(GSCALE + bh * n_q + offs_m, -g_scale, mask=mask_m)

    @triton.jit(do_not_specialize=["n_q", "n_k"])
    def _polar_attention_bwd_kv(
        RQ,
        UQ,
        RK,
        UK,
        RV,
        UV,
        KBAR,
        VBAR,
        SCALE,
        STATS,
        UHAT,
        GT,
        GE,
        GV,
        ROWDOT,
        GAK,
        GUK,
        GBV,
        GUV,
        n_q,
        n_k,
        heads,
        sqrt_k,
        k_val,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PART: tl.constexpr,
    ):
        # PART 0: key and value gradients; 1: keys only; 2: values only (wide heads: two launches,
        # each with half the head-wide accumulators live, so that nothing spills)
        bh = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        scale = tl.load(SCALE + bh % heads)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        mask_n, mask_d = offs_n < n_k, offs_d < D
        rows = tl.num_programs(0).to(tl.int64) * n_q
        RQ, UQ, UHAT, STATS, GT, GE, GV, ROWDOT = (
            RQ + bh * n_q,
            UQ + bh * n_q * D,
            UHAT + bh * n_q * D,
            STATS + bh * n_q,
            GT + bh * n_q,
            GE + bh * n_q,
            GV + bh * n_q * D,
            ROWDOT + bh * n_q,
        )
        RK, UK, RV, UV, KBAR = RK + bh * n_k, UK + bh * n_k * D, RV + bh * n_k, UV + bh * n_k * D, KBAR + bh * D
        kbar = tl.load(KBAR + offs_d, mask=mask_d, other=0.0)
        vbar = tl.load(VBAR + bh * D + offs_d, mask=mask_d, other=0.0)
        g_ak = tl.zeros((BLOCK_N,), tl.float32)
        g_uk = tl.zeros((BLOCK_N, D_PAD), tl.float32)
        g_bv = tl.zeros((BLOCK_N,), tl.float32)
        g_uv = tl.zeros((BLOCK_N, D_PAD), tl.float32)
        for start in range(0, n_q, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            mask_m = offs_m < n_q
            mask2d = mask_m[:, None] & mask_d[None, :]
            (
                p,
                g_p,
                g_score,
                g_c,
                chord,
                d2,
                a_q,
                sinh_a,
                a_k,
                uv,
                gv_dot,
                chord_v,
                sinh_b,
                cosh_b,
                exp_b,
                g_t,
                g_e,
                g_v,
            ) = _tile_backward(
                RQ,
                UQ,
                RK,
                UK,
                RV,
                UV,
                UHAT,
                STATS,
                GT,
                GE,
                GV,
                ROWDOT,
                offs_m,
                mask_m,
                offs_n,
                mask_n,
                offs_d,
                mask_d,
                rows,
                scale,
                sqrt_k,
                k_val,
                D,
                BLOCK_M,
                BLOCK_N,
            )
            if PART != 1:
                g_bv += tl.sum(
                    p
                    * (
                        g_t[:, None] * sinh_b[None, :]
                        + gv_dot * cosh_b[None, :]
                        - g_e[:, None] * exp_b[None, :]
                        + g_e[:, None] * cosh_b[None, :] * chord_v
                    ),
                    axis=0,
                )
                u_hat = tl.load(UHAT + offs_m[:, None] * D + offs_d[None, :], mask=mask2d, other=0.0)
                ph = tl.where(mask_d[None, :], u_hat - vbar[None, :], 0.0)
                qv = tl.where(mask_d[None, :], uv - vbar[None, :], 0.0)
                w_s = p * g_e[:, None] * sinh_b[None, :]
                g_uv += (
                    tl.dot(tl.trans(p * sinh_b[None, :]), g_v, input_precision="ieee")
                    + qv * tl.sum(w_s, axis=0)[:, None]
                    - tl.dot(tl.trans(w_s), ph, input_precision="ieee")
                )
            if PART != 2:
                uq = tl.load(UQ + offs_m[:, None] * D + offs_d[None, :], mask=mask2d, other=0.0)
                pq = tl.where(mask_d[None, :], uq - kbar[None, :], 0.0)
                g_ak += tl.sum(
                    g_c * (_sinh(a_k[None, :] - a_q[:, None]) + sinh_a[:, None] * _cosh(a_k)[None, :] * chord), axis=0
                )
                g_chord = g_c * sinh_a[:, None] * _sinh(a_k)[None, :]
                uk = tl.load(
                    UK + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
                )
                qk = tl.where(mask_d[None, :], uk - kbar[None, :], 0.0)
                g_uk += qk * tl.sum(g_chord, axis=0)[:, None] - tl.dot(tl.trans(g_chord), pq, input_precision="ieee")
        col2d = offs_n[:, None] * D + offs_d[None, :]
        maskn2d = mask_n[:, None] & mask_d[None, :]
        if PART != 2:
            tl.store(GAK + bh * n_k + offs_n, g_ak / sqrt_k, mask=mask_n)
            tl.store(GUK + bh * n_k * D + col2d, g_uk, mask=maskn2d)
        if PART != 1:
            tl.store(GBV + bh * n_k + offs_n, g_bv / sqrt_k, mask=mask_n)
            tl.store(GUV + bh * n_k * D + col2d, g_uv, mask=maskn2d)

    KERNELS = {"fwd": _polar_attention_fwd, "bwd_q": _polar_attention_bwd_q, "bwd_kv": _polar_attention_bwd_kv}


def padded_head_dim(head_dim: int) -> int:
    """The register width of a head: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def kv_parts(head_dim: int) -> tuple[int, ...]:
    """``PART`` values of the dk/dv launches: one launch, or keys and values apart for wide heads."""
    return (1, 2) if padded_head_dim(head_dim) >= 128 else (0,)


def launch_config(kernel: str, head_dim: int) -> dict[str, int]:
    """``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages`` of one baseline kernel."""
    bm, bn, warps, stages = LAUNCH_CONFIGS[kernel][min(padded_head_dim(head_dim), 128)]
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def _flat(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).contiguous().float()


class _BaselineAttention(torch.autograd.Function):
    """The baseline kernels' forward and backward launches."""

    @staticmethod
    def forward(ctx: Any, rq, uq, rk, uk, rv, uv, scale, k):  # noqa: D102
        batch, heads, n_q, dim = uq.shape
        n_k = uk.shape[2]
        flat = [_flat(t) for t in (rq, uq, rk, uk, rv, uv)]
        kbar, vbar = flat[3].mean(dim=1).contiguous(), flat[5].mean(dim=1).contiguous()
        r_out, u_out, vc_out = torch.empty_like(flat[0]), torch.empty_like(flat[1]), torch.empty_like(flat[1])
        stats = torch.empty(7, batch * heads, n_q, dtype=torch.float32, device=uq.device)
        cfg = launch_config("fwd", dim)
        KERNELS["fwd"][(batch * heads, triton.cdiv(n_q, cfg["BLOCK_M"]))](
            *flat,
            vbar,
            scale.float().contiguous(),
            r_out,
            u_out,
            vc_out,
            stats,
            n_q,
            n_k,
            heads,
            math.sqrt(k),
            float(k),
            D=dim,
            D_PAD=padded_head_dim(dim),
            **cfg,
        )
        ctx.save_for_backward(*flat, scale, r_out, u_out, vc_out, stats, kbar, vbar)
        ctx.k, ctx.shapes = k, (rq.shape, uq.shape, rk.shape, uk.shape, rv.shape, uv.shape)
        return r_out.view(rq.shape), u_out.view(uq.shape)

    @staticmethod
    def backward(ctx: Any, grad_r: Tensor, grad_u: Tensor):  # noqa: D102
        *flat, scale, r_out, u_out, vc_out, stats, kbar, vbar = ctx.saved_tensors
        k, shapes = ctx.k, ctx.shapes
        batch, heads, n_q, dim = shapes[1]
        n_k = shapes[3][2]
        sk = math.sqrt(k)
        values = CentredValues(stats[6], vc_out, vbar.unsqueeze(1))
        g_t, g_e, _, g_v, row_dot = row_gradients(
            _flat(grad_r), _flat(grad_u), stats[:6], r_out / sk, u_out, values, k
        )
        g_t, g_e, g_v, row_dot = (t.contiguous() for t in (g_t, g_e, g_v, row_dot))
        rows = (*flat, kbar)
        g_aq, g_uq, g_scale_rows = torch.empty_like(flat[0]), torch.empty_like(flat[1]), torch.empty_like(flat[0])
        g_ak, g_uk, g_bv, g_uv = (torch.empty_like(t) for t in flat[2:6])
        tail = (scale.float().contiguous(), stats, u_out, g_t, g_e, g_v, row_dot)
        sizes = dict(D=dim, D_PAD=padded_head_dim(dim))
        cfg_q, cfg_kv = launch_config("bwd_q", dim), launch_config("bwd_kv", dim)
        KERNELS["bwd_q"][(batch * heads, triton.cdiv(n_q, cfg_q["BLOCK_M"]))](
            *rows, *tail, g_aq, g_uq, g_scale_rows, n_q, n_k, heads, sk, k, **sizes, **cfg_q
        )
        for part in kv_parts(dim):
            KERNELS["bwd_kv"][(batch * heads, triton.cdiv(n_k, cfg_kv["BLOCK_N"]))](
                *rows, vbar, *tail, g_ak, g_uk, g_bv, g_uv, n_q, n_k, heads, sk, k, **sizes, **cfg_kv, PART=part
            )
        grads = (g_aq, g_uq, g_ak, g_uk, g_bv, g_uv)
        g_scale = g_scale_rows.view(batch, heads, n_q).sum(dim=(0, 2))
        return (*(g.view(shape) for g, shape in zip(grads, shapes)), g_scale, None)


def baseline_polar_attention(rq, uq, rk, uk, rv, uv, scale, k: float = 1.0) -> tuple[Tensor, Tensor]:
    """The baseline kernels' polar attention (float32 inputs; CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""
    return _BaselineAttention.apply(rq, uq, rk, uk, rv, uv, scale, float(k))
