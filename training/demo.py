"""The CPU demo (``make demo``): Polar-ViT and the same-size Euclidean ViT on scikit-learn's digits.

Trains both with ``training/pretrain.py`` (:func:`run_digits`) and the ``digits-demo`` recipe (200 steps, progress
bars), prints their held-out accuracies side by side, writes ``outputs/demo/curves.png`` with both
training curves, and classifies a few held-out digits with ``pipeline("image-classification")``
from the exported Polar-ViT folder ``outputs/demo/polar/model``.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import time
from pathlib import Path

from polar_vit_hf.cli import add_debug_flag, command
from polar_vit_hf.training import pretrain


def read_metrics(folder: Path) -> list[dict]:
    with open(folder / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, rows), color in zip(runs.items(), ("tab:blue", "tab:gray")):
        steps = [int(r["step"]) for r in rows]
        ax.plot(steps, [float(r["loss"]) for r in rows], color=color, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("digits demo: same recipe, same size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_digits(arch: str, output_dir: Path, max_steps: int = 200, extra: list[str] | None = None) -> list[dict]:
    """Train ``arch`` (``polar`` / ``euclidean``) on the digits with the ``digits-demo`` recipe of
    ``training/pretrain.py``; returns the rows of its ``metrics.csv`` (the last holds the held-out accuracy)."""
    code = pretrain.main(
        [
            "--recipe",
            "digits-demo",
            "--arch",
            arch,
            "--output_dir",
            str(output_dir),
            "--max_steps",
            str(max_steps),
            "--eval_steps",
            str(max_steps),
            *(extra or []),
        ]
    )
    if code:
        raise RuntimeError(f"pretraining {arch} on the digits failed (exit status {code})")
    return read_metrics(output_dir)


@command("polar-vit-demo")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_debug_flag(parser)
    parser.add_argument("--output_dir", default="outputs/demo")
    parser.add_argument("--max_steps", type=int, default=200)
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    seconds, runs = {}, {}
    for arch, name in (("polar", "Polar-ViT (demo)"), ("euclidean", "Euclidean ViT (same size)")):
        start = time.perf_counter()
        runs[name] = run_digits(arch, out / arch, args.max_steps)
        seconds[arch] = time.perf_counter() - start
    print(f"\nscikit-learn digits, 32 x 32, {args.max_steps} steps, batch 32, the digits-demo recipe")
    print(f"{'model':<28} {'held-out accuracy':>18} {'train time':>11}")
    for (name, rows), arch in zip(runs.items(), ("polar", "euclidean")):
        print(f"{name:<28} {100 * float(rows[-1]['eval_accuracy']):>17.2f}% {seconds[arch]:>9.1f} s")
    plot(runs, out / "curves.png")
    print(f"training curves: {out / 'curves.png'}")

    from PIL import Image
    from transformers import pipeline

    import polar_vit_hf  # noqa: F401 - registers the Auto classes
    from polar_vit_hf.training.data import digits_images, digits_split_indices

    # trust_remote_code=False: the package is installed, so its registered classes are used (and
    # transformers' probe for a video processor does not ask about the folder's remote code)
    classify = pipeline("image-classification", model=str(out / "polar" / "model"), trust_remote_code=False)
    images, labels = digits_images(32)
    _, held_out = digits_split_indices(len(labels))
    print("pipeline('image-classification') on held-out digits (exported Polar-ViT folder, 96 x 96 inputs):")
    for index in held_out[:6]:
        top = classify(Image.fromarray(images[index]).resize((96, 96)), top_k=1)[0]
        print(f"  digit {labels[index]} -> predicted {top['label']} (score {top['score']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
