"""Compiling a model for training: ``--compile/--no-compile``, regional compilation, a compile cache per run.

On a GPU every eager operator is a kernel launch, so the training scripts compile the model there by default
(``torch.compile``): each repeated block - the classes transformers lists in the model's ``_no_split_modules``, the
encoder layers and the embeddings - is compiled in place (``nn.Module.compile``: the parameter names, checkpoints
and ``save_pretrained`` stay those of the plain model).  Regional compilation: the encoder layers share one
compiled graph (their parameters are its inputs), so compiling a 12-layer model costs one layer's compile, and a
changed batch size recompiles once, with dynamic shapes.  Polar-ViT's fused layers stay registered operators in the
graph (:mod:`polar_vit_hf.modeling.operators`).

On the CPU the default is eager: the fused layers' compiled CPU kernels already run the layers' elementwise work,
and ``--compile`` adds minutes of compile for little.

Inductor keeps what it compiled in its on-disk caches (``TORCHINDUCTOR_CACHE_DIR``); the run also saves the
compile's artifacts (``torch.compiler.save_cache_artifacts``) to ``compile_cache.bin`` in the output folder, which
a resumed run (another machine, another container) loads before its first step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CACHE_FILE = "compile_cache.bin"


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    """``--compile/--no-compile`` (default: compile on a GPU, not on the CPU)."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the model with torch.compile (default: on a GPU yes, on the CPU no)",
    )


def compile_wanted(flag: bool | None, device: torch.device) -> bool:
    """Whether to compile: the flag where given, else on a CUDA device."""
    return device.type == "cuda" if flag is None else bool(flag)


def compiled_regions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: its submodules of the classes in ``_no_split_modules`` (outermost only)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    regions: list[torch.nn.Module] = []
    for module in model.modules():
        if type(module).__name__ in names and not any(module in set(r.modules()) for r in regions):
            regions.append(module)
    return regions


def compile_regions(
    model: torch.nn.Module, output_dir: Path | None = None, log: Callable[[str], None] = print, **options: Any
) -> int:
    """Compile each of :func:`compiled_regions` in place (the whole model where it names none) with ``options``
    (``torch.compile``'s); load the run's compile cache from ``output_dir`` where one was saved.  Returns the number
    of regions compiled."""
    cache = None if output_dir is None else Path(output_dir) / CACHE_FILE
    if cache is not None and cache.exists():
        torch.compiler.load_cache_artifacts(cache.read_bytes())
        log(f"compile: loaded the compile cache {cache}")
    regions = compiled_regions(model) or [model]
    for region in regions:
        region.compile(**options)
    kinds = sorted({type(r).__name__ for r in regions})
    log(f"compile: {len(regions)} regions ({', '.join(kinds)}); the first step compiles them (minutes, once)")
    return len(regions)


class CompileProgress:
    """Reports how long the first step (the compile) took and saves the compile cache after it."""

    def __init__(self, output_dir: Path | None, log: Callable[[str], None] = print, save: bool = True) -> None:
        self.cache = None if output_dir is None else Path(output_dir) / CACHE_FILE
        self.log, self.save, self.started = log, save, time.perf_counter()
        self.done = False

    def step_done(self) -> None:
        """After a training step: the first time, log the compile time and save the cache artifacts."""
        if self.done:
            return
        self.done = True
        self.log(f"compile: first step done in {time.perf_counter() - self.started:.1f} s")
        artifacts = torch.compiler.save_cache_artifacts() if self.save and self.cache is not None else None
        if artifacts is not None:
            self.cache.write_bytes(artifacts[0])  # type: ignore[union-attr]
            self.log(f"compile: cache saved to {self.cache}")
