"""The fused layers as registered operators: inside ``torch.compile``'s graph, with their compiled CPU kernels.

A fused layer is an autograd Function with a hand-derived backward whose passes run as compiled kernels on the
CPU (:mod:`cpu_kernels`).  Eagerly, :func:`fused_apply` calls the Function itself.  Inside ``torch.compile`` on
float32 CPU tensors with the kernels on, it calls the Function's pair of operators instead, made once per
Function by :func:`registered_operators` with ``torch.library.custom_op``:

* ``<namespace>::<Function>`` runs ``forward`` and returns its outputs and the tensors it saved for backward
  (those that are not its inputs);
* ``<namespace>::<Function>_backward`` runs ``backward`` on them;

joined by ``register_autograd``.  Their fake (meta) implementation is the Function's own eager code on fake
tensors, so the shapes never need a second source.  The compiler traces around them (no graph break) and compiles
the code between the layers (the products, the model's glue); the layers' own passes run as the Function runs
them eagerly, through the compiled CPU kernels.  Under ``torch.export``, in float64, on CUDA and where the kernels
are off, the Function is traced as any code (one graph of its formulas).

The Function's other arguments (floats, dtypes, functions: the layer's constants) are interned once per kind of
call, and what ``forward`` leaves on its context (``ctx.k``, a record's layout) is kept per kind of call: a
Function's context attributes may depend on its constants only, never on its tensors' shapes or values.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and :mod:`runtime`.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .runtime import runtime_options

__all__ = [
    "FusedOperators",
    "fused_apply",
    "operator_namespace",
    "registered_operators",
    "runs_as_operator",
    "stable_description",
]


def operator_namespace() -> str:
    """The ``torch.library`` namespace of this copy of the package's operators: ``polar_vit`` and the package's
    import name (an installed package and a checkpoint's remote code are separate copies, each with its own)."""
    return "polar_vit_" + re.sub(r"\W", "_", __name__.rpartition(".")[0])


TENSOR = ...  # where a tensor stands among a Function's arguments (the tensors travel apart)


def stable_description(value: Any) -> str | None:
    """A text naming ``value`` (a function with its closure, a constant, a tuple of these) that is the same in every
    process, or ``None`` where there is none."""
    if value is None or value is ... or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    if isinstance(value, tuple):
        parts = [stable_description(item) for item in value]
        return None if None in parts else "(" + ",".join(parts) + ")"  # type: ignore[arg-type]
    if callable(value) and hasattr(value, "__qualname__") and hasattr(value, "__module__"):
        cells = [stable_description(cell.cell_contents) for cell in getattr(value, "__closure__", None) or ()]
        if None in cells:
            return None
        return f"{value.__module__}.{value.__qualname__}[" + ",".join(cells) + "]"  # type: ignore[arg-type]
    return None


@dataclass(frozen=True)
class _Saved:
    """What ``forward`` left for ``backward``, per kind of call: each saved slot (``("input", i)``, ``("output",
    i)``, ``("extra", j)`` or ``None``) and the context's attributes."""

    slots: tuple[tuple[str, int] | None, ...]
    attributes: tuple[tuple[str, Any], ...]

    def kept(self, kind: str) -> list[int]:
        """The inputs (``"input"``) or outputs (``"output"``) that ``forward`` saved, by position."""
        return sorted({slot[1] for slot in self.slots if slot is not None and slot[0] == kind})


class _Context:
    """The context a Function's ``forward`` and ``backward`` see when they run as operators."""

    def __init__(self, needs_input_grad: tuple[bool, ...], saved: tuple[Tensor | None, ...] = ()) -> None:
        self.needs_input_grad = needs_input_grad
        self.to_save = saved

    def save_for_backward(self, *tensors: Tensor | None) -> None:  # noqa: D102
        self.to_save = tensors

    @property
    def saved_tensors(self) -> tuple[Tensor | None, ...]:  # noqa: D102
        return self.to_save

    def attributes(self) -> tuple[tuple[str, Any], ...]:
        """What ``forward`` set on the context besides its saved tensors."""
        return tuple(
            (name, value) for name, value in vars(self).items() if name not in ("needs_input_grad", "to_save")
        )


def _unaliased(tensors: Sequence[Tensor], inputs: Sequence[Tensor]) -> list[Tensor]:
    """``tensors`` with a copy of each that shares memory with ``inputs`` or an earlier one (an operator's outputs
    alias nothing)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    out = []
    for t in tensors:
        pointer = t.untyped_storage().data_ptr()
        out.append(t.clone() if pointer in seen else t)
        seen.add(pointer)
    return out


class FusedOperators:
    """The forward and backward operators of one fused autograd Function (see the module docstring)."""

    def __init__(self, function: type[torch.autograd.Function], outputs: int) -> None:
        self.function, self.outputs = function, outputs
        self.specs: dict[int, tuple] = {}  # per key: the Function's arguments, TENSOR where a tensor stands
        self.keys: dict[tuple, int] = {}
        self.saved: dict[int, _Saved] = {}  # per key, once its forward ran
        qualname = f"{operator_namespace()}::{function.__name__}"
        self.forward_op = torch.library.custom_op(
            qualname,
            lambda key, tensors: _unaliased(self._forward(key, tensors), tensors),
            mutates_args=(),
            schema="(int key, Tensor[] tensors) -> Tensor[]",
        )
        self.forward_op.register_fake(lambda key, tensors: [t.clone() for t in self._forward(key, tensors)])
        self.backward_op = torch.library.custom_op(
            qualname + "_backward",
            self._backward,
            mutates_args=(),
            schema="(int key, bool[] needs, Tensor[] like, Tensor[] saved, Tensor[] grads) -> Tensor[]",
        )
        self.backward_op.register_fake(lambda key, needs, like, saved, grads: [t.new_empty(t.shape) for t in like])
        self.forward_op.register_autograd(self._autograd_backward, setup_context=self._setup_context)

    def intern(self, spec: tuple) -> int:
        """The key of a kind of call (its arguments but the tensors): a constant of the traced graph."""
        return _intern(self, spec)

    def __call__(self, *args: Any) -> Any:
        """``Function.apply(*args)`` through the operators."""
        spec = tuple(TENSOR if isinstance(a, Tensor) else a for a in args)
        tensors = [a for a in args if isinstance(a, Tensor)]
        key = self.intern(spec)
        results = self.forward_op(key, tensors)
        return results[0] if self.outputs == 1 else tuple(results[: self.outputs])

    def _arguments(self, key: int, tensors: Sequence[Tensor]) -> list[Any]:
        """The Function's arguments of a call of kind ``key`` on ``tensors``."""
        given = iter(tensors)
        return [next(given) if a is TENSOR else a for a in self.specs[key]]

    def _forward(self, key: int, tensors: list[Tensor]) -> list[Tensor]:
        """The Function's ``forward``: its outputs, then the tensors it saved that are neither its inputs nor its
        outputs, each contiguous (on fake tensors, the shapes of both)."""
        arguments = self._arguments(key, tensors)
        ctx = _Context(tuple(isinstance(a, Tensor) for a in arguments))
        with torch.no_grad():
            result = self.function.forward(ctx, *arguments)
        outputs = (result,) if isinstance(result, Tensor) else tuple(result)
        slots: list[tuple[str, int] | None] = []
        extras: list[Tensor] = []
        for t in ctx.saved_tensors:
            index = next((i for i, given in enumerate(tensors) if t is given), None)
            produced = next((i for i, given in enumerate(outputs) if t is given), None)
            if t is None:
                slots.append(None)
            elif index is not None:
                slots.append(("input", index))
            elif produced is not None:
                slots.append(("output", produced))
            else:
                slots.append(("extra", len(extras)))
                extras.append(t)
        if len(outputs) != self.outputs:
            raise TypeError(f"{self.function.__name__}.forward returned {len(outputs)} tensors, not {self.outputs}")
        if key not in self.saved:
            self.saved[key] = _Saved(tuple(slots), ctx.attributes())
        return [t.contiguous() for t in (*outputs, *extras)]

    def _setup_context(self, ctx: Any, inputs: tuple, output: list[Tensor]) -> None:
        """``register_autograd``'s context: the key, which inputs need a gradient (kept, for their shapes), the
        inputs and outputs ``forward`` saved, and its other saved tensors (the forward operator's extra outputs)."""
        key, tensors = inputs
        saved = self.saved[key]
        ctx.key, ctx.needs = key, [t.requires_grad for t in tensors]
        ctx.like = len([t for t in tensors if t.requires_grad])
        ctx.save_for_backward(
            *(t for t in tensors if t.requires_grad),
            *(tensors[i] for i in saved.kept("input")),
            *(output[i] for i in saved.kept("output")),
            *output[self.outputs :],
        )

    def _autograd_backward(self, ctx: Any, grads: list[Tensor]) -> tuple[None, list[Tensor | None]]:
        """``register_autograd``'s backward: the backward operator on what :meth:`_setup_context` kept and the
        outputs' gradients (those of the extra outputs are never used)."""
        like, stored = ctx.saved_tensors[: ctx.like], ctx.saved_tensors[ctx.like :]
        gradients = iter(self.backward_op(ctx.key, ctx.needs, list(like), list(stored), list(grads[: self.outputs])))
        return None, [next(gradients) if need else None for need in ctx.needs]

    def _backward(
        self, key: int, needs: list[bool], like: list[Tensor], stored: list[Tensor], grads: list[Tensor]
    ) -> list[Tensor]:
        """The Function's ``backward``: the gradients (contiguous) of its tensor arguments that require one
        (``needs``; ``like``: those arguments), from what :meth:`_setup_context` stored (the saved inputs, the
        saved outputs, then the other saved tensors)."""
        saved = self.saved[key]
        given = iter(stored)
        kept = {kind: dict(zip(saved.kept(kind), given)) for kind in ("input", "output")}
        kept["extra"] = dict(enumerate(given))
        spec = self.specs[key]
        flags = iter(needs)
        ctx = _Context(
            tuple(next(flags) if a is TENSOR else False for a in spec),
            tuple(None if slot is None else kept[slot[0]][slot[1]] for slot in saved.slots),
        )
        for name, value in saved.attributes:
            setattr(ctx, name, value)
        with torch.no_grad():
            result = self.function.backward(ctx, *(g.contiguous() for g in grads))
        result = result if isinstance(result, tuple) else (result,)
        wanted = [g for g, a, need in zip(result, spec, ctx.needs_input_grad) if a is TENSOR and need]
        if any(g is None for g in wanted):
            raise RuntimeError(f"{self.function.__name__}.backward gave no gradient for an input that requires one")
        return _unaliased([g.contiguous() for g in wanted], [*stored, *grads])


@torch.compiler.assume_constant_result
def _intern(operators: FusedOperators, spec: tuple) -> int:
    """:meth:`FusedOperators.intern`, evaluated while dynamo traces (its result a constant of the graph): a digest of
    the arguments' :func:`stable_description`, the same in every process (a compiled graph that a cache keeps names
    the same kind of call in the next process), or a number of this process's own where they have none."""
    key = operators.keys.get(spec)
    if key is None:
        text = stable_description((operators.function.__qualname__, spec))
        key = -len(operators.keys) - 1 if text is None else int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
        if operators.specs.setdefault(key, spec) != spec:
            raise RuntimeError(f"two kinds of {operators.function.__name__} call have one description: {text}")
        operators.keys[spec] = key
    return key


def registered_operators(outputs: int = 1) -> Callable[[type], type]:
    """Class decorator: register the pair of operators (:class:`FusedOperators`) of a fused Function whose
    ``forward`` returns ``outputs`` tensors (one: a tensor, more: a tuple)."""
    return functools.partial(_register, outputs=outputs)


def _register(function: type[torch.autograd.Function], outputs: int) -> type[torch.autograd.Function]:
    """:func:`registered_operators` of ``function``: its ``apply_operators`` static method."""
    operators = FusedOperators(function, outputs)

    def apply_operators(*args: Any) -> Any:
        return operators(*args)

    function.apply_operators = staticmethod(apply_operators)  # type: ignore[attr-defined]
    return function


def runs_as_operator(like: Tensor) -> bool:
    """Whether a fused layer on ``like`` runs as its operators: inside ``torch.compile`` (not ``torch.export``), on
    float32 CPU tensors, with the compiled CPU kernels on in the traced options."""
    return (
        torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and runtime_options().cpu_kernels
        and like.device.type == "cpu"
        and like.dtype == torch.float32
    )


def fused_apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``, through its registered operators where :func:`runs_as_operator` for its first
    tensor argument and no argument is a module (an activation given as one: its formulas are traced)."""
    like = next(a for a in args if isinstance(a, Tensor))
    if runs_as_operator(like) and not any(isinstance(a, torch.nn.Module) for a in args):
        return function.apply_operators(*args)  # type: ignore[attr-defined]
    return function.apply(*args)
