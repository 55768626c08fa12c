"""The private PyTorch interfaces this package calls, each behind one function that says what it is for and why no
supported API does it (``docs/architecture.md``, "Private PyTorch interfaces").  Everything else in the package
uses supported APIs only: ``torch.compile`` and its ``options``, ``torch.compiler`` (``assume_constant_result``,
``load_compiled_function``, ``save_cache_artifacts``), ``torch.library`` and ``torch.autograd.Function``.

A torch upgrade that moves one of these breaks this module alone; ``tests/test_torch_internals.py`` checks each
against the behaviour it stands for.

This module is part of the remote code of exported checkpoints: it imports only ``torch``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "GlobalState",
    "PRECOMPILED_HEADERS",
    "assert_on_device",
    "functorch_transforms_active",
    "global_state",
    "inductor_option_names",
    "inductor_threads",
    "inductor_default_cache_dir",
    "keep_precompiled_headers",
    "mark_size_static",
    "no_duck_sizing",
    "saved_tensor_hooks_active",
    "torch_function_mode_depth",
]


class GlobalState(Protocol):
    """A snapshot of the global state compiled code is guarded on (:func:`global_state`)."""

    def check(self) -> bool:
        """Whether the global state is still the one of the snapshot."""
        ...


def functorch_transforms_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...) runs this call: an autograd Function
    with a hand-derived backward and value-reading input checks must step aside there.  Torch offers no public
    query (``torch._C._are_functorch_transforms_active``)."""
    return bool(torch._C._are_functorch_transforms_active())


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``) are in force: the
    compiled kernels then run eagerly so each saved tensor goes through the hooks.  Torch offers no public query
    (``torch._C._autograd._top_saved_tensors_default_hooks``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def global_state() -> GlobalState:
    """A snapshot of the global state dynamo guards every compiled function on (grad mode, thread count, autocast,
    default dtype, deterministic algorithms; ``torch._C._dynamo.guards.GlobalStateGuard``), so a variant whose
    guards accepted a call is reused for calls of the same signature without evaluating its guards again.  Listing
    that state by hand would miss what a later torch adds to it."""
    return torch._C._dynamo.guards.GlobalStateGuard()


def torch_function_mode_depth() -> int:
    """The depth of the ``__torch_function__`` mode stack, which compiled code's guards also read
    (``torch._C._len_torch_function_stack``; no public query)."""
    return int(torch._C._len_torch_function_stack())


def inductor_option_names() -> set[str]:
    """The dotted names of every inductor option this torch has (``torch._inductor.config``): an option passed to
    ``torch.compile(options=...)`` that the installed torch lacks is an error, and the supported interface offers no
    list of them."""
    from torch._inductor import config

    return set(config.get_config_copy())


def inductor_threads() -> int:
    """The thread count inductor compiles a C++ kernel for: ``torch._inductor.config.cpp.threads`` where set, else
    ``torch.get_num_threads()``; 0 where inductor reads the count when the kernel runs
    (``TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1``).  Inductor writes the count into the kernel and does not guard on it:
    a kernel cache must key on it itself."""
    from torch._inductor import config

    if config.cpp.dynamic_threads:
        return 0
    return config.cpp.threads if config.cpp.threads >= 1 else torch.get_num_threads()


def mark_size_static(t: Tensor, dim: int) -> None:
    """Let the compiler take ``t.shape[dim]`` as a constant under ``dynamic=True`` (``torch._dynamo.mark_static``,
    the documented dynamic-shapes marker, kept in dynamo's namespace)."""
    torch._dynamo.mark_static(t, dim)


@contextlib.contextmanager
def no_duck_sizing() -> Iterator[None]:
    """Trace without duck sizing (``torch.fx.experimental._config.use_duck_shape``): sizes equal in the example
    arguments (tokens and width of a square layer) stay separate symbols, so the compiled function is not guarded
    on their equality.  No ``torch.compile`` argument sets it."""
    with torch.fx.experimental._config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
        yield


def assert_on_device(condition: Tensor, message: str) -> None:
    """Raise ``message`` where the boolean tensor ``condition`` is false, without the host reading it: on a GPU the
    device raises, asynchronously, so no synchronisation stalls the step or breaks CUDA-graph capture, and a traced
    graph keeps the check (``torch._assert_async``; ``torch._check`` reads the value)."""
    torch._assert_async(condition, message)


def inductor_default_cache_dir() -> str:
    """Inductor's cache folder where ``$TORCHINDUCTOR_CACHE_DIR`` is unset (in the temporary directory): where it keeps
    its precompiled headers whatever that variable says (``torch._inductor.runtime.cache_dir_utils``)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


PRECOMPILED_HEADERS = "precompiled_headers"  # inductor's folder of them in its default cache, and ours beside it


def keep_precompiled_headers(source: Path, target: Path, built_since: float | None = None) -> None:
    """Give ``target`` the precompiled headers of ``source`` it lacks (``NAME.h`` and ``NAME.h.gch``, the name a
    digest of the header's preprocessed text, the compiler and its flags), those built since ``built_since`` only
    where given: a hard link where both share a file system, else a copy, each made under a temporary name and
    renamed (another process sees a whole file or none).

    Inductor builds its precompiled header (seconds, 150 MiB) in its default cache (:func:`inductor_default_cache_dir`)
    whatever ``$TORCHINDUCTOR_CACHE_DIR`` says, in every process that loads a C++ kernel library and before it looks
    for the library; it builds none where the file is there.  Its build option (``cpp_cache_precompile_headers``) is
    not applied when a saved function loads, and its define is part of every library's key, so turning it off
    compiles every library again where ``/tmp`` is empty.  Kept beside the compiled kernels and copied back where the
    temporary directory is empty (a reboot, a cluster job's own ``/tmp``, a new container), a first step there loads
    as fast as anywhere.  Saved only what was built since ``built_since`` (by this process, or by another one it
    waited for): a header that an earlier process left in a shared ``/tmp`` may come from another build of torch."""
    try:
        names = [path.name for path in source.iterdir() if path.name.endswith((".h", ".h.gch"))]
    except OSError:  # no such folder yet
        return
    for name in names:
        destination, partial = target / name, target / f".{name}.{uuid.uuid4().hex}"
        try:
            if destination.exists() or (built_since is not None and (source / name).stat().st_mtime < built_since):
                continue
            target.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / name, partial)
            except OSError:  # another file system
                shutil.copy2(source / name, partial)
            os.replace(partial, destination)
        except OSError:  # a read-only or full disk, a file removed meanwhile: inductor builds the header itself
            partial.unlink(missing_ok=True)
