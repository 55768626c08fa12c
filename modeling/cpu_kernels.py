"""Compiled kernels for the fused layers, the recomputed leading columns, and saving typed records for backward.

In float32, a fused layer can run its pure-tensor core (a function of tensors that returns tensors) through
:func:`kernel`: ``torch.compile(dynamic=True, fullgraph=True)`` turns its chain of elementwise passes into a few
fused C++ loops on the CPU, or a few Triton kernels on a CUDA device (in place of hundreds of eager launches per
layer).  :func:`kernel_use` decides per call from the :class:`runtime.RuntimeOptions` (the ``cpu_kernels`` and
``gpu_kernels`` switches and, on the CPU, the ``kernel_min_elements`` size) and the tensors; float64 and code
already inside ``torch.compile`` run the same function eagerly, and so do small CPU tensors, except in a model's
gradient-free passes (``kernels_at_hand``), where a small call runs a variant already compiled for its kind of
arguments (:func:`kernel_use`; single images after :meth:`PolarViTPreTrainedModel.compile_cpu_kernels`).
Training and inference (``eval`` under ``no_grad``) call the same kernels: a kernel runs on detached arguments
inside an autograd Function's forward or backward, so one compiled variant serves both.  A compiler failure (no
C++ compiler) warns once and runs eager for the rest of the process.
Compiled kernels are kept on disk (:class:`PersistentKernel`, :func:`kernel_cache_dir`): compiled once per
machine, torch and source, loaded in milliseconds by every later process.

:class:`LeadingColumnsFunction` (:func:`leading_columns`) runs a pure tensor function of the first few coordinates
of a tensor, the others passed through, without keeping its autograd graph: backward runs the function's
hand-derived backward on the saved columns.

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and :mod:`runtime`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import logging
import os
import sys
import threading
import time
import types
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .operators import fused_apply, registered_operators, stable_description
from .runtime import runtime_options, set_runtime_options
from .torch_internals import (
    PRECOMPILED_HEADERS,
    global_state,
    inductor_default_cache_dir,
    inductor_option_names,
    inductor_threads,
    keep_precompiled_headers,
    mark_size_static,
    no_duck_sizing,
    saved_tensor_hooks_active,
    torch_function_mode_depth,
)

__all__ = [
    "DOUBLE_BACKWARD_MESSAGE",
    "MATCHED_SIGNATURES",
    "bound",
    "call_signature",
    "clear_compiled",
    "compile_options",
    "compiled_functions",
    "compiled_variants",
    "cpu_kernels_enabled",
    "first_order",
    "inductor_options",
    "kernel_options",
    "PersistentKernel",
    "argument_kinds",
    "kernel",
    "kernel_cache_dir",
    "kernel_threads",
    "kernel_use",
    "KernelUse",
    "leading_cat",
    "leading_columns",
    "LeadingColumnsFunction",
    "map_tensors",
    "rebuild_record",
    "record_layout",
    "record_leaves",
    "recompute_vjp",
    "run_at_hand",
    "run_maybe_compiled",
    "save_with_record",
    "saved_with_record",
    "set_cpu_kernels",
    "source_digest",
    "static_last_sizes",
    "sum_dims",
]

DOUBLE_BACKWARD_MESSAGE = (
    "double backward (create_graph=True, then a backward through the gradient) is not supported by the fused "
    "layers, whose backward passes are hand-derived; build the model with fused_ops=False (the reference layers, "
    "differentiated by autograd to any order)"
)

# (function, device type) -> its compiled kernel (or the function itself after a compiler failure)
_COMPILED: dict[tuple[Callable, str], Callable] = {}
_NOTHING_AT_HAND: set[tuple] = set()  # (function, size, inference, threads) of calls with no variant at hand
MATCHED_SIGNATURES = 64  # call signatures per kernel whose matching variant is remembered (PersistentKernel)
NO_CUDA_NOTICE = "No CUDA runtime is found"  # torch's C++ extension loader, when a CPU kernel compiles


class _WithoutNoCudaNotice(logging.Filter):
    """Drops torch's notice that no CUDA runtime is found (printed when inductor compiles a C++ kernel on a machine
    without a GPU): a CPU kernel needs none, and the notice reads as an error to a CPU-only user."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return not record.getMessage().startswith(NO_CUDA_NOTICE)


def _quiet_cpu_compiles() -> None:
    """Install :class:`_WithoutNoCudaNotice` on the logger of ``torch.utils.cpp_extension`` (once)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _WithoutNoCudaNotice) for f in logger.filters):
        logger.addFilter(_WithoutNoCudaNotice())


_quiet_cpu_compiles()


def set_cpu_kernels(enabled: bool) -> None:
    """Turn the compiled CPU kernels on or off for this context (``set_runtime_options(cpu_kernels=...)``)."""
    set_runtime_options(cpu_kernels=bool(enabled))


def cpu_kernels_enabled() -> bool:
    """Whether the fused layers may use their compiled CPU kernels in this context."""
    return runtime_options().cpu_kernels


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
        flagged = [
            RefuseDoubleBackward.apply(v.detach().requires_grad_()) if isinstance(v, Tensor) else v for v in values
        ]
        return tuple(flagged) if isinstance(gradients, tuple) else flagged[0]

    return wrapper


def _refusing(value: Any) -> Any:
    """``value`` (a gradient) as a leaf of :class:`RefuseDoubleBackward` if it is a tensor, else as it is."""
    return RefuseDoubleBackward.apply(value.detach().requires_grad_()) if isinstance(value, Tensor) else value


class RefuseDoubleBackward(torch.autograd.Function):
    """The identity, whose backward raises :data:`DOUBLE_BACKWARD_MESSAGE`: what :func:`first_order` attaches to a
    hand-derived gradient computed under ``create_graph=True``."""

    @staticmethod
    def forward(ctx: Any, value: Tensor) -> Tensor:  # noqa: D102
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)


class KernelUse(enum.Enum):
    """How a call uses its compiled kernel (:func:`kernel_use`; ``None``: not at all, eagerly)."""

    COMPILE = "compile"  # a variant that serves the call, loaded or compiled
    AT_HAND = "at hand"  # a variant already loaded, or saved for the call's kind of arguments; never a compile


def kernel_use(like: Tensor, elements: int | None = None) -> KernelUse | None:
    """How a call uses compiled kernels: float32, not inside ``torch.compile`` and no saved-tensor hooks in force
    (their packing runs in Python, between eager operations).  On a CUDA device :attr:`KernelUse.COMPILE` where
    ``gpu_kernels`` is on (off by default), at every size (each eager operation is a launch there).  On the CPU where
    ``cpu_kernels`` is on, :attr:`KernelUse.COMPILE` from ``kernel_min_elements`` elements in the call's largest
    tensors (``like``, or ``elements`` where those are temporaries, as the attention's pairs), below it
    :attr:`KernelUse.AT_HAND` where ``kernels_at_hand`` is on (a model's gradient-free passes), else ``None``
    (eager: a compile would cost more than the call saves); a large call too is :attr:`KernelUse.AT_HAND` where
    ``kernel_compiles`` is off (a model's gradient-free passes after its warm-up: no compile behind a request)."""
    options = runtime_options()
    device = like.device.type
    if not (
        (options.cpu_kernels if device == "cpu" else options.gpu_kernels and device == "cuda")
        and like.dtype == torch.float32
        and not torch.compiler.is_compiling()
        and not saved_tensor_hooks_active()
    ):
        return None
    if device == "cuda" or (like.numel() if elements is None else elements) >= options.kernel_min_elements:
        return KernelUse.COMPILE if options.kernel_compiles or device == "cuda" else KernelUse.AT_HAND
    return KernelUse.AT_HAND if options.kernels_at_hand else None


def inductor_options(**options: Any) -> Callable[[Callable], Callable]:
    """Decorator: compile ``fn``'s kernels, and those of its :func:`bound` and vector-Jacobian forms, with these
    inductor options (``torch.compile(..., options=...)``), part of their cache key.  For a function whose
    kernels run faster with other options, such as ``realize_reads_threshold=1`` (store a value read more than
    once instead of recomputing it in each loop that reads it) for the ambient twin's layers."""

    def mark(fn: Callable) -> Callable:
        fn.inductor_options = dict(options)  # type: ignore[attr-defined]
        return fn

    return mark


def kernel_options(fn: Callable) -> dict[str, Any] | None:
    """The inductor options :func:`inductor_options` gave ``fn`` (``None``: inductor's defaults)."""
    return getattr(fn, "inductor_options", None)


GPU_NUMERICS = {  # inductor's options for eager's numerics in Triton code, where this torch has them
    "eager_numerics.division_rounding": True,  # x / y rounded as eager divides (Triton's default: div.full, ~2 ulp)
    "eager_numerics.use_pytorch_libdevice": True,  # log and the other functions from libdevice, not lg2.approx
    "eager_numerics.disable_ftz": True,  # subnormals kept, as eager keeps them
}


def compile_options(fn: Callable, device: str) -> dict[str, Any] | None:
    """The inductor options ``fn``'s kernels compile with on ``device``: its :func:`kernel_options`, and on a GPU
    those of :data:`GPU_NUMERICS` this torch knows (the exact-chord formulas need correctly rounded division and
    logarithms near 1)."""
    options = kernel_options(fn)
    if device == "cpu":
        return options
    names = inductor_option_names()
    known = {name: value for name, value in GPU_NUMERICS.items() if name in names}
    return {**known, **(options or {})} or None


def kernel(fn: Callable, device: str = "cpu") -> Callable:
    """``fn`` compiled by inductor with dynamic shapes for tensors on ``device`` (a device type), or ``fn`` itself
    if compiling fails: a warning, then eager.

    ``fn`` runs on detached arguments (records of tensors included): a kernel is called where autograd records
    nothing (an autograd Function's forward or backward), and its guards then see the same arguments in training
    and in inference.  The compiled variants persist across processes (:class:`PersistentKernel`): a new process
    loads them from :func:`kernel_cache_dir` instead of tracing ``fn`` again; a CPU variant serves only the thread
    count it was compiled for (:func:`kernel_threads`)."""
    compiled = _persistent_kernel(fn, device)

    def run(*args: Any) -> Any:
        if isinstance(compiled, PersistentKernel):
            try:
                return compiled(*_detached(args))
            except Exception as error:  # noqa: BLE001 - a compiler failure falls back to the same formulas
                _fall_back(fn, device, error)
        return fn(*args)

    return run


def run_at_hand(fn: Callable, like: Tensor, *args: Any) -> Any:
    """``fn(*args)`` through a compiled variant at hand (:meth:`PersistentKernel.at_hand`: loaded, or saved for the
    call's kind of arguments; never compiled here), else eagerly.  A miss is remembered per function, size of
    ``like`` and thread count until a variant is compiled (:func:`kernel_use`'s :attr:`KernelUse.AT_HAND`: a
    small call then costs one set lookup)."""
    key = (fn, like.shape, like.is_inference(), torch.get_num_threads())
    if key in _NOTHING_AT_HAND:
        return fn(*args)
    compiled = _persistent_kernel(fn, like.device.type)
    if isinstance(compiled, PersistentKernel):
        try:
            detached = _detached(args)
            variant = compiled.at_hand(detached)
            if variant is not None:
                return variant.fn(*detached)
        except Exception as error:  # noqa: BLE001 - an unusable variant falls back to the same formulas
            _fall_back(fn, like.device.type, error)
    _NOTHING_AT_HAND.add(key)
    return fn(*args)


def _persistent_kernel(fn: Callable, device: str) -> Callable:
    """``fn``'s :class:`PersistentKernel` for ``device`` (made at its first call there, and on the CPU again when
    the thread count changed: that count's variants), or ``fn`` itself after a compiler failure."""
    compiled = _COMPILED.get((fn, device))
    if compiled is None or (
        isinstance(compiled, PersistentKernel) and device == "cpu" and compiled.threads != kernel_threads()
    ):
        compiled = _COMPILED[fn, device] = PersistentKernel(fn, device)
    return compiled


def _fall_back(fn: Callable, device: str, error: Exception) -> None:
    """Warn that ``fn``'s compiled kernel for ``device`` failed and run it eagerly there from now on."""
    warnings.warn(
        f"polar_vit_hf: compiled {device.upper()} kernels unavailable ({type(error).__name__}: {str(error)[:200]}); "
        "running eager",
        stacklevel=3,
    )
    _COMPILED[fn, device] = fn


def map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, inside (named) tuples too; anything else as it is."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_tensors(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _detached(value: Any) -> Any:
    """``value`` with every tensor that requires grad detached (:func:`map_tensors`); the others are passed as
    they are (a kernel's arguments are mostly computed where autograd records nothing: detaching them too cost a
    ``detach`` call each, thousands per training step)."""
    return map_tensors(value, _detach_if_tracked)


def _detach_if_tracked(t: Tensor) -> Tensor:
    """``t`` detached if it requires grad, else ``t`` itself."""
    return t.detach() if t.requires_grad else t


def sum_dims(x: Tensor, keep: int = 0) -> Tensor:
    """``x`` summed over all but its last ``keep`` dimensions, one dimension at a time (the batch's last), float32
    accumulated in float64: a parameter's gradient sums many per-token terms, whose float32 rounding would follow
    each kernel's summation order, which differs by vector width.

    Inductor picks its float32 summation scheme by the size of each reduction and guards that choice (``size <=
    4096`` or not): over one dimension at a time, a kernel's guards bound the batch and the tokens separately, not
    their product, so a kernel compiled at one batch size serves the others."""
    dtype = x.dtype
    x = x.double() if dtype == torch.float32 else x
    while x.dim() > keep:
        x = x.sum(x.dim() - keep - 1)
    return x.to(dtype)


def kernel_threads() -> int:
    """The thread count inductor compiles a C++ kernel for now, and writes into it (``#pragma omp parallel
    num_threads(n)``, one partial sum per thread; one thread: no parallel loop at all): a variant runs that many
    threads in any process, so it serves only processes that run as many (``torch.set_num_threads``,
    ``OMP_NUM_THREADS``); :func:`torch_internals.inductor_threads`."""
    return inductor_threads()


def kernel_cache_dir() -> Path | None:
    """Where compiled kernels are kept between processes: ``$POLAR_VIT_KERNEL_CACHE`` (empty or ``0``: nowhere),
    else ``~/.cache/polar_vit_hf/kernels``; one subfolder per torch version, CPU capability and Python version."""
    root = os.environ.get("POLAR_VIT_KERNEL_CACHE", str(Path.home() / ".cache" / "polar_vit_hf" / "kernels"))
    if root in ("", "0"):
        return None
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"torch-{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}-{python}"


class PersistentKernel:
    """``fn``'s compiled variants, each an ahead-of-time compiled function (``torch.compile(...).aot_compile``)
    kept in :func:`kernel_cache_dir` and guarded by what it was compiled for (dtypes, ranks, which arguments
    are ``None``, shape relations).

    A call runs the first loaded variant whose guards accept the arguments; if none does, it loads saved variants
    of the same function, the same source code of this package, the same torch and the same thread count
    (:attr:`threads`, :func:`kernel_threads`: inductor's guards do not check it) (:meth:`_load_matching`: those
    of the call's :func:`argument_kinds` first, the most recently used first within each), until one does (no
    tracing, no compile; only the variants a process's calls need); if none does, it compiles a
    new one from the arguments (``dynamic=True``: any sizes of the same kind but the tensors' last,
    :func:`static_last_sizes`) and saves it.  Where a function cannot be compiled ahead of time (or the cache is
    off) it runs through ``torch.compile`` as usual (inductor's own caches then apply).
    """

    def __init__(self, fn: Callable, device: str = "cpu") -> None:
        self.fn = fn
        self.device = device  # the device type of its variants' tensors
        # the thread count its CPU variants are compiled for and loaded at (0 on a GPU)
        self.threads = kernel_threads() if device == "cpu" else 0
        self.folder = _variants_folder(fn, self.threads, device)
        self.variants: list[Any] = []
        self.loaded: set[str] = set()  # the files of the folder already loaded (or unreadable)
        self.jit: Callable | None = None
        self.compiles = 0  # variants this process compiled
        self.loads = 0  # variants this process loaded from the cache
        self.matched: dict[tuple, tuple[Any, Any]] = {}  # call_signature -> (variant, global state it matched in)
        self.lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        with self.lock:
            variant = self._matching(args)
            if variant is None and self.jit is None and self.folder is not None:
                variant = self._load_matching(args)  # saved by an earlier or a parallel process
                if variant is None:
                    variant = _compile_variant(self.fn, args, self.folder, self.loaded, self.device)
                    if variant is not None:
                        self.variants.append(variant)
                        self.compiles += 1
                        _NOTHING_AT_HAND.clear()  # a call that missed may find this variant
            if variant is None and self.jit is None:
                options = compile_options(self.fn, self.device)
                self.jit = torch.compile(self.fn, dynamic=True, fullgraph=True, options=options)
        return variant.fn(*args) if variant is not None else self.jit(*args)  # type: ignore[misc]

    def at_hand(self, args: tuple) -> Any | None:
        """A variant that accepts ``args`` without compiling one: a loaded one, else one saved for the call's
        :func:`argument_kinds` (loaded now); ``None`` if none does."""
        with self.lock:
            variant = self._matching(args)
            if variant is None and self.folder is not None:
                variant = self._load_matching(args, same_kinds_only=True)
            return variant

    def _load_matching(self, args: tuple, same_kinds_only: bool = False) -> Any | None:
        """Load the saved variants not yet loaded, those compiled for the same :func:`argument_kinds` first, each
        group the most recently used first, until one accepts ``args`` (marked used: the next process tries it
        first); ``None`` if none does.  A process loads the variants its calls need, not every one the folder
        gathered (each costs tens of milliseconds); ``same_kinds_only``: only those of the call's kinds."""
        assert self.folder is not None
        f_globals = getattr(self.fn, "__globals__", None)
        if f_globals is not None:
            _install_module_aliases(f_globals)
        kinds = argument_kinds(args)
        for path in _unloaded_files(self.folder, self.loaded, kinds):
            if same_kinds_only and not path.name.startswith(f"{kinds}-"):
                break  # (the call's kinds come first)
            variant = _load_variant(path, f_globals, self.loaded)
            if variant is None:
                continue
            self.variants.append(variant)
            self.loads += 1
            if variant.guard_check(*args):
                _mark_used(path)
                self._remember(call_signature(args), variant)
                return variant
        return None

    def _matching(self, args: tuple) -> Any | None:
        """The first variant whose guards accept ``args``: the one that accepted a call of the same
        :func:`call_signature` in the same global state (grad mode, threads, autocast, default dtype: dynamo's
        ``GlobalStateGuard``) without evaluating guards again, else the first loaded one whose guards do."""
        signature = call_signature(args)
        remembered = self.matched.get(signature) if signature is not None else None
        if remembered is not None and remembered[1].check():
            return remembered[0]
        variant = next((variant for variant in self.variants if variant.guard_check(*args)), None)
        if variant is not None:
            self._remember(signature, variant)
        return variant

    def _remember(self, signature: tuple | None, variant: Any) -> None:
        """Keep ``variant`` as the one that accepts calls of ``signature`` in the current global state (the
        latest :data:`MATCHED_SIGNATURES` signatures)."""
        if signature is None:
            return
        if len(self.matched) >= MATCHED_SIGNATURES:
            self.matched.pop(next(iter(self.matched)))
        self.matched[signature] = (variant, global_state())


def call_signature(args: tuple) -> tuple | None:
    """Everything a variant's guards read of a call, as a key: each tensor's type (a frozen ``Parameter`` is not a
    ``Tensor``), dtype, sizes, strides, ``requires_grad`` and whether it is an inference tensor, every other
    argument itself, inside (named) tuples too (their types and lengths), and the depth of the torch-function mode
    stack; ``None`` where an argument cannot be part of a key (unhashable, or a tensor without strides).  Guards
    are a function of these and of the global state, so a variant that accepted one call accepts every call of
    the same signature in the same global state."""
    parts: list[Any] = [torch_function_mode_depth()]

    def visit(values: tuple) -> None:
        for value in values:
            if isinstance(value, Tensor):
                parts.append((type(value), value.dtype, value.device, value.shape, value.stride()))
                parts.append((value.requires_grad, value.is_inference()))
            elif isinstance(value, tuple):
                parts.append((type(value), len(value)))
                visit(value)
            else:
                parts.append((type(value), value))

    try:
        visit(args)
        signature = tuple(parts)
        hash(signature)
    except (RuntimeError, TypeError):  # sparse or other stride-less tensors; unhashable arguments
        return None
    return signature


@functools.cache
def source_digest() -> str:
    """Digest of this package's source files: a kernel compiled from other code is never loaded."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _variants_folder(fn: Callable, threads: int, device: str = "cpu") -> Path | None:
    """The folder of ``fn``'s variants compiled for ``threads`` threads (:func:`kernel_threads`) or for a GPU
    (:func:`_device_tag`) from this source with its inductor options; ``None`` where the cache is off or ``fn``
    has no stable name."""
    root = kernel_cache_dir()
    name = stable_description(fn)
    if root is None or name is None:
        return None
    where = threads if device == "cpu" else _device_tag(device)
    options = compile_options(fn, device)
    key = hashlib.sha256(f"{source_digest()}|{name}|{options}|{where}".encode()).hexdigest()[:24]
    return root / key


def _device_tag(device: str) -> str:
    """A GPU's kind as its variants are kept apart by: the device type and the compute capability of the current
    device (Triton kernels are built for one)."""
    major, minor = torch.cuda.get_device_capability() if device == "cuda" else (0, 0)
    return f"{device}-sm{major}{minor}"


def argument_kinds(args: tuple) -> str:
    """A short digest of what a variant's guards check first and a call can tell cheaply: each tensor argument's
    dtype, rank, which of its sizes are 0 or 1 (the compiler specialises those: a variant traced with a size 1
    serves only size 1 there, one traced with a larger size only sizes of at least 2) and whether it is an
    inference tensor (``torch.inference_mode``), which arguments are ``None`` and the constants (inside tuples and
    records too).  Saved variants are named by it (``<kinds>-<id>.bin``), so a call tries those compiled for its
    kind of arguments first (training, single-image and ``inference_mode`` variants of a kernel share a folder)."""
    parts: list[str] = []

    def visit(value: Any) -> None:
        if isinstance(value, Tensor):
            sizes = "".join(str(size) if size < 2 else "n" for size in value.shape)
            parts.append(f"{value.dtype}/{sizes}/{int(value.is_inference())}")
        elif isinstance(value, tuple):
            parts.append("(")
            for item in value:
                visit(item)
            parts.append(")")
        else:
            parts.append(stable_description(value) or type(value).__qualname__)

    visit(args)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def _unloaded_files(folder: Path, loaded: set[str], kinds: str) -> list[Path]:
    """The variant files of ``folder`` not in ``loaded``: those named for ``kinds`` (:func:`argument_kinds`) first,
    then the others, each group the most recently used first."""
    paths = [path for path in folder.glob("*.bin") if path.name not in loaded] if folder.is_dir() else []
    stamps = {}
    for path in paths:
        try:
            stamps[path] = path.stat().st_mtime_ns
        except OSError:  # removed by a parallel process
            stamps[path] = -1
    return sorted(paths, key=lambda path: (not path.name.startswith(f"{kinds}-"), -stamps[path], path.name))


def _mark_used(path: Path) -> None:
    """Stamp a variant file as just used (its modification time), where the cache is writable."""
    try:
        os.utime(path)
    except OSError:
        pass


def _load_variant(path: Path, f_globals: dict[str, Any] | None, loaded: set[str]) -> Any | None:
    """The variant saved in ``path`` (its name added to ``loaded``), its code bound to the function's module
    globals ``f_globals`` (given :func:`_install_module_aliases`), its kernels' libraries loaded from
    :func:`_inductor_files_beside`; a file that does not load (truncated, from another build) is removed and
    ``None`` returned: the variant is compiled again when needed."""
    loaded.add(path.name)
    try:
        with open(path, "rb") as handle, _inductor_files_beside(path.parent):
            return torch.compiler.load_compiled_function(handle, f_globals=f_globals)
    except Exception:  # noqa: BLE001 - an unreadable variant is compiled again
        path.unlink(missing_ok=True)
        return None


_INDUCTOR_FOLDER_LOCK = threading.RLock()  # one redirection of inductor's cache folder at a time (a process variable)
_PROCESS_STARTED = time.time()  # (about: when this module was imported)


@contextlib.contextmanager
def _inductor_files_beside(folder: Path) -> Iterator[None]:
    """Inductor's on-disk caches (the C++ libraries of a variant's kernels, its wrapper module, the compiled graphs)
    in ``inductor/`` next to ``folder``'s variants (in :func:`kernel_cache_dir`) for the block, and its precompiled
    header kept there too (:func:`torch_internals.keep_precompiled_headers`), where the user has not chosen their
    folder (``$TORCHINDUCTOR_CACHE_DIR`` unset or inductor's default).

    A saved variant holds its kernels' C++ source, not their libraries: inductor compiles a library again wherever
    its own cache lacks it, and that cache defaults to the temporary directory, which is emptied at reboot and is
    private to each job on many clusters and to each container: every variant of a training step would compile
    again.  Kept beside the variants, the libraries live as long as they do.  The folder is a process-wide
    environment variable: set under one lock and restored."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is not None and chosen != inductor_default_cache_dir():
        yield
        return
    kept = folder.parent / PRECOMPILED_HEADERS
    inductors = Path(inductor_default_cache_dir()) / PRECOMPILED_HEADERS
    with _INDUCTOR_FOLDER_LOCK:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder.parent / "inductor")
        keep_precompiled_headers(kept, inductors)
        try:
            yield
        finally:
            if chosen is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
            keep_precompiled_headers(inductors, kept, built_since=_PROCESS_STARTED)


def _install_module_aliases(f_globals: dict[str, Any]) -> None:
    """Give ``f_globals`` the names by which compiled code refers to the modules of this package
    (``__import_<module with . as _dot_>``), as tracing installs them: a loaded variant's guards look them up."""
    for module in _package_modules(sys.modules[__name__.rpartition(".")[0]]):
        f_globals.setdefault(f"__import_{module.__name__.replace('.', '_dot_')}", module)


def _package_modules(package: types.ModuleType) -> list[types.ModuleType]:
    """``package`` and its imported submodules, found through the attributes an import sets on a module's parent:
    a walk of the package's few modules instead of a pass over ``sys.modules`` (which runs once per variant
    loaded)."""
    found, stack = {package.__name__: package}, [package]
    while stack:
        for value in vars(stack.pop()).values():
            if isinstance(value, types.ModuleType) and value.__name__.startswith(package.__name__ + "."):
                if value.__name__ not in found:
                    found[value.__name__] = value
                    stack.append(value)
    return list(found.values())


def leading_cat(first: Tensor, rest: Tensor) -> Tensor:
    """``cat([first[..., None], rest], -1)``: a packed point or gradient ``(..., 1 + w)`` from its leading coordinate
    ``first (...)`` and the others ``rest (..., w)``; inside a compiled kernel concatenated as ``(T, 1 + w)`` rows
    (the leading sizes flattened) and viewed back.

    Where a leading size is 1 (a Polar-FC of one head: ``(B, N, 1, w)``), inductor otherwise lays the concatenation
    out in the order of the per-token column's strides, which a size-1 dimension leaves arbitrary: tokens adjacent,
    coordinates ``N`` apart, then one more pass that transposes it into the output; the rows avoid that pass, bit for
    bit the same."""
    if not torch.compiler.is_compiling():
        return torch.cat([first.unsqueeze(-1), rest], dim=-1)
    shape = (*rest.shape[:-1], rest.shape[-1] + 1)
    return torch.cat([first.reshape(-1, 1), rest.reshape(-1, rest.shape[-1])], dim=-1).view(shape)


def static_last_sizes(value: Any) -> Any:
    """``value`` with every tensor of rank 2 or more replaced by an alias (``detach``: the caller's tensor is left
    unmarked) whose last size the compiler takes as a constant (:func:`torch_internals.mark_size_static`), inside
    (named) tuples too (:func:`map_tensors`).

    The last size of a kernel's tensors is the model's (the coordinates ``d``, the keys ``M``, the heads), never the
    batch's; a constant there lets inductor unroll and vectorise its innermost loops without remainder code.  The
    sizes before it (batch, tokens, groups of slices) stay symbolic: one variant serves every batch size."""
    return map_tensors(value, _static_last_size)


def _static_last_size(t: Tensor) -> Tensor:
    """``t`` itself below rank 2, else an alias of it with its last size marked static."""
    if t.dim() < 2:
        return t
    alias = t.detach()
    mark_size_static(alias, t.dim() - 1)
    return alias


def _aot_compile(fn: Callable, args: tuple, device: str = "cpu") -> Any:
    """``torch.compile(fn, dynamic=True, fullgraph=True)`` ahead of time for arguments like ``args`` on ``device``
    (:func:`compile_options`), without duck sizing (sizes equal in ``args`` need not stay equal), their last sizes
    constant (:func:`static_last_sizes`)."""
    with no_duck_sizing(), warnings.catch_warnings():
        # (the guards read ``.grad`` of non-leaf arguments, which warns)
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=compile_options(fn, device))
        return compiled.aot_compile((static_last_sizes(args), {}))  # type: ignore[attr-defined]


def _compile_variant(fn: Callable, args: tuple, folder: Path, loaded: set[str], device: str = "cpu") -> Any | None:
    """``fn`` compiled ahead of time for arguments like ``args`` on ``device`` and saved in ``folder`` (its file name
    added to ``loaded``); ``None`` where it cannot be (the caller then uses ``torch.compile``)."""
    with _inductor_files_beside(folder):
        try:
            variant = _aot_compile(fn, args, device)
        except Exception:  # noqa: BLE001 - a restart of the analysis, which ``torch.compile`` itself retries
            try:
                variant = _aot_compile(fn, args, device)
            except Exception:  # noqa: BLE001 - not every traceable function can be compiled ahead of time
                return None
    name = f"{argument_kinds(args)}-{uuid.uuid4().hex}.bin"
    loaded.add(name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        variant.save_compiled_function(str(folder / name))  # written atomically
    except Exception:  # noqa: BLE001 - a read-only or full disk: the variant still serves this process
        pass
    return variant


def compiled_functions(device: str = "cpu") -> dict[Callable, Callable]:
    """``{function: its compiled kernel}`` for ``device`` (a device type) so far in this process (the function
    itself after a compiler failure)."""
    return {fn: compiled for (fn, where), compiled in _COMPILED.items() if where == device}


def compiled_variants() -> int:
    """The variants this process compiled so far (over every :class:`PersistentKernel`)."""
    return sum(k.compiles for k in _COMPILED.values() if isinstance(k, PersistentKernel))


def clear_compiled() -> None:
    """Forget the compiled kernels (the next training call compiles again, from inductor's cache)."""
    _COMPILED.clear()
    _NOTHING_AT_HAND.clear()


def run_maybe_compiled(fn: Callable, like: Tensor, *args: Any, elements: int | None = None) -> Any:
    """``fn(*args)``, through :func:`kernel` where :func:`kernel_use` says so."""
    use = kernel_use(like, elements)
    return _through_kernel(use, fn, like, *args) if use is not None else fn(*args)


def _through_kernel(use: KernelUse, fn: Callable, like: Tensor, *args: Any) -> Any:
    """``fn(*args)`` through its compiled kernel for ``like``'s device as ``use`` says (:func:`kernel` or
    :func:`run_at_hand`)."""
    return run_at_hand(fn, like, *args) if use is KernelUse.AT_HAND else kernel(fn, like.device.type)(*args)


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


@registered_operators()
class LeadingColumnsFunction(torch.autograd.Function):
    """``fn(x[..., :width], *tensors, *constants)`` in place of the first ``width`` coordinates of ``x``, its other
    coordinates passed through, for a pure function that changes only a few leading coordinates (the ambient twin's
    position encodings: the time and the four reserved coordinates), without an autograd graph of its
    intermediates.  Saved: those columns of ``x`` and ``tensors``; backward runs ``fn_backward(grad[..., :width],
    x[..., :width], *tensors, *constants)``, which returns the gradients of the columns and of ``tensors``, and passes
    the other columns' gradient through.  Each a compiled kernel on the CPU where the whole call is large enough."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any, fn: Callable, fn_backward: Callable, constants: tuple, width: int, x: Tensor, *tensors: Tensor
    ) -> Tensor:
        ctx.fn, ctx.fn_backward, ctx.constants, ctx.width = fn, fn_backward, constants, width
        lead = x[..., :width].contiguous()
        ctx.save_for_backward(lead, *tensors)
        return _leading_columns(x, _run_bound(fn, constants, (lead, *tensors), x.numel()), width)

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple:  # noqa: D102
        lead_grad = grad[..., : ctx.width].contiguous()
        gradients = _run_bound(ctx.fn_backward, ctx.constants, (lead_grad, *ctx.saved_tensors), grad.numel())
        return (None, None, None, None, _leading_columns(grad, gradients[0], ctx.width), *gradients[1:])


def _run_bound(fn: Callable, constants: tuple, tensors: tuple, size: int | None = None) -> Any:
    """``fn(*tensors, *constants)``, a compiled kernel where :func:`kernel_use` says so for the first tensor (or a
    call of ``size`` elements)."""
    use = kernel_use(tensors[0], size)
    if use is not None:  # (the cached binding is not traced inside torch.compile)
        return _through_kernel(use, bound(fn, constants), tensors[0], *tensors)
    return fn(*tensors, *constants)


def _leading_columns(x: Tensor, lead: Tensor, width: int) -> Tensor:
    """A new tensor like ``x``: ``lead`` in its first ``width`` coordinates, ``x``'s other coordinates after them."""
    out = torch.empty_like(x)
    out[..., :width] = lead
    out[..., width:] = x[..., width:]
    return out


@functools.cache
def bound(fn: Callable, constants: tuple) -> Callable:
    """``fn`` with its trailing ``constants`` bound (one function object per pair: one compiled kernel, the
    constants compiled in, ``fn``'s :func:`kernel_options`)."""
    return _with_options_of(fn, lambda *tensors: fn(*tensors, *constants))


def _with_options_of(fn: Callable, derived: Callable) -> Callable:
    """``derived`` (a form of ``fn``) compiled with ``fn``'s :func:`kernel_options`."""
    options = kernel_options(fn)
    return derived if options is None else inductor_options(**options)(derived)


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


def save_with_record(ctx: Any, record: Any, *tensors: Tensor | None) -> None:
    """``ctx.save_for_backward(*tensors, *record's leaves)``, the record's layout on ``ctx``
    (:func:`saved_with_record` returns both)."""
    ctx.record_layout, ctx.kept_tensors = record_layout(record), len(tensors)
    ctx.save_for_backward(*tensors, *record_leaves(record))


def saved_with_record(ctx: Any) -> tuple[tuple[Tensor, ...], Any]:
    """``(tensors, record)`` as :func:`save_with_record` saved them."""
    saved = ctx.saved_tensors
    return saved[: ctx.kept_tensors], rebuild_record(ctx.record_layout, iter(saved[ctx.kept_tensors :]))


def leading_columns(
    fn: Callable, fn_backward: Callable, width: int, x: Tensor, *tensors: Tensor, constants: tuple = ()
) -> Tensor:
    """``x`` with its first ``width`` coordinates replaced by ``fn(x[..., :width], *tensors, *constants)``, its
    backward ``fn_backward``, through :class:`LeadingColumnsFunction` (:func:`operators.fused_apply`)."""
    return fused_apply(LeadingColumnsFunction, fn, fn_backward, tuple(constants), width, x, *tensors)
