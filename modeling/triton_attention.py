"""Fused polar attention in Triton: the launch configurations and the registered operators around the kernels of
:mod:`triton_kernels` (their numerics are described there).

The forward and backward launches are a pair of ``torch.library.triton_op`` operators joined by
``register_autograd`` (the kernels called through ``wrap_triton``), with fake implementations that give the
outputs' shapes without a launch: ``torch.compile`` keeps them in its graph (no break), and CUDA graphs capture
them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .cpu_kernels import DOUBLE_BACKWARD_MESSAGE
from .fused_attention import CentredValues, row_gradients
from .operators import operator_namespace
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


def _flat(t: Tensor) -> Tensor:
    """``(B, H, ...)`` as contiguous float32 ``(B H, ...)``, the kernels' layout."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).contiguous().float()


def _blocks(block: int) -> int | None:
    """A user block size of the operators' schema (0: the default launch configuration)."""
    return block or None


@triton_op(f"{operator_namespace()}::triton_polar_attention", mutates_args=())
def _attention_forward(
    rq: Tensor,
    uq: Tensor,
    rk: Tensor,
    uk: Tensor,
    rv: Tensor,
    uv: Tensor,
    scale: Tensor,
    k: float,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: ``(r, u, centred values, row statistics, mean key and value directions)`` of the
    ``B H`` slices (float32; ``block_m``, ``block_n``: 0 for the default launch configuration)."""
    batch, heads, n_q, dim = uq.shape
    n_k = uk.shape[2]
    flat = [_flat(t) for t in (rq, uq, rk, uk, rv, uv)]
    kbar = flat[3].mean(dim=1).contiguous()
    vbar = flat[5].mean(dim=1).contiguous()
    r_out = torch.empty_like(flat[0])
    u_out = torch.empty_like(flat[1])
    vc_out = torch.empty_like(flat[1])
    stats = torch.empty(7, batch * heads, n_q, dtype=torch.float32, device=uq.device)
    cfg = launch_config("fwd", dim, _blocks(block_m), _blocks(block_n))
    with _on_device(uq.device):
        wrap_triton(KERNELS["fwd"])[(batch * heads, triton.cdiv(n_q, cfg["BLOCK_M"]))](
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
    return r_out, u_out, vc_out, stats, kbar, vbar


@_attention_forward.register_fake
def _attention_forward_fake(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale: Tensor, k: float, *blocks: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward's outputs' shapes, without a launch."""
    batch, heads, n_q, dim = uq.shape
    slices = batch * heads
    like = uq.new_empty((), dtype=torch.float32)
    rows, directions, means = (slices, n_q), (slices, n_q, dim), (slices, dim)
    r, u, centred, stats, kbar, vbar = (
        like.new_empty(size) for size in (rows, directions, directions, (7, *rows), means, means)
    )
    return r, u, centred, stats, kbar, vbar


@triton_op(f"{operator_namespace()}::triton_polar_attention_backward", mutates_args=())
def _attention_backward(
    rq: Tensor,
    uq: Tensor,
    rk: Tensor,
    uk: Tensor,
    rv: Tensor,
    uv: Tensor,
    scale: Tensor,
    saved: list[Tensor],
    grad_r: Tensor,
    grad_u: Tensor,
    k: float,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of the inputs (their shapes and dtypes) from the forward's ``saved`` outputs (the output, the
    centred values, the row statistics, the mean directions) and those of ``(r, u)`` (``B H`` slices): the row
    gradients (:func:`fused_attention.row_gradients`), then the query kernel and the key/value kernel."""
    batch, heads, n_q, dim = uq.shape
    n_k = uk.shape[2]
    r_out, u_out, vc_out, stats, kbar, vbar = saved
    sk = math.sqrt(k)
    values = CentredValues(stats[6], vc_out, vbar.unsqueeze(1))
    g_t, g_e, _, g_v, row_dot = row_gradients(grad_r.float(), grad_u.float(), stats[:6], r_out / sk, u_out, values, k)
    g_t, g_e, g_v, row_dot = (t.contiguous() for t in (g_t, g_e, g_v, row_dot))
    rows = (*(_flat(t) for t in (rq, uq, rk, uk, rv, uv)), kbar)
    g_aq, g_uq, g_scale_rows = torch.empty_like(rows[0]), torch.empty_like(rows[1]), torch.empty_like(rows[0])
    g_ak, g_uk, g_bv, g_uv = (torch.empty_like(t) for t in rows[2:6])
    tail = (scale.float().contiguous(), stats, u_out, g_t, g_e, g_v, row_dot)
    sizes = dict(D=dim, D_PAD=padded_head_dim(dim))
    blocks = _blocks(block_m), _blocks(block_n)
    cfg_q, cfg_kv = launch_config("bwd_q", dim, *blocks), launch_config("bwd_kv", dim, *blocks)
    with _on_device(uq.device):
        wrap_triton(KERNELS["bwd_q"])[(batch * heads, triton.cdiv(n_q, cfg_q["BLOCK_M"]))](
            *rows, *tail, g_aq, g_uq, g_scale_rows, n_q, n_k, heads, sk, k, **sizes, **cfg_q
        )
        for part in kv_parts(dim):
            wrap_triton(KERNELS["bwd_kv"])[(batch * heads, triton.cdiv(n_k, cfg_kv["BLOCK_N"]))](
                *rows, vbar, *tail, g_ak, g_uk, g_bv, g_uv, n_q, n_k, heads, sk, k, **sizes, **cfg_kv, PART=part
            )
    g_scale = g_scale_rows.view(batch, heads, n_q).sum(dim=(0, 2)).to(scale.dtype)
    g_rq, g_uq, g_rk, g_uk, g_rv, g_uv = (
        g.view(like.shape).to(like.dtype)
        for g, like in zip((g_aq, g_uq, g_ak, g_uk, g_bv, g_uv), (rq, uq, rk, uk, rv, uv))
    )
    return g_rq, g_uq, g_rk, g_uk, g_rv, g_uv, g_scale


@_attention_backward.register_fake
def _attention_backward_fake(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale: Tensor, *rest: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients' shapes and dtypes (the inputs'), without a launch."""
    return tuple(torch.empty_like(t) for t in (rq, uq, rk, uk, rv, uv, scale))  # type: ignore[return-value]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    """``register_autograd``'s context: the inputs, the forward's outputs and the constants."""
    *tensors, ctx.k, ctx.block_m, ctx.block_n = inputs
    ctx.save_for_backward(*tensors, *output)


def _attention_gradients(ctx: Any, grad_r: Tensor | None, grad_u: Tensor | None, *_: Tensor | None) -> tuple:
    """``register_autograd``'s backward: the backward operator (the forward's other outputs take no gradient)."""
    *tensors, r_out, u_out, vc_out, stats, kbar, vbar = ctx.saved_tensors
    grad_r = torch.zeros_like(r_out) if grad_r is None else grad_r
    grad_u = torch.zeros_like(u_out) if grad_u is None else grad_u
    saved = [r_out, u_out, vc_out, stats, kbar, vbar]
    grads = _attention_backward(*tensors, saved, grad_r, grad_u, ctx.k, ctx.block_m, ctx.block_n)
    return (*grads, None, None, None)


_attention_forward.register_autograd(_attention_gradients, setup_context=_setup_context)


def _refuse_second_order(ctx: Any, *grads: Tensor | None) -> tuple:
    """The backward operator's own backward: a differentiated gradient is refused with
    :data:`cpu_kernels.DOUBLE_BACKWARD_MESSAGE` (the kernels' backward is hand-derived, first order only)."""
    raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)


_attention_backward.register_autograd(_refuse_second_order, setup_context=lambda ctx, inputs, output: None)


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
    launch_config("fwd", uq.shape[-1], block_m, block_n)  # (checks the block sizes)
    r, u = _attention_forward(rq, uq, rk, uk, rv, uv, scale, float(k), block_m or 0, block_n or 0)[:2]
    return r.view(rq.shape).to(rq.dtype), u.view(uq.shape).to(uq.dtype)


__all__ = ["TRITON_AVAILABLE", "triton_polar_attention", "triton_usable"]
