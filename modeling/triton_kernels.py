"""The Triton kernels of the fused polar attention: forward, backward dq, backward dk/dv (paper Sec. 4.2, App. D.1,
E.5); launched by :mod:`triton_attention`.

FlashAttention-2's shape: a program holds a query block (forward, ``bwd_dq``) or a key block (``bwd_dkdv``) and
streams the other side's blocks through a software pipeline (``num_stages``); the ``N x N`` matrix is never
stored.  The forward carries the online softmax, the centroid's sums (Eq. 6, 7, 22) and its running direction.
Each backward kernel recomputes the scores once per tile, without atomics: ``bwd_dq`` first, from the analytic
softmax row constant ``sum_j p_ij dL/dp_ij`` of the row gradients (like FlashAttention's ``rowsum(dO o O)``),
corrected at the end of its pass over the keys to the constant its own tiles' rounding calls for (every sum it
carries is linear in the constant); ``bwd_dkdv`` then reads the corrected constant.

Numerics (float32 math on float32 copies of the inputs):

* chords ``1/2 ||u - v||^2`` exact to the input precision, by one of two designs (``GRAM``):
  the float64 Gram product ``1/2 |u|^2 + 1/2 |v|^2 - u.v`` (``tl.dot`` in float64: products of float32
  coordinates are exact in float64, the sum is off by ~1e-16; on the FP64 tensor cores of A100/H100/H200), or
  the coordinate differences, 4 coordinates of both sides at a time (GPUs without fast float64; and the Gram
  design's chords below ``CHORD_PRODUCT_ABOVE``, as on the CPU);
* the value-side and gradient products (``P V'``, ``dS K``, ``dS^T Q``, ``dL/dP``'s ``g_V . v``) are ``tl.dot``
  at ``DOT`` precision: ``bf16x6`` (each float32 operand split into three bfloat16 parts, the six larger partial
  products on the tensor cores; those left out are below 2^-24 of each product, where TF32x3's low part keeps
  11 of its 13 bits, 2^-22) from sm_80 on, ``ieee`` before; the chord gradients are centred on the mean key /
  value direction (Eq. 25), so their error scales with the spread;
* ``S`` of the centroid is carried through the key blocks exactly, as a sum of non-negative terms,
  with the identity proved in ``attention._ChunkedPolarAttention``:
  ``S_new = S_old + ||V_old|| 1/2 ||u_old - u_new||^2 + sum_j w_j sinh b_j 1/2 ||v_j - u_new||^2``;
  the value sum is carried centred on the mean value direction, for the backward's stationarity correction;
* each token's ``e^{+-a/2}``, ``sinh a``, ``cosh a``, ``e^{-a}`` come from a table computed once per token
  (:func:`triton_attention.radius_table`); per pair the radii's term of Eq. 5 is a product of those
  exponentials (:func:`stable_math.pair_cosh_minus_one`: no transcendental), and the distance is
  ``acosh(1 + c) = log1p(c + q)`` with ``q = sqrt(c (2 + c))``: one reciprocal square root (which also gives
  the backward's ``1 / q``) and one logarithm (Kahan's ``log1p`` without a division), no branch;
* the centroid's radius uses the log domain of Eq. 22.

The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch

from .fused_attention import CHORD_PRODUCT_ABOVE

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
    CHORD_PRODUCT_ABOVE_TL = tl.constexpr(CHORD_PRODUCT_ABOVE)  # fused_attention's, as a compile-time constant
except ImportError:  # pragma: no cover - triton is optional
    triton = None
    tl = None
    TRITON_AVAILABLE = False


def triton_usable(device: torch.device) -> bool:
    """Triton kernels can run on ``device`` (CUDA, or any device under ``TRITON_INTERPRET=1``)."""
    import os

    return TRITON_AVAILABLE and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


if TRITON_AVAILABLE:

    @triton.jit
    def _log1p(x):
        """``log(1 + x)`` of ``x >= 0`` to a few ulp without a division: ``log u`` of ``u = 1 + x`` rounded, plus the
        rounding's own correction ``(x - (u - 1)) / u`` (Kahan), with ``1/u = (2 - u)(1 + (u - 1)^2) (1 + (u - 1)^4)``
        (relative error ``(u - 1)^8``) below ``u = 2``; from there the correction is below ``eps / 2`` of the result
        and is left out."""
        u = 1.0 + x
        t = u - 1.0
        t2 = t * t
        inverse = (1.0 - t) * (1.0 + t2) * (1.0 + t2 * t2)
        return tl.log(u) + tl.where(u < 2.0, (x - t) * inverse, 0.0)

    @triton.jit
    def _sinhc_series(z):
        """``sinh(y) / y`` of ``z = y^2 <= 9/4`` by its Taylor series ``sum_k z^k / (2k + 1)!``, 7 terms (the first
        left out, ``2.25^7 / 15!``, is ``2e-10``): :func:`stable_math.half_angle_series` in float32."""
        return 1.0 + z * (
            0.16666666666666666
            + z
            * (
                0.008333333333333333
                + z
                * (
                    0.0001984126984126984
                    + z * (2.7557319223985893e-06 + z * (2.505210838544172e-08 + z * (1.6059043836821613e-10)))
                )
            )
        )

    @triton.jit
    def _radius_terms(T, offs, mask, plane):
        """The radius table's six planes (:func:`triton_attention.radius_table`) at ``offs``: ``(a, e^{a/2},
        e^{-a/2}, sinh a, cosh a, e^{-a})`` with ``a = r / sqrt k`` (those of ``a = 0`` outside ``mask``)."""
        return (
            tl.load(T + offs, mask=mask, other=0.0),
            tl.load(T + plane + offs, mask=mask, other=1.0),
            tl.load(T + 2 * plane + offs, mask=mask, other=1.0),
            tl.load(T + 3 * plane + offs, mask=mask, other=0.0),
            tl.load(T + 4 * plane + offs, mask=mask, other=1.0),
            tl.load(T + 5 * plane + offs, mask=mask, other=1.0),
        )

    @triton.jit
    def _half_gap(a_q, half_q, inv_half_q, a_k, half_k, inv_half_k):
        """``sinh y`` and ``cosh y`` of ``y = (a_i - b_j) / 2`` for every pair, without a transcendental function:
        ``e^{+-y}`` are products of the tokens' ``e^{+-a/2}`` (:func:`stable_math.pair_cosh_minus_one`); ``sinh y``
        is ``(e^y - e^{-y}) / 2`` from ``|y| = 3/2`` (rounding amplified at most ``coth 1.5 = 1.1`` times), its
        Taylor series ``y sum_k y^2k / (2k+1)!`` (7 terms) below."""
        y = 0.5 * (a_q[:, None] - a_k[None, :])
        up = half_q[:, None] * inv_half_k[None, :]
        down = inv_half_q[:, None] * half_k[None, :]
        return tl.where(tl.abs(y) < 1.5, y * _sinhc_series(y * y), 0.5 * (up - down)), 0.5 * (up + down)

    @triton.jit
    def _acosh1p(c):
        """``(acosh(1 + c), q, 1 / q)`` with ``q = sinh acosh(1 + c) = sqrt(c (2 + c))``, ``c >= 0``: one reciprocal
        square root for both (``c (2 + c)`` scaled by ``2^-128`` from ``c = 2^50``, where it would overflow), then
        ``log1p(c + q)``; the distance of Eq. 5 is ``sqrt(k)`` times the first (``1 / q = inf`` at ``c = 0``)."""
        small = c < 1125899906842624.0  # 2^50
        s = tl.where(small, 1.0, 5.421010862427522e-20)  # 2^-64
        t = (c * s) * ((2.0 + c) * s)
        r = tl.rsqrt(t)
        q = tl.where(t > 0, t * r, 0.0) * tl.where(small, 1.0, 18446744073709551616.0)
        return _log1p(c + q), q, r * s

    @triton.jit
    def _column_blocks(X, offs_m, mask_m, Y, offs_n, mask_n, start, D: tl.constexpr, DC: tl.constexpr):
        """Coordinates ``start .. start + DC`` of the rows ``X[offs_m]`` and ``Y[offs_n]`` (``D`` floats each)."""
        offs_d = start + tl.arange(0, DC)
        mask_d = offs_d < D
        xs = tl.load(X + offs_m[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        ys = tl.load(Y + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        return xs, ys

    @triton.jit
    def _difference_chords(X, offs_m, mask_m, Y, offs_n, mask_n, D: tl.constexpr, D_PAD: tl.constexpr):
        """``1/2 ||x_i - y_j||^2`` from the coordinate differences, 4 coordinates of both sides at a time (a loop:
        one ``M x N x 4`` tile of differences live)."""
        chord = tl.zeros((offs_m.shape[0], offs_n.shape[0]), tl.float32)
        for start in range(0, D_PAD, 4):
            xs, ys = _column_blocks(X, offs_m, mask_m, Y, offs_n, mask_n, start, D, 4)
            diff = xs[:, None, :] - ys[None, :, :]
            chord += 0.5 * tl.sum(diff * diff, axis=2)
        return chord

    @triton.jit
    def _column_chords(X, offs_m, mask_m, Y, offs_n, mask_n, D: tl.constexpr):
        """:func:`_difference_chords` one coordinate at a time, each loaded as a column ``(M, 1)`` and a row
        ``(1, N)`` of the tile's own layout: no tile but the chords' live (the Gram design's rare path, which
        must not raise the kernels' register count)."""
        chord = tl.zeros((offs_m.shape[0], offs_n.shape[0]), tl.float32)
        for dd in range(D):
            x = tl.load(X + offs_m[:, None] * D + dd, mask=mask_m[:, None], other=0.0)
            y = tl.load(Y + offs_n[None, :] * D + dd, mask=mask_n[None, :], other=0.0)
            diff = x - y
            chord += diff * diff
        return 0.5 * chord

    @triton.jit
    def _chords(
        X,
        offs_m,
        mask_m,
        HX,
        Y,
        offs_n,
        mask_n,
        HY,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        GRAM: tl.constexpr,
    ):
        """``1/2 ||x_i - y_j||^2`` of the rows ``X[offs_m]`` and ``Y[offs_n]`` in memory (``D`` floats each), exact to
        the input precision (no tile held across the call).

        ``GRAM``: ``1/2 |x|^2 + 1/2 |y|^2 - x.y`` from the float64 half squared norms ``HX[offs_m]``, ``HY[offs_n]``
        and float64 ``tl.dot`` of 16 coordinates at a time (products of float32 coordinates exact, the sum off by
        ~1e-16, at most 2e-9 of a chord from ``CHORD_PRODUCT_ABOVE`` on: the float32 rounding of the exact chord);
        a tile holding a smaller chord takes those from the coordinate differences (:func:`_column_chords`), as
        :func:`fused_attention.pair_chords` does.  Otherwise the coordinate differences throughout
        (:func:`_difference_chords`).
        """
        if GRAM:
            dot = tl.zeros((offs_m.shape[0], offs_n.shape[0]), tl.float64)
            for start in tl.static_range(0, D_PAD, 16):
                xs, ys = _column_blocks(X, offs_m, mask_m, Y, offs_n, mask_n, start, D, 16)
                dot = tl.dot(xs.to(tl.float64), tl.trans(ys.to(tl.float64)), dot)
            half_x = tl.load(HX + offs_m, mask=mask_m, other=0.0)
            half_y = tl.load(HY + offs_n, mask=mask_n, other=0.0)
            chord = tl.maximum(half_x[:, None] + half_y[None, :] - dot, 0.0).to(tl.float32)
            small = (chord < CHORD_PRODUCT_ABOVE_TL) & mask_m[:, None] & mask_n[None, :]
            if tl.max(small.to(tl.int32)) > 0:  # nearly equal directions in this tile
                chord = tl.where(small, _column_chords(X, offs_m, mask_m, Y, offs_n, mask_n, D), chord)
        else:
            chord = _difference_chords(X, offs_m, mask_m, Y, offs_n, mask_n, D, D_PAD)
        return chord

    @triton.jit
    def _register_chords(x, y, half_y):
        """``1/2 ||x_i - y_j||^2`` of the float32 tiles ``x (M, D_PAD)``, ``y (N, D_PAD)`` in registers, by the
        float64 Gram product of :func:`_chords` (``half_y``: the float64 ``1/2 |y|^2``)."""
        x64 = x.to(tl.float64)
        dot = tl.dot(x64, tl.trans(y.to(tl.float64)))
        half_x = 0.5 * tl.sum(x64 * x64, axis=1)
        return tl.maximum(half_x[:, None] + half_y[None, :] - dot, 0.0).to(tl.float32)

    @triton.jit
    def _row_products(X, offs_m, mask_m, Y, offs_n, mask_n, D: tl.constexpr, D_PAD: tl.constexpr, DOT: tl.constexpr):
        """``x_i . y_j`` of the rows ``X[offs_m]``, ``Y[offs_n]`` in memory: ``tl.dot`` at ``DOT`` precision over
        16 coordinates at a time (no head-wide tile held across the call)."""
        out = tl.zeros((offs_m.shape[0], offs_n.shape[0]), tl.float32)
        for start in range(0, D_PAD, 16):
            offs_d = start + tl.arange(0, 16)
            mask_d = offs_d < D
            xs = tl.load(X + offs_m[:, None] * D + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            ys = tl.load(Y + offs_n[:, None] * D + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            out = tl.dot(xs, tl.trans(ys), out, input_precision=DOT)
        return out

    @triton.jit
    def _running_chords(
        u_hat,
        UHAT,
        offs_m,
        mask_m,
        offs_d,
        mask_d,
        Y,
        offs_n,
        mask_n,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        GRAM: tl.constexpr,
    ):
        """The coordinate-difference chords of the forward's running direction ``u_hat`` (registers), written to
        this program's rows ``UHAT[offs_m]`` of the output first (the differences read their coordinates from
        memory): :func:`_column_chords` for the Gram design's rare path, else :func:`_difference_chords`."""
        tl.debug_barrier()  # every thread has read the old direction ...
        tl.store(UHAT + offs_m[:, None] * D + offs_d[None, :], u_hat, mask=mask_m[:, None] & mask_d[None, :])
        tl.debug_barrier()  # ... and sees the new one
        if GRAM:
            chord = _column_chords(UHAT, offs_m, mask_m, Y, offs_n, mask_n, D)
        else:
            chord = _difference_chords(UHAT, offs_m, mask_m, Y, offs_n, mask_n, D, D_PAD)
        return chord

    @triton.jit
    def _key_value_slice(RK, UK, HK, RV, UV, HV, bh, n_k, D: tl.constexpr):
        """The key and value arrays' pointers offset to the ``(batch, head)`` slice ``bh``."""
        return RK + bh * n_k, UK + bh * n_k * D, HK + bh * n_k, RV + bh * n_k, UV + bh * n_k * D, HV + bh * n_k

    @triton.jit
    def _tile(ptr, offs, mask, offs_d, mask_d, D: tl.constexpr):
        """Rows ``offs`` of a ``(rows, D)`` float32 array as a ``(len(offs), D_PAD)`` tile (zeros outside)."""
        return tl.load(ptr + offs[:, None] * D + offs_d[None, :], mask=mask[:, None] & mask_d[None, :], other=0.0)

    @triton.jit(do_not_specialize=["n_q", "n_k"])
    def _polar_attention_fwd(
        RQ,
        UQ,
        HQ,
        RK,
        UK,
        HK,
        RV,
        UV,
        HV,
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
        GRAM: tl.constexpr,
        DOT: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)  # (batch, head) slices on grid axis 0 (2^31 - 1 programs)
        pid_m = tl.program_id(1)
        plane_q, plane_k = tl.num_programs(0).to(tl.int64) * n_q, tl.num_programs(0).to(tl.int64) * n_k
        scale = tl.load(SCALE + bh % heads)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        mask_m, mask_d = offs_m < n_q, offs_d < D
        tile_m = offs_m[:, None] * D + offs_d[None, :]
        mask_md = mask_m[:, None] & mask_d[None, :]
        RQ, UQ, HQ, ROUT, UOUT = RQ + bh * n_q, UQ + bh * n_q * D, HQ + bh * n_q, ROUT + bh * n_q, UOUT + bh * n_q * D
        RK, UK, HK, RV, UV, HV = _key_value_slice(RK, UK, HK, RV, UV, HV, bh, n_k, D)
        vbar = tl.load(VBAR + bh * D + offs_d, mask=mask_d, other=0.0)
        a_q, half_q, inv_half_q, sinh_a, _cosh_a, _exp_a = _radius_terms(RQ, offs_m, mask_m, plane_q)
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
        u_hat = tl.zeros((BLOCK_M, D_PAD), tl.float32)  # the running direction (the output's at the end)
        for start in range(0, n_k, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_k
            a_k, half_k, inv_half_k, sinh_ak, _cosh_ak, _exp_ak = _radius_terms(RK, offs_n, mask_n, plane_k)
            chord = _chords(UQ, offs_m, mask_m, HQ, UK, offs_n, mask_n, HK, D, D_PAD, GRAM)
            gap, _cosh_gap = _half_gap(a_q, half_q, inv_half_q, a_k, half_k, inv_half_k)
            ell, _sinh_ell, _inv_sinh_ell = _acosh1p(2.0 * gap * gap + sinh_a[:, None] * sinh_ak[None, :] * chord)
            # the very expression of the backward's probabilities (_pair_gradients): the same rounding
            scores = tl.where(mask_n[None, :], -scale * (k_val * ell * ell), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            e = tl.exp(scores - m_new[:, None])
            _b, _half_b, _inv_half_b, sinh_b, cosh_b, exp_b = _radius_terms(RV, offs_n, mask_n, plane_k)
            uv = _tile(UV, offs_n, mask_n, offs_d, mask_d, D)
            w = e * sinh_b[None, :]
            l_i = l_i * alpha + tl.sum(e, axis=1)
            t_i = t_i * alpha + tl.sum(e * cosh_b[None, :], axis=1)
            e_i = e_i * alpha + tl.sum(e * exp_b[None, :], axis=1)
            w_i = w_i * alpha + tl.sum(w, axis=1)
            v_old_norm = v_norm * alpha
            # padded keys have w = 0, padded columns uv = v_bar = 0: no mask needed
            vc_acc = vc_acc * alpha[:, None] + tl.dot(w, uv - vbar[None, :], input_precision=DOT)
            v_acc = vc_acc + w_i[:, None] * vbar[None, :]
            v_norm = tl.sqrt(tl.sum(v_acc * v_acc, axis=1))
            u_new = v_acc * (1.0 / tl.where(v_norm > 0, v_norm, 1.0))[:, None]
            step = u_hat - u_new
            u_hat = u_new
            hv = tl.load(HV + offs_n, mask=mask_n, other=0.0)
            if GRAM:  # as _chords: the Gram product, and the differences where a chord is below its range
                chord_v = _register_chords(u_hat, uv, hv)
                small = (chord_v < CHORD_PRODUCT_ABOVE_TL) & mask_m[:, None] & mask_n[None, :]
                if tl.max(small.to(tl.int32)) > 0:
                    exact = _running_chords(
                        u_hat, UOUT, offs_m, mask_m, offs_d, mask_d, UV, offs_n, mask_n, D, D_PAD, GRAM
                    )
                    chord_v = tl.where(small, exact, chord_v)
            else:
                chord_v = _running_chords(
                    u_hat, UOUT, offs_m, mask_m, offs_d, mask_d, UV, offs_n, mask_n, D, D_PAD, GRAM
                )
            s_i = s_i * alpha + v_old_norm * 0.5 * tl.sum(step * step, axis=1) + tl.sum(w * chord_v, axis=1)
            m_i = m_new
        degenerate = v_norm <= 0
        log_sinh = tl.log(tl.where(degenerate, 1.0, v_norm)) - 0.5 * tl.log(e_i + s_i) - 0.5 * tl.log(t_i + v_norm)
        # asinh(e^l) without overflow (stable_math.asinh_exp)
        pos, neg = tl.maximum(log_sinh, 0.0), tl.exp(tl.minimum(log_sinh, 0.0))
        a_mu = tl.where(
            log_sinh > 0,
            pos + tl.log(1.0 + tl.sqrt(1.0 + tl.exp(-2.0 * pos))),
            _log1p(neg + neg * neg / (1.0 + tl.sqrt(1.0 + neg * neg))),
        )
        tl.store(ROUT + offs_m, tl.where(degenerate, 0.0, a_mu) * sqrt_k, mask=mask_m)
        tl.store(UOUT + tile_m, u_hat, mask=mask_md)
        base = STATS + bh * n_q + offs_m
        tl.store(base, m_i, mask=mask_m)
        tl.store(base + plane_q, l_i, mask=mask_m)  # the statistics' planes: like the radius tables'
        tl.store(base + 2 * plane_q, t_i / l_i, mask=mask_m)
        tl.store(base + 3 * plane_q, e_i / l_i, mask=mask_m)
        tl.store(base + 4 * plane_q, s_i / l_i, mask=mask_m)
        tl.store(base + 5 * plane_q, v_norm / l_i, mask=mask_m)
        tl.store(base + 6 * plane_q, w_i / l_i, mask=mask_m)
        tl.store(VCOUT + bh * n_q * D + tile_m, vc_acc / l_i[:, None], mask=mask_md)

    @triton.jit
    def _pair_gradients(
        row,
        col,
        pointers,
        offs_m,
        mask_m,
        offs_n,
        mask_n,
        scale,
        k_val,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        GRAM: tl.constexpr,
        DOT: tl.constexpr,
    ):
        """One (query block, key block) tile of the backward, the scores recomputed once: ``(p, gv_dot, chord_v,
        g_score, slope, chord, d2, sinh_y, cosh_y)`` with ``g_score = p (dL/dp - row_dot) = dL/d(score)`` and
        ``slope = d(score)/dc`` (Eq. 5; ``dL/dc = slope g_score``), zero outside the valid pairs; ``row`` and ``col``
        from :func:`_row_side` and :func:`_column_side`, ``pointers`` the directions, their half squared norms and
        ``g_V`` (offset to the slice)."""
        a_q, half_q, inv_half_q, sinh_a, _cosh_a, m_i, inv_l, g_t, g_e, row_dot = row
        a_k, half_k, inv_half_k, sinh_ak, _cosh_ak, sinh_b, cosh_b, exp_b = col
        UQ, HQ, UHAT, HHAT, UK, HK, UV, HV, GV = pointers
        valid = mask_m[:, None] & mask_n[None, :]
        chord = _chords(UQ, offs_m, mask_m, HQ, UK, offs_n, mask_n, HK, D, D_PAD, GRAM)
        sinh_y, cosh_y = _half_gap(a_q, half_q, inv_half_q, a_k, half_k, inv_half_k)
        ell, q, inv_q = _acosh1p(2.0 * sinh_y * sinh_y + sinh_a[:, None] * sinh_ak[None, :] * chord)
        d2 = k_val * ell * ell
        p = tl.where(valid, tl.exp(-scale * d2 - m_i[:, None]) * inv_l[:, None], 0.0)
        chord_v = _chords(UHAT, offs_m, mask_m, HHAT, UV, offs_n, mask_n, HV, D, D_PAD, GRAM)
        gv_dot = _row_products(GV, offs_m, mask_m, UV, offs_n, mask_n, D, D_PAD, DOT)
        g_p = (
            g_t[:, None] * cosh_b[None, :]
            + gv_dot * sinh_b[None, :]
            + g_e[:, None] * exp_b[None, :]
            + g_e[:, None] * sinh_b[None, :] * chord_v
        )
        g_score = p * (g_p - row_dot[:, None])
        ratio = tl.where(q > 0, ell * inv_q, 1.0)  # d acosh(1 + c) / dc times acosh(1 + c)
        slope = tl.where(valid, -2.0 * scale * k_val * ratio, 0.0)  # d(score) / dc
        return p, gv_dot, chord_v, g_score, slope, chord, d2, sinh_y, cosh_y

    @triton.jit
    def _row_side(RQ, STATS, GT, GE, ROWDOT, offs_m, mask_m, rows):
        """A query block's operands of the backward (pointers offset to the slice): radii terms, the softmax
        maximum ``m`` and ``1 / l`` (``p = e^{score - m} / l`` rounded as the forward's sums were), the row gradients
        ``g_T``, ``g_E`` and the softmax row constant."""
        a_q, half_q, inv_half_q, sinh_a, cosh_a, _ = _radius_terms(RQ, offs_m, mask_m, rows)
        return (
            a_q,
            half_q,
            inv_half_q,
            sinh_a,
            cosh_a,
            tl.load(STATS + offs_m, mask=mask_m, other=0.0),
            1.0 / tl.load(STATS + rows + offs_m, mask=mask_m, other=1.0),
            tl.load(GT + offs_m, mask=mask_m, other=0.0),
            tl.load(GE + offs_m, mask=mask_m, other=0.0),  # g_S = g_E (Eq. 22)
            tl.load(ROWDOT + offs_m, mask=mask_m, other=0.0),
        )

    @triton.jit
    def _column_side(RK, RV, offs_n, mask_n, plane_k):
        """A key block's operands of the backward: the key and value radii terms."""
        a_k, half_k, inv_half_k, sinh_ak, cosh_ak, _ = _radius_terms(RK, offs_n, mask_n, plane_k)
        _, _, _, sinh_b, cosh_b, exp_b = _radius_terms(RV, offs_n, mask_n, plane_k)
        return (
            a_k,
            half_k,
            inv_half_k,
            sinh_ak,
            cosh_ak,
            sinh_b,
            cosh_b,
            exp_b,
        )

    @triton.jit(do_not_specialize=["n_q", "n_k"])
    def _polar_attention_bwd_dq(
        RQ,
        UQ,
        HQ,
        RK,
        UK,
        HK,
        RV,
        UV,
        HV,
        KBAR,
        SCALE,
        STATS,
        UHAT,
        HHAT,
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
        GRAM: tl.constexpr,
        DOT: tl.constexpr,
        CHORD_DOT: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        pid_m = tl.program_id(1)
        scale = tl.load(SCALE + bh % heads)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        mask_m, mask_d = offs_m < n_q, offs_d < D
        rows, plane_k = tl.num_programs(0).to(tl.int64) * n_q, tl.num_programs(0).to(tl.int64) * n_k
        UQ, UHAT, GV = UQ + bh * n_q * D, UHAT + bh * n_q * D, GV + bh * n_q * D
        HQ, HHAT = HQ + bh * n_q, HHAT + bh * n_q
        RK, UK, HK, RV, UV, HV = _key_value_slice(RK, UK, HK, RV, UV, HV, bh, n_k, D)
        row = _row_side(
            RQ + bh * n_q,
            STATS + bh * n_q,
            GT + bh * n_q,
            GE + bh * n_q,
            ROWDOT + bh * n_q,
            offs_m,
            mask_m,
            rows,
        )
        sinh_a, cosh_a, row_dot = row[3], row[4], row[9]
        pointers = (UQ, HQ, UHAT, HHAT, UK, HK, UV, HV, GV)
        kbar = tl.load(KBAR + bh * D + offs_d, mask=mask_d, other=0.0)
        # every sum twice: with g_score and with p in its place (the row constant's correction, below); the chord
        # gradient sum_j g_ij (u_i - v_j), centred on the mean key (Eq. 25): (u_i - kbar) sum_j g_ij, at the end,
        # minus the product with the centred keys
        g_a, p_a = tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
        g_u, p_u = tl.zeros((BLOCK_M, D_PAD), tl.float32), tl.zeros((BLOCK_M, D_PAD), tl.float32)
        g_rows, p_rows = tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
        g_scale, p_scale = tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
        g_score_sum, p_sum = tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, n_k, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_k
            col = _column_side(RK, RV, offs_n, mask_n, plane_k)
            sinh_ak = col[3]
            p, _gv_dot, _chord_v, g_score, slope, chord, d2, sinh_y, cosh_y = _pair_gradients(
                row, col, pointers, offs_m, mask_m, offs_n, mask_n, scale, k_val, D, D_PAD, GRAM, DOT
            )
            g_score_sum += tl.sum(g_score, axis=1)
            p_sum += tl.sum(p, axis=1)
            g_scale += tl.sum(g_score * d2, axis=1)
            p_scale += tl.sum(p * d2, axis=1)
            # dc/da = sinh(a - b) + cosh a sinh b chord, sinh(a - b) = 2 sinh y cosh y
            dc_da = slope * (2.0 * sinh_y * cosh_y + cosh_a[:, None] * sinh_ak[None, :] * chord)
            g_a += tl.sum(g_score * dc_da, axis=1)
            p_a += tl.sum(p * dc_da, axis=1)
            dc_dchord = slope * sinh_a[:, None] * sinh_ak[None, :]
            g_chord, p_chord = g_score * dc_dchord, p * dc_dchord
            g_rows += tl.sum(g_chord, axis=1)
            p_rows += tl.sum(p_chord, axis=1)
            qk = tl.where(mask_d[None, :], _tile(UK, offs_n, mask_n, offs_d, mask_d, D) - kbar[None, :], 0.0)
            g_u -= tl.dot(g_chord, qk, input_precision=CHORD_DOT)
            p_u -= tl.dot(p_chord, qk, input_precision=CHORD_DOT)
        # The row constant these tiles' own rounding calls for, sum_j p_ij dL/dp_ij, differs from the analytic one
        # by delta = sum_j g_score_ij + row_dot (sum_j p_ij - 1) (a few ulp of the terms): each sum above is linear
        # in the constant, so subtracting delta times its p-sum gives what the exact constant would have; the
        # key/value kernel, launched after this one, reads the corrected constant (written over the analytic one:
        # the autotuner restores it between timed launches).
        delta = g_score_sum + row_dot * (p_sum - 1.0)
        tl.store(ROWDOT + bh * n_q + offs_m, row_dot + delta, mask=mask_m)
        pq = tl.where(mask_d[None, :], _tile(UQ, offs_m, mask_m, offs_d, mask_d, D) - kbar[None, :], 0.0)
        g_u = g_u + pq * g_rows[:, None] - delta[:, None] * (p_u + pq * p_rows[:, None])
        tl.store(GAQ + bh * n_q + offs_m, (g_a - delta * p_a) / sqrt_k, mask=mask_m)
        tl.store(
            GUQ + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :], g_u, mask=mask_m[:, None] & mask_d[None, :]
        )
        tl.store(GSCALE + bh * n_q + offs_m, delta * p_scale - g_scale, mask=mask_m)

    @triton.jit(do_not_specialize=["n_q", "n_k"])
    def _polar_attention_bwd_dkdv(
        RQ,
        UQ,
        HQ,
        RK,
        UK,
        HK,
        RV,
        UV,
        HV,
        KBAR,
        VBAR,
        SCALE,
        STATS,
        UHAT,
        HHAT,
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
        GRAM: tl.constexpr,
        DOT: tl.constexpr,
        CHORD_DOT: tl.constexpr,
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
        rows, plane_k = tl.num_programs(0).to(tl.int64) * n_q, tl.num_programs(0).to(tl.int64) * n_k
        RQ, UQ, HQ, UHAT, HHAT, STATS, GT, GE, GV, ROWDOT = (
            RQ + bh * n_q,
            UQ + bh * n_q * D,
            HQ + bh * n_q,
            UHAT + bh * n_q * D,
            HHAT + bh * n_q,
            STATS + bh * n_q,
            GT + bh * n_q,
            GE + bh * n_q,
            GV + bh * n_q * D,
            ROWDOT + bh * n_q,
        )
        RK, UK, HK, RV, UV, HV = _key_value_slice(RK, UK, HK, RV, UV, HV, bh, n_k, D)
        col = _column_side(RK, RV, offs_n, mask_n, plane_k)
        sinh_ak, cosh_ak, sinh_b, cosh_b, exp_b = col[3], col[4], col[5], col[6], col[7]
        pointers = (UQ, HQ, UHAT, HHAT, UK, HK, UV, HV, GV)
        kbar = tl.load(KBAR + bh * D + offs_d, mask=mask_d, other=0.0)
        vbar = tl.load(VBAR + bh * D + offs_d, mask=mask_d, other=0.0)
        g_ak = tl.zeros((BLOCK_N,), tl.float32)
        g_uk = tl.zeros((BLOCK_N, D_PAD), tl.float32)
        g_bv = tl.zeros((BLOCK_N,), tl.float32)
        g_uv = tl.zeros((BLOCK_N, D_PAD), tl.float32)
        k_cols = tl.zeros((BLOCK_N,), tl.float32)  # sum_i dL/dchord_ij, times the centred key at the end
        v_cols = tl.zeros((BLOCK_N,), tl.float32)  # sum_i g_S,i p_ij sinh b_j, times the centred value at the end
        for start in range(0, n_q, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            mask_m = offs_m < n_q
            row = _row_side(RQ, STATS, GT, GE, ROWDOT, offs_m, mask_m, rows)
            sinh_a, g_t, g_e = row[3], row[7], row[8]
            p, gv_dot, chord_v, g_score, slope, chord, _d2, sinh_y, cosh_y = _pair_gradients(
                row, col, pointers, offs_m, mask_m, offs_n, mask_n, scale, k_val, D, D_PAD, GRAM, DOT
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
                # dL/dv_j: sum_i p_ij sinh b_j (g_V,i + g_S,i (v_j - u_hat_i)), the difference centred on the mean
                # value (Eq. 25): one product with g_V - g_S (u_hat - v_bar), and (v_j - v_bar) sum_i w_ij at the end
                w_v = p * sinh_b[None, :]
                g_e_col = g_e[:, None]
                v_cols += tl.sum(w_v * g_e_col, axis=0)
                ph = _tile(UHAT, offs_m, mask_m, offs_d, mask_d, D) - vbar[None, :]
                operand = _tile(GV, offs_m, mask_m, offs_d, mask_d, D) - g_e_col * tl.where(mask_d[None, :], ph, 0.0)
                g_uv += tl.dot(tl.trans(w_v), operand, input_precision=DOT)
            if PART != 2:
                g_c = slope * g_score
                # dc/db = -sinh(a - b) + sinh a cosh b chord
                g_ak += tl.sum(g_c * (sinh_a[:, None] * cosh_ak[None, :] * chord - 2.0 * sinh_y * cosh_y), axis=0)
                g_chord = g_c * sinh_a[:, None] * sinh_ak[None, :]
                k_cols += tl.sum(g_chord, axis=0)
                pq = tl.where(mask_d[None, :], _tile(UQ, offs_m, mask_m, offs_d, mask_d, D) - kbar[None, :], 0.0)
                g_uk -= tl.dot(tl.trans(g_chord), pq, input_precision=CHORD_DOT)
        col2d = offs_n[:, None] * D + offs_d[None, :]
        maskn2d = mask_n[:, None] & mask_d[None, :]
        if PART != 2:
            qk = tl.where(mask_d[None, :], _tile(UK, offs_n, mask_n, offs_d, mask_d, D) - kbar[None, :], 0.0)
            tl.store(GAK + bh * n_k + offs_n, g_ak / sqrt_k, mask=mask_n)
            tl.store(GUK + bh * n_k * D + col2d, g_uk + qk * k_cols[:, None], mask=maskn2d)
        if PART != 1:
            qv = tl.where(mask_d[None, :], _tile(UV, offs_n, mask_n, offs_d, mask_d, D) - vbar[None, :], 0.0)
            tl.store(GBV + bh * n_k + offs_n, g_bv / sqrt_k, mask=mask_n)
            tl.store(GUV + bh * n_k * D + col2d, g_uv + qv * v_cols[:, None], mask=maskn2d)


# the three kernels by the names of triton_attention.LAUNCH_CONFIGS (empty without triton)
KERNELS = (
    {"fwd": _polar_attention_fwd, "bwd_dq": _polar_attention_bwd_dq, "bwd_dkdv": _polar_attention_bwd_dkdv}
    if TRITON_AVAILABLE
    else {}
)

__all__ = ["KERNELS", "TRITON_AVAILABLE", "triton_usable"]
