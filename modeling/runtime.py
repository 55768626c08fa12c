"""How Polar-ViT computes, decided in one place: the runtime options.

What the model computes is fixed by its config; *how* (compiled CPU kernels or eager passes, the sizes from
which they pay off, the cache-sized groups of the attention core, whether the public geometry functions scan
their inputs for NaN/Inf) is a :class:`RuntimeOptions` record held in a :class:`contextvars.ContextVar`:
per thread and per task, never a module global, so a web server's threads or a DataLoader's thread workers
cannot switch another caller's checks off.

* :func:`runtime_options` - the options in force;
* :func:`use_runtime_options` - a context manager that changes some of them for a block (and restores them);
* :func:`set_runtime_options` - changes them for the rest of the current context (thread).

A new thread starts with the defaults, read once from the environment (``POLAR_VIT_CPU_KERNELS=0`` starts
with the compiled CPU kernels off).

This module is part of the remote code of exported checkpoints: it imports only the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["RuntimeOptions", "runtime_options", "set_runtime_options", "use_runtime_options"]


@dataclass(frozen=True)
class RuntimeOptions:
    """The switches and thresholds of the implementation (never of the formulas).

    Attributes:
        cpu_kernels: the fused layers may run their pure-tensor cores as inductor-compiled kernels when
            training in float32 on the CPU (:mod:`cpu_kernels`).
        gpu_kernels: the same on CUDA devices, at every size: inductor's Triton kernels, compiled with eager's
            division and math library (:func:`cpu_kernels.compile_options`), in place of the eager chain of
            elementwise launches (tens of thousands per training step).  Off unless ``POLAR_VIT_GPU_KERNELS=1``:
            faster (docs/benchmarks.md, "On an NVIDIA H200"), but its check against eager on the device
            (``tests/test_gpu_kernels.py``) has not passed yet.
        kernel_min_elements: a fused layer uses its compiled kernel only from this many elements in its largest
            tensor (``benchmarks/step_time.py``: the kernels win at every tiny-cifar batch from 8 to 128 once their
            compiled variants load from the kernel cache; below this size - the ``demo`` preset - a short run
            never wins back the first compile, minutes on 2 cores).
        attention_group_elements: score elements per block of the fused attention core (cache-sized
            temporaries): groups of whole samples (``H x N x M`` each), else of one sample's heads, else blocks of
            one slice's query rows (long sequences); ``None``: by the slices' length
            (:func:`fused_attention.group_elements`: ``2^19`` to ``2^20``, at least 24 slices where they fit).
        chunked_min_tokens: ``polar_attn_implementation="auto"`` uses the chunked core from this many tokens
            where the model's own core is not the fused one (the reference layers; CUDA without Triton)
            (:func:`attention.select_implementation`).
        input_checks: the public geometry functions scan CPU inputs for NaN/Inf; the model checks its input
            once at the edge and runs its layers without these scans.
        kernels_at_hand: a call below ``kernel_min_elements`` runs a compiled variant already at hand (loaded, or
            saved in the kernel cache for its kind of arguments) and never compiles one; the model turns it on for
            its gradient-free passes (``no_grad``, ``inference_mode``: evaluation and pipelines, where a single
            image stays below the size), whose variants ``model.compile_cpu_kernels()`` compiles once per machine.
        kernel_compiles: a call from ``kernel_min_elements`` may compile a variant when none at hand accepts it;
            the model turns it off in its gradient-free passes after ``model.compile_cpu_kernels()`` (a server's
            warm-up), so that no request waits for a compile: such a call runs a variant at hand, else eagerly.
    """

    cpu_kernels: bool = True
    gpu_kernels: bool = False
    kernel_min_elements: int = 1 << 16
    attention_group_elements: int | None = None
    chunked_min_tokens: int = 1024
    input_checks: bool = True
    kernels_at_hand: bool = False
    kernel_compiles: bool = True

    @classmethod
    def from_environment(cls) -> RuntimeOptions:
        """The defaults, with ``POLAR_VIT_CPU_KERNELS=0`` turning the compiled CPU kernels off and
        ``POLAR_VIT_GPU_KERNELS=1`` the compiled GPU kernels on."""
        return cls(
            cpu_kernels=os.environ.get("POLAR_VIT_CPU_KERNELS", "1") != "0",
            gpu_kernels=os.environ.get("POLAR_VIT_GPU_KERNELS", "0") == "1",
        )


_DEFAULTS = RuntimeOptions.from_environment()  # frozen: safe as the context variable's shared default
_CURRENT: ContextVar[RuntimeOptions] = ContextVar("polar_vit_runtime_options", default=_DEFAULTS)  # noqa: B039


def runtime_options() -> RuntimeOptions:
    """The options in force in this context (thread, task); inside ``torch.compile`` the defaults from the
    environment (a compiled graph is static, and the compiled kernels and input scans are off there anyway)."""
    return _TRACED if _compiling() else _CURRENT.get()


def _compiling() -> bool:
    import torch  # (a light import: torch is loaded wherever the options are read)

    return torch.compiler.is_compiling()


_TRACED = RuntimeOptions.from_environment()  # what compiled graphs see (input checks are skipped there anyway)


def _changed(**changes: Any) -> RuntimeOptions:
    known = {field.name for field in fields(RuntimeOptions)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"unknown runtime options {unknown}; the options are {sorted(known)}")
    return replace(_CURRENT.get(), **changes)


def use_runtime_options(**changes: Any) -> AbstractContextManager[RuntimeOptions]:
    """Change some options for the block (``with use_runtime_options(cpu_kernels=False): ...``); inside
    ``torch.compile`` a ``contextlib.nullcontext`` (the traced graph keeps the options it was traced with, and the
    compiler may break its graph inside the block, where a generator's context manager would make it run the
    calling function uncompiled)."""
    if _compiling():
        return nullcontext(_TRACED)
    return _options_block(_changed(**changes))


@contextmanager
def _options_block(options: RuntimeOptions) -> Iterator[RuntimeOptions]:
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)


def set_runtime_options(**changes: Any) -> RuntimeOptions:
    """Change some options for the rest of this context; returns the previous options."""
    previous = _CURRENT.get()
    _CURRENT.set(_changed(**changes))
    return previous
