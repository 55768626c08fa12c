"""The fused attention's group size (``attention_group_elements``) at several sequence lengths, side by side.

Run:  python benchmarks/attention_groups.py [--preset tiny-cifar] [--arithmetic polar|ambient]
          [--shapes 32x64 56x16 64x8] [--exponents 19 20 21] [--rounds 8] [--threads N]
          [--out outputs/attention_groups]

Each shape ``IMAGExBATCH`` is one model (the preset at that image size: ``(IMAGE / patch)^2`` tokens) in this
process; its training step runs with each group size ``2^e`` in turns (the order alternating between rounds), one
untimed step per setting first.  The group size decides how the fused core cuts the ``(batch, head)`` slices into
blocks (:func:`fused_attention._blocks`): groups of whole samples, else of one sample's heads, else of one head's
query rows; the kernels are the same variants at every size (only the number of slices changes).  Prints, per
shape, each setting's median step and the median of its per-round ratios to the first setting, and writes
``attention_groups.csv`` and ``attention_groups.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch


class Shape(NamedTuple):
    """A model's image size and batch."""

    image: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``"56x16"`` -> ``Shape(56, 16)``."""
        image, batch = text.split("x")
        return cls(int(image), int(batch))


class Row(NamedTuple):
    """One setting's result at one shape."""

    shape: Shape
    tokens: int
    exponent: int
    step_ms: float
    ratio: float
    low: float
    high: float


def measure(shape: Shape, exponents: list[int], rounds: int, preset: str, arithmetic: str) -> list[Row]:
    """The step of ``preset`` (in ``arithmetic``) at ``shape`` with each group size ``2^e`` in turns; one
    :class:`Row` per setting."""
    from tqdm.auto import tqdm

    import polar_vit_hf as P
    from polar_vit_hf.modeling.runtime import use_runtime_options

    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset(preset, num_labels=100)
    config.image_size = shape.image
    config.arithmetic = arithmetic
    model = P.PolarViTForImageClassification(config).train()
    P.geometry.set_input_checks(False)  # as a training loop: inputs validated once
    pixels = torch.randn(shape.batch, config.num_channels, shape.image, shape.image)
    labels = torch.randint(0, 100, (shape.batch,))

    def step(exponent: int) -> float:
        with use_runtime_options(attention_group_elements=1 << exponent):
            start = time.perf_counter()
            model(pixel_values=pixels, labels=labels).loss.backward()
            model.zero_grad(set_to_none=True)
            return time.perf_counter() - start

    for exponent in exponents:  # loads (or compiles) the kernels; every buffer allocated once
        step(exponent)
    times: dict[int, list[float]] = {e: [] for e in exponents}
    for index in tqdm(range(rounds), desc=f"{shape.image} px, batch {shape.batch}", unit="round"):
        for exponent in exponents if index % 2 == 0 else exponents[::-1]:
            step(exponent)  # untimed: the other settings' steps left the caches cold
            times[exponent].append(step(exponent))
    tokens = (shape.image // config.patch_size) ** 2
    first = times[exponents[0]]
    rows = []
    for exponent in exponents:
        ratios = [t / f for t, f in zip(times[exponent], first)]
        median_ms = 1e3 * statistics.median(times[exponent])
        rows.append(Row(shape, tokens, exponent, median_ms, statistics.median(ratios), min(ratios), max(ratios)))
    return rows


def plot(rows: list[Row], path: Path) -> None:
    """Each setting's median ratio to the first, grouped by shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(row.shape for row in rows))
    exponents = list(dict.fromkeys(row.exponent for row in rows))
    width = 0.8 / len(exponents)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for slot, exponent in enumerate(exponents):
        mine = [next(r for r in rows if r.shape == s and r.exponent == exponent) for s in shapes]
        xs = [i + slot * width for i in range(len(shapes))]
        errors = [[r.ratio - r.low for r in mine], [r.high - r.ratio for r in mine]]
        ax.bar(xs, [r.ratio for r in mine], width, yerr=errors, capsize=3, label=f"$2^{{{exponent}}}$")
    ax.set_xticks([i + width * (len(exponents) - 1) / 2 for i in range(len(shapes))])
    ax.set_xticklabels([f"{r.tokens} tokens\nbatch {r.shape.batch}" for r in rows if r.exponent == exponents[0]])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(min(0.8, min(r.low for r in rows) - 0.02), max(1.2, max(r.high for r in rows) + 0.02))
    ax.set_ylabel(f"step time / $2^{{{exponents[0]}}}$'s")
    ax.set_title("fused attention: score elements per group")
    ax.legend(title="group")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-cifar")
    parser.add_argument("--arithmetic", choices=("polar", "ambient"), default="polar")
    parser.add_argument("--shapes", nargs="+", type=Shape.parse, default=[Shape(32, 64), Shape(56, 16), Shape(64, 8)])
    parser.add_argument("--exponents", nargs="+", type=int, default=[19, 20, 21])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("outputs/attention_groups"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        row
        for shape in args.shapes
        for row in measure(shape, args.exponents, args.rounds, args.preset, args.arithmetic)
    ]
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"\n{args.preset}, {args.arithmetic}, training step, {args.threads} threads ({capability}), "
        f"medians of {args.rounds} rounds"
    )
    print(f"{'tokens':>7} {'batch':>6} {'group':>6} {'ms / step':>10} {'x first':>8}  rounds")
    for row in rows:
        print(
            f"{row.tokens:>7} {row.shape.batch:>6} {'2^' + str(row.exponent):>6} {row.step_ms:>10.0f} "
            f"{row.ratio:>7.3f}x  {row.low:.2f}-{row.high:.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "attention_groups.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["image", "batch", "tokens", "exponent", "step_ms", "ratio", "low", "high"])
        for row in rows:
            writer.writerow([row.shape.image, row.shape.batch, row.tokens, *row[2:]])
    plot(rows, args.out / "attention_groups.png")
    print(f"wrote {args.out / 'attention_groups.csv'} and {args.out / 'attention_groups.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
