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

__all__ = [
    "DOUBLE_BACKWARD_MESSAGE",
    "RecomputedFunction",
    "bound",
    "clear_compiled",
    "compiled_functions",
    "cpu_kernels_enabled",
    "first_order",
    "kernel",
    "rebuild_record",
    "recomputed",
    "record_layout",
    "record_leaves",
    "recompute_vjp",
    "run_maybe_compiled",
    "saved_tensor_hooks_active",
    "set_cpu_kernels",
    "training",
    "transforms_active",
    "use_kernels",
]

DOUBLE_BACKWARD_MESSAGE = (
    "double backward (create_graph=True, then a backward through the gradient) is not supported by the fused "
    "layers, whose backward passes are hand-derived; build the model with fused_ops=False (the reference layers, "
    "differentiated by autograd to any order)"
)

_COMPILED: dict[Callable, Callable] = {}  # function -> its compiled kernel (or itself after a compiler failure)


def set_cpu_kernels(enabled: bool) -> None:
    """Turn the compiled CPU kernels on or off for this context (``set_runtime_options(cpu_kernels=...)``)."""
    set_runtime_options(cpu_kernels=bool(enabled))


def cpu_kernels_enabled() -> bool:
    """Whether the fused layers may use their compiled CPU kernels in this context."""
    return runtime_options().cpu_kernels


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...) is running this call."""
    return bool(torch._C._are_functorch_transforms_active())


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``) are in force."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def first_order(backward: Callable) -> Callable:
    """Decorator for a hand-derived ``backward``: it runs without recording a graph, and where autograd asked for
    one (``create_graph=True``) its gradients carry a node that raises :data:`DOUBLE_BACKWARD_MESSAGE` if they are
    differentiated again (``torch.autograd.function.once_differentiable`` with this project's message, also where
    only the saved tensors require grad)."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Tensor) -> Any:
        with torch.no_grad():
            gradients = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return gradients
        values = gradients if isinstance(gradients, tuple) else (gradients,)
        refuse = torch._C._functions.DelayedError(DOUBLE_BACKWARD_MESSAGE.encode(), len(values))
        flagged = refuse(*[v.detach().requires_grad_() if isinstance(v, Tensor) else v for v in values])
        flagged = flagged if isinstance(flagged, tuple) else (flagged,)
        return flagged if isinstance(gradients, tuple) else flagged[0]

    return wrapper


def use_kernels(like: Tensor, training: bool, elements: int | None = None) -> bool:
    """Compiled kernels for a call: training (backward will run), float32 on the CPU, at least
    ``kernel_min_elements`` elements in the call's largest tensors (``like``, or ``elements`` where those are
    temporaries, as the attention's pairs), not inside ``torch.compile``, and no saved-tensor hooks in force
    (their packing runs in Python, between eager operations)."""
    options = runtime_options()
    size = like.numel() if elements is None else elements
    return (
        options.cpu_kernels
        and training
        and like.device.type == "cpu"
        and like.dtype == torch.float32
        and size >= options.kernel_min_elements
        and not torch.compiler.is_compiling()
        and not saved_tensor_hooks_active()
    )


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
                warnings.warn(
                    f"polar_vit_hf: compiled CPU kernels unavailable ({type(error).__name__}: "
                    f"{str(error)[:200]}); running eager",
                    stacklevel=2,
                )
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


def recompute_vjp(fn: Callable, primals: tuple[Tensor, ...], cotangents: Any) -> tuple[Any, tuple]:
    """``(fn(*primals), the vector-Jacobian product of fn at primals with cotangents)``: a recomputation and its
    gradients for a backward pass.

    By ``torch.func.vjp`` (a pure function, which the compiled kernels trace), or, under saved-tensor hooks (which
    ``torch.func`` refuses), by autograd on the same recomputation, whose saved tensors then go through the hooks.
    """
    if torch.compiler.is_compiling() or not saved_tensor_hooks_active():  # (the hooks query does not trace)
        outputs, pullback = torch.func.vjp(fn, *primals)[:2]
        return outputs, pullback(cotangents)
    with torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_() for t in primals)
        outputs = fn(*leaves)
        flat_outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        flat_cotangents = cotangents if isinstance(cotangents, tuple) else (cotangents,)
        gradients = torch.autograd.grad(
            flat_outputs, leaves, flat_cotangents, allow_unused=True, materialize_grads=True
        )
    detached = tuple(t.detach() for t in flat_outputs)
    return (detached if isinstance(outputs, tuple) else detached[0]), gradients


class RecomputedFunction(torch.autograd.Function):
    """``fn(*tensors, *constants)``, a pure function of its tensors with one output, saving only its inputs:
    forward runs it, backward recomputes it and differentiates it (:func:`recompute_vjp`); each a compiled kernel
    when training in float32 on the CPU (:func:`use_kernels`), so neither keeps an autograd graph of its
    intermediates."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, constants: tuple, is_training: bool, *tensors: Tensor) -> Tensor:  # noqa: D102
        ctx.fn, ctx.constants = fn, constants
        ctx.save_for_backward(*tensors)
        return run_maybe_compiled(bound(fn, constants), is_training, tensors[0], *tensors)

    @staticmethod
    @first_order
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
    """``(grad, *tensors) -> gradients of fn(*tensors, *constants)`` by :func:`recompute_vjp` (one function object
    per pair: one compiled kernel)."""
    return lambda grad, *tensors: recompute_vjp(bound(fn, constants), tensors, grad)[1]


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
