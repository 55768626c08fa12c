"""Fused polar attention in Triton: the launch configurations and the autograd Function around the kernels of
:mod:`triton_kernels` (their numerics are described there).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .cpu_kernels import first_order
from .fused_attention import CentredValues, row_gradients
from .triton_kernels import KERNELS, TRITON_AVAILABLE, triton, triton_usable

# Default launch configuration per kernel and padded head width (the next power of two >= D, at
# least 16): (BLOCK_M, BLOCK_N, num_warps, num_stages), the largest blocks that do not spill on
# sm_90 and sm_80 (``python benchmarks/triton_report.py``; ieee float32 ``tl.dot`` runs on FMA units,
# so its operands are registers).  From ``SPLIT_KV_FROM`` on, the key and the value gradients are
# two launches of the dk/dv kernel (``PART`` 1 and 2).
LAUNCH_CONFIGS: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "fwd": {16: (64, 32, 8, 1), 32: (64, 16, 8, 1), 64: (32, 16, 8, 1), 128: (16, 32, 8, 1)},
    "bwd_q": {16: (32, 32, 8, 1), 32: (32, 32, 8, 1), 64: (32, 16, 8, 1), 128: (32, 16, 8, 1)},
    "bwd_kv": {16: (32, 32, 8, 1), 32: (16, 32, 8, 1), 64: (32, 16, 8, 1), 128: (16, 32, 8, 1)},
}
SPLIT_KV_FROM = 128


def padded_head_dim(head_dim: int) -> int:
    """The register width of a head: the next power of two, at least 16 (``tl.dot`` needs K >= 16)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def kv_parts(head_dim: int) -> tuple[int, ...]:
    """``PART`` values of the dk/dv launches: ``(0,)`` (one launch), or ``(1, 2)`` for wide heads."""
    return (1, 2) if padded_head_dim(head_dim) >= SPLIT_KV_FROM else (0,)


def launch_config(
    kernel: str, head_dim: int, block_m: int | None = None, block_n: int | None = None
) -> dict[str, int]:
    """``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages`` of ``kernel`` (``fwd``, ``bwd_q``, ``bwd_kv``).

    Defaults from :data:`LAUNCH_CONFIGS` (the widest tabulated width for wider heads); user block
    sizes must be powers of two >= 16 (``tl.dot`` needs 16 on every Triton this package supports).
    """
    d_pad = padded_head_dim(head_dim)
    table = LAUNCH_CONFIGS[kernel]
    bm, bn, warps, stages = table.get(d_pad, table[max(table)])
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name}={value}: Triton blocks must be powers of two >= 16")
    return dict(BLOCK_M=block_m or bm, BLOCK_N=block_n or bn, num_warps=warps, num_stages=stages)


class _TritonPolarAttention(torch.autograd.Function):
    """Autograd wrapper of the fused kernels (float32)."""

    @staticmethod
    def forward(ctx, rq, uq, rk, uk, rv, uv, scale, k, block_m, block_n):  # noqa: D102
        batch, heads, n_q, dim = uq.shape
        n_k = uk.shape[2]
        flat = [t.reshape(batch * heads, *t.shape[2:]).contiguous().float() for t in (rq, uq, rk, uk, rv, uv)]
        kbar = flat[3].mean(dim=1).contiguous()
        vbar = flat[5].mean(dim=1).contiguous()
        scale32 = scale.float().contiguous()
        r_out = torch.empty_like(flat[0])
        u_out = torch.empty_like(flat[1])
        vc_out = torch.empty_like(flat[1])
        stats = torch.empty(7, batch * heads, n_q, dtype=torch.float32, device=uq.device)
        cfg = launch_config("fwd", dim, block_m, block_n)
        with _on_device(uq.device):
            KERNELS["fwd"][(batch * heads, triton.cdiv(n_q, cfg["BLOCK_M"]))](
                *flat,
                vbar,
                scale32,
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
        ctx.save_for_backward(*flat, kbar, vbar, scale32, stats, r_out, u_out, vc_out)
        ctx.meta = (batch, heads, n_q, n_k, dim, float(k), block_m, block_n, rq.dtype, scale.dtype)
        shape_r, shape_u = (batch, heads, n_q), (batch, heads, n_q, dim)
        return r_out.view(shape_r).to(rq.dtype), u_out.view(shape_u).to(uq.dtype)

    @staticmethod
    @first_order
    def backward(ctx, grad_r, grad_u):  # noqa: D102
        rq, uq, rk, uk, rv, uv, kbar, vbar, scale, stats, r_out, u_out, vc_out = ctx.saved_tensors
        batch, heads, n_q, n_k, dim, k, block_m, block_n, dtype, scale_dtype = ctx.meta
        sk = math.sqrt(k)
        grad_r = grad_r.reshape(batch * heads, n_q).float()
        grad_u = grad_u.reshape(batch * heads, n_q, dim).float()
        values = CentredValues(stats[6], vc_out, vbar.unsqueeze(1))
        g_t, g_e, _, g_v, row_dot = row_gradients(grad_r, grad_u, stats[:6], r_out / sk, u_out, values, k)
        g_t, g_e, g_v, row_dot = (t.contiguous() for t in (g_t, g_e, g_v, row_dot))
        g_aq, g_uq = torch.empty_like(rq), torch.empty_like(uq)
        g_scale_rows = torch.empty_like(rq)
        g_ak, g_uk, g_bv, g_uv = torch.empty_like(rk), torch.empty_like(uk), torch.empty_like(rv), torch.empty_like(uv)
        rows = (rq, uq, rk, uk, rv, uv, kbar)
        tail = (scale, stats, u_out, g_t, g_e, g_v, row_dot)
        sizes = dict(D=dim, D_PAD=padded_head_dim(dim))
        cfg_q, cfg_kv = launch_config("bwd_q", dim, block_m, block_n), launch_config("bwd_kv", dim, block_m, block_n)
        with _on_device(uq.device):
            KERNELS["bwd_q"][(batch * heads, triton.cdiv(n_q, cfg_q["BLOCK_M"]))](
                *rows, *tail, g_aq, g_uq, g_scale_rows, n_q, n_k, heads, sk, k, **sizes, **cfg_q
            )
            for part in kv_parts(dim):
                KERNELS["bwd_kv"][(batch * heads, triton.cdiv(n_k, cfg_kv["BLOCK_N"]))](
                    *rows, vbar, *tail, g_ak, g_uk, g_bv, g_uv, n_q, n_k, heads, sk, k, **sizes, **cfg_kv, PART=part
                )
        g_scale = g_scale_rows.view(batch, heads, n_q).sum(dim=(0, 2))

        def back(t, *shape):
            return t.view(batch, heads, *shape).to(dtype)

        return (
            back(g_aq, n_q),
            back(g_uq, n_q, dim),
            back(g_ak, n_k),
            back(g_uk, n_k, dim),
            back(g_bv, n_k),
            back(g_uv, n_k, dim),
            g_scale.to(scale_dtype),
            None,
            None,
            None,
        )


def _on_device(device: torch.device):
    """Launch on the tensors' GPU (not the current one): a device guard for CUDA, nothing otherwise."""
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def triton_polar_attention(
    rq: Tensor,
    uq: Tensor,
    rk: Tensor,
    uk: Tensor,
    rv: Tensor,
    uv: Tensor,
    scale: Tensor,
    k: float = 1.0,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused polar attention (float32 kernels); ``scale`` is an ``(H,)`` tensor."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("impl='triton' needs the triton package (pip install 'polar-vit-hf[triton]')")
    if not triton_usable(uq.device):
        raise RuntimeError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to run the kernels on the CPU)")
    return _TritonPolarAttention.apply(rq, uq, rk, uk, rv, uv, scale, float(k), block_m, block_n)


__all__ = ["TRITON_AVAILABLE", "triton_polar_attention", "triton_usable"]
