"""The effect of a change on every fused layer: this tree's model and a base revision's step in turns in one process.

Run:  python benchmarks/layer_ab.py --base REV [--preset tiny-cifar] [--batch 64] [--arithmetic polar|ambient]
          [--rounds 14] [--steps 3] [--threads N] [--out outputs/layer_ab]

``--base`` is a git revision of this repository (checked out into a temporary ``git worktree``) or a source tree
(a folder with ``modeling/``).  Its ``modeling/`` is imported as a second package beside ``polar_vit_hf.modeling``
(the model code has relative imports only, as it ships as remote code), so both models live in one process: the
base model takes this model's weights, then

* one training step of each on the same batch and random state: are the gradients of every parameter bit for bit
  the same, or how far apart;
* ``--rounds`` rounds, the two models in turns (the order alternating), each one untimed step then ``--steps``
  timed ones: the step's wall clock and that of every fused layer Function's forward and backward, in all and in
  its compiled kernels (``profile_step.timed_functions``);
* per row, this tree's time over the base's: the median of the per-round ratios, and their range.

Stepping in turns in one process takes out the machine's drift between processes and rounds, which
``step_time.py --base`` (one process per model) leaves at a few percent; the rows resolve a change to one layer
that is 1 % of a step.  The first step of each model compiles or loads its kernels (the kernel cache is keyed
by the source, so the base compiles its own once).  Writes ``layer_ab.csv`` and ``layer_ab.png`` (the per-round
ratios of each row) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

BASE_PACKAGE = "polar_vit_base_modeling"  # the name the base's ``modeling/`` is imported under
STEP = "whole step"


def import_modeling(folder: Path, name: str = BASE_PACKAGE) -> ModuleType:
    """Import the ``modeling/`` folder ``folder`` as the package ``name`` (its modules ``name.<module>``)."""
    from polar_vit_hf.benchmarks.step_time import register_package

    for loaded in [key for key in sys.modules if key == name or key.startswith(name + ".")]:
        del sys.modules[loaded]  # an earlier base's modules would answer the relative imports
    try:
        spec, module = register_package(name, folder)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None
    spec.loader.exec_module(module)
    return module


def twin(model: torch.nn.Module, package: ModuleType) -> torch.nn.Module:
    """``model``'s twin built by ``package``'s classes from the same configuration, with ``model``'s weights."""
    config = package.PolarViTConfig.from_dict(model.config.to_dict())
    built = getattr(package, type(model).__name__)(config)
    built.load_state_dict(model.state_dict())
    return built.train(model.training)


class Batch(NamedTuple):
    """One training batch and the random state both models' steps start from (stochastic depth draws)."""

    pixels: torch.Tensor
    labels: torch.Tensor
    seed: int


def step(model: torch.nn.Module, batch: Batch) -> None:
    """One forward + backward, the gradients cleared after."""
    model(pixel_values=batch.pixels, labels=batch.labels).loss.backward()
    model.zero_grad(set_to_none=True)


def gradient_gap(models: tuple[torch.nn.Module, torch.nn.Module], batch: Batch) -> tuple[float, str]:
    """``(largest relative difference, parameter)`` between the two models' gradients after one step each on
    ``batch`` from the same random state: ``(0.0, "")`` when every parameter's gradient is bit for bit the same.
    A parameter with a gradient on one side only counts as ``inf``."""
    grads = []
    for model in models:
        torch.manual_seed(batch.seed)
        model(pixel_values=batch.pixels, labels=batch.labels).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    worst, where = 0.0, ""
    for name in grads[0].keys() | grads[1].keys():
        a, b = grads[0].get(name), grads[1].get(name)
        if a is None or b is None:
            return float("inf"), name
        if torch.equal(a, b):
            continue
        gap = float((a - b).abs().max() / a.abs().max().clamp_min(torch.finfo(a.dtype).tiny))
        if gap > worst or not where:
            worst, where = gap, name
    return worst, where


class RoundTimes(NamedTuple):
    """One model's milliseconds per step in one round: the whole step and, per fused Function, its wall clock
    and the part of it in compiled kernels."""

    step: float
    wall: dict[str, float]
    kernels: dict[str, float]


def timed_round(model: torch.nn.Module, package: ModuleType | None, batch: Batch, steps: int) -> RoundTimes:
    """One untimed step, then the mean of ``steps`` timed ones (:func:`profile_step.timed_functions`)."""
    from polar_vit_hf.benchmarks.profile_step import timed_functions

    step(model, batch)
    totals: dict[str, list[float]] = {}
    with timed_functions(totals, package):
        start = time.perf_counter()
        for _ in range(steps):
            step(model, batch)
        seconds = time.perf_counter() - start
    per_step = 1e3 / steps
    return RoundTimes(
        seconds * per_step,
        {name: row[0] * per_step for name, row in totals.items()},
        {name: row[1] * per_step for name, row in totals.items()},
    )


class Row(NamedTuple):
    """One line of the table: medians over the rounds (ms per step) and this / base per round."""

    name: str
    base_ms: float
    ms: float
    ratios: list[float]
    base_kernel_ms: float
    kernel_ms: float
    kernel_ratios: list[float]


def row(name: str, wall: tuple[list[float], list[float]], kernels: tuple[list[float], list[float]]) -> Row:
    """A :class:`Row` from per-round milliseconds ``(base, this)`` of the wall clock and of the kernels."""

    def ratios(pair: tuple[list[float], list[float]]) -> list[float]:
        """Per round, where both trees ran the row (a Function only one of them has gets none)."""
        return [new / old for old, new in zip(*pair) if old > 0 and new > 0]

    return Row(
        name,
        statistics.median(wall[0]),
        statistics.median(wall[1]),
        ratios(wall),
        statistics.median(kernels[0]),
        statistics.median(kernels[1]),
        ratios(kernels),
    )


def rows(base: list[RoundTimes], this: list[RoundTimes]) -> list[Row]:
    """The whole step (its kernels: all compiled kernel calls), then every Function either model ran, the
    slowest first."""

    def per_round(pick: Callable[[RoundTimes], float]) -> tuple[list[float], list[float]]:
        return [pick(t) for t in base], [pick(t) for t in this]

    table = [row(STEP, per_round(lambda t: t.step), per_round(lambda t: sum(t.kernels.values())))]
    names = {name for times in (base, this) for t in times for name in t.wall}
    for name in names:
        wall = per_round(lambda t, name=name: t.wall.get(name, 0.0))
        table.append(row(name, wall, per_round(lambda t, name=name: t.kernels.get(name, 0.0))))
    return table[:1] + sorted(table[1:], key=lambda r: -max(r.base_ms, r.ms))


def span(ratios: list[float]) -> str:
    """``median (min-max)`` of per-round ratios, or ``-`` where one tree does not run the row."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def report(table: list[Row], gap: tuple[float, str], title: str) -> None:
    """The table as text, after the gradients' verdict."""
    worst, where = gap
    print(f"\n{title}")
    if worst == 0.0:
        print("gradients: bit for bit the same as the base's, every parameter")
    else:
        print(f"gradients: differ from the base's, largest relative difference {worst:.2e} ({where})")
    width = max(len(r.name) for r in table)
    head = f"{'ms per step':<{width}} {'base':>8} {'this':>8}  {'this / base (rounds)':<24}"
    print(f"{head} {'kernels':>8} {'this':>8}  this / base")
    for r in table:
        print(
            f"{r.name:<{width}} {r.base_ms:>8.1f} {r.ms:>8.1f}  {span(r.ratios):<24} "
            f"{r.base_kernel_ms:>8.1f} {r.kernel_ms:>8.1f}  {span(r.kernel_ratios)}"
        )


def write_csv(table: list[Row], path: Path) -> None:
    """The table, the ratios as their medians (empty where one tree does not run the row)."""
    median = lambda values: statistics.median(values) if values else ""  # noqa: E731
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["row", "base_ms", "ms", "ratio_median", "base_kernel_ms", "kernel_ms", "kernel_ratio_median"])
        for r in table:
            writer.writerow(
                [r.name, r.base_ms, r.ms, median(r.ratios), r.base_kernel_ms, r.kernel_ms, median(r.kernel_ratios)]
            )


def plot(table: list[Row], path: Path, title: str) -> None:
    """The per-round ratios of every row with a base time, as points, and their median, around 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in table if r.ratios][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(shown) + 1.5))
    for index, r in enumerate(shown):
        ax.scatter(r.ratios, [index] * len(r.ratios), s=12, alpha=0.5, color="tab:blue")
        ax.plot([statistics.median(r.ratios)], [index], marker="|", markersize=16, color="black")
    ax.set_yticks(range(len(shown)), [r.name for r in shown])
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_xlabel("this tree's time / the base's, per round")
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a git revision, or a source tree (a folder with modeling/)")
    parser.add_argument("--preset", default="tiny-cifar")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--arithmetic", choices=("polar", "ambient"), default="polar")
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model and round")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("outputs/layer_ab"))
    return parser


def run(args: argparse.Namespace, package: ModuleType) -> int:
    """Build both models, compare their gradients, time them in turns, print and write the table."""
    from tqdm.auto import tqdm

    import polar_vit_hf as P

    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset(args.preset, num_labels=100)
    config.arithmetic = args.arithmetic
    model = P.PolarViTForImageClassification(config).train()
    base = twin(model, package)
    size, channels = config.image_size, config.num_channels
    batch = Batch(torch.randn(args.batch, channels, size, size), torch.randint(0, 100, (args.batch,)), seed=0)
    print("first step of each model (compiles or loads its kernels) ...", flush=True)
    gap = gradient_gap((base, model), batch)
    times: dict[str, list[RoundTimes]] = {"base": [], "this": []}
    sides = [("base", base, package), ("this", model, None)]
    for index in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for name, stepped, source in sides if index % 2 == 0 else sides[::-1]:
            times[name].append(timed_round(stepped, source, batch, args.steps))
    table = rows(times["base"], times["this"])
    title = (
        f"Polar-ViT {args.arithmetic}, {args.preset}, batch {args.batch}, {args.threads} threads "
        f"({torch.backends.cpu.get_cpu_capability()}): this tree over the base {args.base}, "
        f"medians of {args.rounds} rounds of {args.steps} steps"
    )
    report(table, gap, title)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(table, args.out / "layer_ab.csv")
    plot(table, args.out / "layer_ab.png", title)
    print(f"wrote {args.out / 'layer_ab.csv'} and {args.out / 'layer_ab.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from polar_vit_hf.benchmarks.step_time import source_tree

    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        try:
            tree = stack.enter_context(source_tree(args.base))
            package = import_modeling(tree / "modeling")
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
        return run(args, package)


if __name__ == "__main__":
    raise SystemExit(main())
