"""Compiled CPU kernels for the fused layers, the recomputed function, and saving typed records for backward.

When training in float32 on the CPU, a fused layer can run its pure-tensor core (a function of tensors that
returns tensors) through :func:`kernel`: ``torch.compile(dynamic=True, fullgraph=True)`` turns its chain of
elementwise passes into a few fused C++ loops.  :func:`use_kernels` decides per call from the
:class:`runtime.RuntimeOptions` (the ``cpu_kernels`` switch and the ``kernel_min_elements`` size) and the
tensors; inference, float64, GPUs, small tensors and code already inside ``torch.compile`` run the same
function eagerly.  A compiler failure (no C++ compiler) warns once and runs eager for the rest of the process.

:class:`RecomputedFunction` (:func:`recomputed`) runs any pure tensor function without keeping its autograd
graph: backward recomputes it and differentiates it with ``torch.func.vjp``.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and :mod:`runtime`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .runtime import runtime_options, set_runtime_options

__all__ = ["RecomputedFunction", "bound", "clear_compiled", "compiled_functions", "cpu_kernels_enabled", "kernel",
           "rebuild_record", "recomputed", "record_layout", "record_leaves", "run_maybe_compiled", "set_cpu_kernels",
           "training", "use_kernels"]

_COMPILED: dict[Callable, Callable] = {}  # function -> its compiled kernel (or itself after a compiler failure)


def set_cpu_kernels(enabled: bool) -> None:
    """Turn the compiled CPU kernels on or off for this context (``set_runtime_options(cpu_kernels=...)``)."""
    set_runtime_options(cpu_kernels=bool(enabled))


def cpu_kernels_enabled() -> bool:
    """Whether the fused layers may use their compiled CPU kernels in this context."""
    return runtime_options().cpu_kernels


def use_kernels(like: Tensor, training: bool, elements: int | None = None) -> bool:
    """Compiled kernels for a call: training (backward will run), float32 on the CPU, at least
    ``kernel_min_elements`` elements in the call's largest tensors (``like``, or ``elements`` where those are
    temporaries, as the attention's pairs), not inside ``torch.compile``."""
    options = runtime_options()
    size = like.numel() if elements is None else elements
    return (options.cpu_kernels and training and like.device.type == "cpu" and like.dtype == torch.float32
            and size >= options.kernel_min_elements and not torch.compiler.is_compiling())


def kernel(fn: Callable) -> Callable:
    """``fn`` compiled by inductor with dynamic shapes (one compile per process and argument kind, reused from
    inductor's on-disk cache), or ``fn`` itself if compiling fails: a warning, then eager."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)

    def run(*args: Any) -> Any:
        if _COMPILED[fn] is not fn:
            try:
                return _COMPILED[fn](*args)
            except Exception as error:  # noqa: BLE001 - a compiler failure falls back to the same formulas
                warnings.warn(f"polar_vit_hf: compiled CPU kernels unavailable ({type(error).__name__}: "
                              f"{str(error)[:200]}); running eager", stacklevel=2)
                _COMPILED[fn] = fn
        return fn(*args)

    return run


def compiled_functions() -> dict[Callable, Callable]:
    """``{function: its compiled kernel}`` so far in this process (the function itself after a compiler failure)."""
    return dict(_COMPILED)


def clear_compiled() -> None:
    """Forget the compiled kernels (the next training call compiles again, from inductor's cache)."""
    _COMPILED.clear()


def training(*inputs: Tensor | None) -> bool:
    """Whether autograd records a call on ``inputs`` (backward may follow), decided outside the Function."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def run_maybe_compiled(fn: Callable, is_training: bool, like: Tensor, *args: Any, elements: int | None = None) -> Any:
    """``fn(*args)``, through :func:`kernel` where :func:`use_kernels` says so."""
    return kernel(fn)(*args) if use_kernels(like, is_training, elements) else fn(*args)


class RecomputedFunction(torch.autograd.Function):
    """``fn(*tensors, *constants)``, a pure function of its tensors with one output, saving only its inputs:
    forward runs it, backward recomputes it and differentiates it with ``torch.func.vjp``; each a compiled kernel
    when training in float32 on the CPU (:func:`use_kernels`), so neither keeps an autograd graph of its
    intermediates."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, constants: tuple, is_training: bool, *tensors: Tensor) -> Tensor:  # noqa: D102
        ctx.fn, ctx.constants = fn, constants
        ctx.save_for_backward(*tensors)
        return run_maybe_compiled(bound(fn, constants), is_training, tensors[0], *tensors)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        tensors = ctx.saved_tensors
        gradients = run_maybe_compiled(_vjp(ctx.fn, ctx.constants), True, tensors[0], grad.contiguous(), *tensors)
        return (None, None, None, *gradients)


@functools.cache
def bound(fn: Callable, constants: tuple) -> Callable:
    """``fn`` with its trailing ``constants`` bound (one function object per pair: one compiled kernel, the
    constants compiled in)."""
    return lambda *tensors: fn(*tensors, *constants)


@functools.cache
def _vjp(fn: Callable, constants: tuple) -> Callable:
    """``(grad, *tensors) -> gradients of fn(*tensors, *constants)`` by ``torch.func.vjp`` (one function object per
    pair: one compiled kernel)."""
    return lambda grad, *tensors: torch.func.vjp(lambda *args: fn(*args, *constants), *tensors)[1](grad)


def record_leaves(record: Any) -> list[Tensor | None]:
    """The tensors of a (nested) ``NamedTuple`` record in field order, ``None`` for absent ones: what an
    autograd Function passes to ``ctx.save_for_backward`` (so saved-tensor hooks see every one)."""
    if isinstance(record, tuple) and hasattr(record, "_fields"):
        return [leaf for item in record for leaf in record_leaves(item)]
    return [record]


def record_layout(record: Any) -> Any:
    """The structure of a (nested) ``NamedTuple`` record without its tensors (kept on ``ctx``)."""
    if isinstance(record, tuple) and hasattr(record, "_fields"):
        return type(record)(*(record_layout(item) for item in record))
    return None


def rebuild_record(layout: Any, leaves: Any) -> Any:
    """The record of ``layout`` filled from the iterator ``leaves`` (:func:`record_leaves` order)."""
    if isinstance(layout, tuple) and hasattr(layout, "_fields"):
        return type(layout)(*(rebuild_record(item, leaves) for item in layout))
    return next(leaves)


def recomputed(fn: Callable, *tensors: Tensor, constants: tuple = ()) -> Tensor:
    """``fn(*tensors, *constants)`` through :class:`RecomputedFunction`."""
    return RecomputedFunction.apply(fn, tuple(constants), training(*tensors), *tensors)
