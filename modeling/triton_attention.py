"""Fused polar attention in Triton: the launch configurations and the registered operators around the kernels of
:mod:`triton_kernels` (their numerics are described there).

The forward and backward launches are a pair of ``torch.library.triton_op`` operators joined by
``register_autograd`` (the kernels called through ``wrap_triton``), with fake implementations that give the
outputs' shapes without a launch: ``torch.compile`` keeps them in its graph (no break), and CUDA graphs capture
them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .cpu_kernels import DOUBLE_BACKWARD_MESSAGE
from .fused_attention import CentredValues, row_gradients
from .operators import operator_namespace
from .triton_kernels import KERNELS, TRITON_AVAILABLE, triton, triton_usable

Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

# Launch configurations per chord design, kernel and padded head width (the next power of two >= D, at least 16):
# of blocks 16-64 with 8 warps, 1 or 2 stages, and 16 x 16 with 4 warps, those that compile for sm_90 without
# spilling and within the shared memory of a block (A100: 163 KiB for the Gram design; 99 KiB for the difference
# design's GPUs, sm_86 / sm_89 / sm_120), fewest float32 instructions per pair first (``python
# benchmarks/attention_tune.py --ptxas-only``; ``benchmarks/attention_kernel.py`` counts the instructions).  A
# CUDA launch without user blocks autotunes over all of them; the interpreter and user blocks take the first.
# From ``SPLIT_KV_FROM`` on, the key and the value gradients are two launches of the dk/dv kernel (``PART`` 1, 2).
LAUNCH_CONFIGS: dict[str, dict[str, dict[int, list[Config]]]] = {
    "gram": {
        "fwd": {
            16: [(64, 32, 8, 2), (64, 16, 8, 2), (16, 64, 8, 2)],
            32: [(64, 16, 8, 2), (16, 64, 8, 2), (16, 32, 8, 2)],
            64: [(16, 64, 8, 2), (16, 32, 8, 2)],
            128: [(16, 64, 8, 2), (16, 32, 8, 2)],
        },
        "bwd_dq": {
            16: [(64, 16, 8, 2), (16, 16, 4, 2)],
            32: [(64, 16, 8, 2), (16, 64, 8, 2), (16, 64, 8, 1)],
            64: [(16, 64, 8, 1), (16, 32, 8, 1)],
            128: [(16, 32, 8, 2)],  # no candidate without spills: the fewest (108 bytes)
        },
        "bwd_dkdv": {
            16: [(16, 64, 8, 2), (16, 64, 8, 1), (16, 16, 4, 2)],
            32: [(16, 64, 8, 2), (16, 64, 8, 1), (16, 16, 4, 2)],
            64: [(16, 32, 8, 2), (16, 32, 8, 1)],
            128: [(16, 32, 8, 2)],  # no candidate without spills: the fewest (36 bytes)
        },
    },
    "difference": {
        "fwd": {
            16: [(32, 32, 8, 2), (32, 16, 8, 2), (16, 16, 4, 2)],
            32: [(16, 16, 4, 2), (16, 64, 8, 2), (16, 32, 8, 2)],
            64: [(16, 64, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2)],
            128: [(16, 32, 8, 2), (16, 16, 4, 2)],
        },
        "bwd_dq": {
            16: [(32, 16, 8, 2), (16, 16, 4, 2)],
            32: [(16, 64, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2)],
            64: [(16, 64, 8, 2), (16, 32, 8, 2), (32, 16, 8, 2)],
            128: [(32, 16, 8, 2), (16, 16, 4, 2)],
        },
        "bwd_dkdv": {
            16: [(16, 64, 8, 2), (16, 16, 4, 2), (32, 16, 8, 2)],
            32: [(16, 64, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2)],
            64: [(16, 64, 8, 2), (16, 32, 8, 2), (32, 16, 8, 2)],
            128: [(16, 64, 8, 2), (16, 32, 8, 2), (32, 16, 8, 2)],
        },
    },
}
SPLIT_KV_FROM = 128
CHORD_DESIGNS = ("gram", "difference")
# compute capabilities with FP64 tensor cores at a fraction of the FP32 rate that makes the float64 Gram
# product the faster exact chord: A100/A30 (8.0), H100/H200 (9.0), B200 (10.0)
FAST_FP64_CAPABILITIES = ((8, 0), (9, 0), (10, 0))


def padded_head_dim(head_dim: int) -> int:
    """The register width of a head: the next power of two, at least 16 (``tl.dot`` needs K >= 16)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def kv_parts(head_dim: int) -> tuple[int, ...]:
    """``PART`` values of the dk/dv launches: ``(0,)`` (one launch), or ``(1, 2)`` for wide heads."""
    return (1, 2) if padded_head_dim(head_dim) >= SPLIT_KV_FROM else (0,)


def configurations(kernel: str, head_dim: int, chords: str = "gram") -> list[Config]:
    """The tabulated launch configurations of ``kernel`` (``fwd``, ``bwd_dq``, ``bwd_dkdv``) for ``chords`` at
    ``head_dim`` (those of the widest tabulated width for wider heads), the default first."""
    table = LAUNCH_CONFIGS[chords][kernel]
    return table.get(padded_head_dim(head_dim), table[max(table)])


def launch_config(
    kernel: str, head_dim: int, block_m: int | None = None, block_n: int | None = None, chords: str = "gram"
) -> dict[str, int]:
    """``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages`` of ``kernel`` (``fwd``, ``bwd_dq``, ``bwd_dkdv``).

    Defaults from :data:`LAUNCH_CONFIGS`; user block sizes must be powers of two >= 16 (``tl.dot`` needs 16 on
    every Triton this package supports).
    """
    bm, bn, warps, stages = configurations(kernel, head_dim, chords)[0]
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name}={value}: Triton blocks must be powers of two >= 16")
    return dict(BLOCK_M=block_m or bm, BLOCK_N=block_n or bn, num_warps=warps, num_stages=stages)


def default_chords(device: torch.device) -> str:
    """The chord design for ``device``: ``gram`` (float64 Gram product) on GPUs with fast FP64 tensor cores
    (:data:`FAST_FP64_CAPABILITIES`) and in the interpreter, ``difference`` (coordinate differences) elsewhere."""
    if device.type != "cuda":
        return "gram"
    return "gram" if torch.cuda.get_device_capability(device) in FAST_FP64_CAPABILITIES else "difference"


class DotPrecisions(NamedTuple):
    """``tl.dot``'s input precisions for the float32 products: ``values`` for those of the values and of ``dL/dP``
    (``P V'``, ``g_V . v``, the value directions' gradient), which ``sinh b`` and ``cosh b`` multiply; ``chords`` for
    the chord gradients' products with the centred keys and queries (``dS K``, ``dS^T Q``)."""

    values: str
    chords: str


def dot_precisions(device: torch.device) -> DotPrecisions:
    """From sm_80 on, ``bf16x6`` for the values (each operand split into three bfloat16 parts, the six larger
    partial products on the tensor cores: the parts left out are below 2^-24 of each product) and ``tf32x3`` for
    the chord gradients (three TF32 products, 2^-22: their operands are centred differences, and two parts instead
    of three keep the query kernel's registers from spilling); ``ieee`` (FMA units) before, and in the interpreter,
    which multiplies in float32 whatever is asked."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return DotPrecisions("bf16x6", "tf32x3")
    return DotPrecisions("ieee", "ieee")


def kernel_constants(head_dim: int, chords: str, dots: DotPrecisions, kernel: str = "fwd") -> dict[str, Any]:
    """The compile-time constants ``kernel`` takes besides its blocks."""
    if chords not in CHORD_DESIGNS:
        raise ValueError(f"chords={chords!r}: choose one of {CHORD_DESIGNS}")
    constants = dict(D=head_dim, D_PAD=padded_head_dim(head_dim), GRAM=chords == "gram", DOT=dots.values)
    return constants if kernel == "fwd" else {**constants, "CHORD_DOT": dots.chords}


AUTOTUNE = True  # CUDA launches without user blocks autotune (off: the first configuration, as attention_tune sets)
_AUTOTUNED: dict[tuple[str, str, int], Any] = {}


def _autotuned(kernel: str, chords: str, head_dim: int) -> Any:
    """``kernel`` wrapped by ``triton.autotune`` over its :func:`configurations` (keyed by the sequence lengths and
    the compile-time constants), built once per design and head width."""
    key = (kernel, chords, padded_head_dim(head_dim))
    if key not in _AUTOTUNED:
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
            for bm, bn, warps, stages in configurations(kernel, head_dim, chords)
        ]
        keys = (
            ["n_q", "n_k", "D", "DOT"]
            + ([] if kernel == "fwd" else ["CHORD_DOT"])
            + (["PART"] if kernel == "bwd_dkdv" else [])
        )
        # bwd_dq writes the corrected row constant over the analytic one it reads: each timed launch restores it
        restore = ["ROWDOT"] if kernel == "bwd_dq" else None
        _AUTOTUNED[key] = triton.autotune(configs=configs, key=keys, restore_value=restore)(KERNELS[kernel])
    return _AUTOTUNED[key]


def _launcher(kernel: str, device: torch.device, head_dim: int, blocks: tuple[int | None, int | None], chords: str):
    """``(kernel, grid block, launch options)``: the autotuned kernel on CUDA without user blocks (its block along
    the grid chosen at launch), else the plain kernel with :func:`launch_config`."""
    if AUTOTUNE and device.type == "cuda" and blocks == (None, None):
        return _autotuned(kernel, chords, head_dim), None, {}
    config = launch_config(kernel, head_dim, *blocks, chords=chords)
    return KERNELS[kernel], config, config


def _flat(t: Tensor) -> Tensor:
    """``(B, H, ...)`` as contiguous float32 ``(B H, ...)``, the kernels' layout."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).contiguous().float()


def _half_sq_norms(u: Tensor) -> Tensor:
    """``1/2 |u|^2`` of float32 rows in float64 (exact products): the Gram chords' diagonal."""
    u64 = u.double()
    return 0.5 * (u64 * u64).sum(-1)


def radius_table(r: Tensor, k: float) -> Tensor:
    """The kernels' per-token radius terms, ``(6, B H, N)`` float32 planes ``a, e^{a/2}, e^{-a/2}, sinh a, cosh a,
    e^{-a}`` of ``a = r / sqrt k``: computed once per token here (each to an ulp), read by every pair."""
    a = _flat(r) / math.sqrt(k)
    return torch.stack([a, torch.exp(0.5 * a), torch.exp(-0.5 * a), torch.sinh(a), torch.cosh(a), torch.exp(-a)])


def _operands(rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, k: float) -> list[Tensor]:
    """The kernels' first nine arguments: radius table, flat float32 directions and their float64 half squared
    norms, of the queries, keys and values."""
    flat = []
    for r, u in ((rq, uq), (rk, uk), (rv, uv)):
        u_flat = _flat(u)
        flat += [radius_table(r, k), u_flat, _half_sq_norms(u_flat)]
    return flat


def _blocks(block: int) -> int | None:
    """A user block size of the operators' schema (0: the default launch configuration)."""
    return block or None


def _grid(slices: int, length: int, block: str, config: dict[str, int] | None):
    """The launch grid: ``(slices, blocks of length)``, from the autotuner's chosen block when ``config`` is None."""
    if config is None:
        return lambda meta: (slices, triton.cdiv(length, meta[block]))
    return (slices, triton.cdiv(length, config[block]))


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
    chords: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel: ``(r, u, centred values, row statistics, mean key and value directions)`` of the
    ``B H`` slices (float32; ``block_m``, ``block_n``: 0 for the default launch configuration)."""
    batch, heads, n_q, dim = uq.shape
    n_k = uk.shape[2]
    flat = _operands(rq, uq, rk, uk, rv, uv, k)
    kbar = flat[4].mean(dim=1).contiguous()
    vbar = flat[7].mean(dim=1).contiguous()
    r_out = torch.empty_like(flat[0][0])
    u_out = torch.empty_like(flat[1])
    vc_out = torch.empty_like(flat[1])
    stats = torch.empty(7, batch * heads, n_q, dtype=torch.float32, device=uq.device)
    kernel, config, options = _launcher("fwd", uq.device, dim, (_blocks(block_m), _blocks(block_n)), chords)
    with _on_device(uq.device):
        wrap_triton(kernel)[_grid(batch * heads, n_q, "BLOCK_M", config)](
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
            **kernel_constants(dim, chords, dot_precisions(uq.device)),
            **options,
        )
    return r_out, u_out, vc_out, stats, kbar, vbar


@_attention_forward.register_fake
def _attention_forward_fake(
    rq: Tensor, uq: Tensor, rk: Tensor, uk: Tensor, rv: Tensor, uv: Tensor, scale: Tensor, k: float, *rest: Any
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
    chords: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of the inputs (their shapes and dtypes) from the forward's ``saved`` outputs (the output, the
    centred values, the row statistics, the mean directions) and those of ``(r, u)`` (``B H`` slices): the row
    gradients (:func:`fused_attention.row_gradients`, the softmax row constant among them), then the query kernel
    and the key/value kernel, each recomputing the scores once."""
    batch, heads, n_q, dim = uq.shape
    n_k = uk.shape[2]
    r_out, u_out, vc_out, stats, kbar, vbar = saved
    sk = math.sqrt(k)
    values = CentredValues(stats[6], vc_out, vbar.unsqueeze(1))
    g_t, g_e, _, g_v, row_dot = row_gradients(grad_r.float(), grad_u.float(), stats[:6], r_out / sk, u_out, values, k)
    g_t, g_e, g_v, row_dot = (t.contiguous() for t in (g_t, g_e, g_v, row_dot))
    flat = _operands(rq, uq, rk, uk, rv, uv, k)
    g_aq, g_uq, g_scale_rows = torch.empty_like(flat[0][0]), torch.empty_like(flat[1]), torch.empty_like(flat[0][0])
    g_ak, g_uk, g_bv, g_uv = (torch.empty_like(t) for t in (flat[3][0], flat[4], flat[6][0], flat[7]))
    tail = (scale.float().contiguous(), stats, u_out, _half_sq_norms(u_out), g_t, g_e, g_v, row_dot)
    constants = kernel_constants(dim, chords, dot_precisions(uq.device), "bwd_dq")
    blocks = _blocks(block_m), _blocks(block_n)
    slices = batch * heads
    with _on_device(uq.device):
        kernel, config, options = _launcher("bwd_dq", uq.device, dim, blocks, chords)
        wrap_triton(kernel)[_grid(slices, n_q, "BLOCK_M", config)](
            *flat, kbar, *tail, g_aq, g_uq, g_scale_rows, n_q, n_k, heads, sk, k, **constants, **options
        )
        kernel, config, options = _launcher("bwd_dkdv", uq.device, dim, blocks, chords)
        for part in kv_parts(dim):  # (after bwd_dq, which corrects the row constant)
            wrap_triton(kernel)[_grid(slices, n_k, "BLOCK_N", config)](
                *flat,
                kbar,
                vbar,
                *tail,
                g_ak,
                g_uk,
                g_bv,
                g_uv,
                n_q,
                n_k,
                heads,
                sk,
                k,
                **constants,
                **options,
                PART=part,
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
    *tensors, ctx.k, ctx.block_m, ctx.block_n, ctx.chords = inputs
    ctx.save_for_backward(*tensors, *output)


def _attention_gradients(ctx: Any, grad_r: Tensor | None, grad_u: Tensor | None, *_: Tensor | None) -> tuple:
    """``register_autograd``'s backward: the backward operator (the forward's other outputs take no gradient)."""
    *tensors, r_out, u_out, vc_out, stats, kbar, vbar = ctx.saved_tensors
    grad_r = torch.zeros_like(r_out) if grad_r is None else grad_r
    grad_u = torch.zeros_like(u_out) if grad_u is None else grad_u
    saved = [r_out, u_out, vc_out, stats, kbar, vbar]
    grads = _attention_backward(*tensors, saved, grad_r, grad_u, ctx.k, ctx.block_m, ctx.block_n, ctx.chords)
    return (*grads, None, None, None, None)


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
    chords: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused polar attention (float32 math; float32, bfloat16 or float16 inputs, outputs in the input dtype);
    ``scale`` is an ``(H,)`` tensor; ``chords``: ``gram`` or ``difference`` (default: :func:`default_chords`)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("impl='triton' needs the triton package (pip install 'polar-vit-hf[triton]')")
    if not triton_usable(uq.device):
        raise RuntimeError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to run the kernels on the CPU)")
    launch_config("fwd", uq.shape[-1], block_m, block_n)  # (checks the block sizes)
    chords = chords or default_chords(uq.device)
    kernel_constants(uq.shape[-1], chords, DotPrecisions("ieee", "ieee"))  # (checks the chord design)
    r, u = _attention_forward(rq, uq, rk, uk, rv, uv, scale, float(k), block_m or 0, block_n or 0, chords)[:2]
    return r.view(rq.shape).to(rq.dtype), u.view(uq.shape).to(uq.dtype)


__all__ = ["TRITON_AVAILABLE", "triton_polar_attention", "triton_usable"]
