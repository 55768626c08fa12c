"""Polar-ViT vs transformers' ViT of the same shape on Fashion-MNIST, each at its own tuned learning rate.

Run:  python benchmarks/fashion_accuracy.py [--data_dir DIR] [--quick] [--steps 900] [--seeds 0 1 2]

Protocol (the ``fashion-mnist`` recipe: ``fashion-cpu`` preset, 28 x 28, batch 128, AdamW, warm-up and
cosine decay, horizontal flips; the same steps, batch, augmentation and seeds for every model):

1. learning-rate sweep per model (``--lrs``, ``--sweep-steps``): trained on ``fit`` (54,000 images of
   the training set), scored on ``validation`` (the other 6,000); the test set is never looked at;
2. each model at its best learning rate, trained on the full training set (60,000) once per seed and
   scored on the official 10,000 test images: mean +- std over seeds;
3. the paper's ablation row: Polar-ViT with ``relative_position=none`` (no horoshift) at Polar-ViT's
   learning rate.

Prints the sweep and the result table; writes ``fashion_mnist.csv``, ``curves.png`` (training loss of
every run) and ``confusion.png`` (test confusion matrices of the first seed) to ``--out``.
``--quick`` (about 10 minutes on 2 cores) runs the same protocol with short runs.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

from polar_vit_hf.benchmarks.digits_demo import accuracy_summary

MODELS = {  # name: (arch, extra pretrain.py arguments)
    "Euclidean ViT (same shape)": ("euclidean", []),
    "Polar-ViT": ("polar", []),
    "Polar-ViT, no horoshift": ("polar", ["--set", "model.relative_position=none"]),
}
TUNED = {
    "Euclidean ViT (same shape)": "Euclidean ViT (same shape)",
    "Polar-ViT": "Polar-ViT",
    "Polar-ViT, no horoshift": "Polar-ViT",
}  # whose learning rate each row uses


def train(
    arch: str, out: Path, steps: int, lr: float, seed: int, extra: list[str], data_dir: str | None, tuning: bool
) -> list[dict]:
    """One ``training/pretrain.py`` run with the ``fashion-mnist`` recipe; its ``metrics.csv`` rows."""
    from polar_vit_hf.training import pretrain
    from polar_vit_hf.training.demo import read_metrics

    args = [
        "--recipe",
        "fashion-mnist",
        "--arch",
        arch,
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--eval_steps",
        str(steps),
        "--save_steps",
        str(steps),
        "--lr",
        str(lr),
        "--seed",
        str(seed),
        "--set",
        f"optim.warmup_steps={max(1, steps // 20)}",
        "--no_progress",
        *extra,
    ]
    if data_dir:
        args += ["--data_dir", data_dir]
    if tuning:
        args += ["--set", "data.train_split=fit", "--set", "data.eval_split=validation"]
    code = pretrain.main(args)
    if code:
        raise SystemExit(f"pretraining {arch} failed (exit status {code})")
    return read_metrics(out)


def confusion(model_dir: Path, data_dir: str | None) -> list[list[int]]:
    """Test-set confusion matrix (rows: true class) of a saved model."""
    import torch

    from polar_vit_hf.training.data import build_data

    model = __import__("transformers").AutoModelForImageClassification.from_pretrained(model_dir).eval()
    test = build_data("fashion_mnist", 28, {}, data_dir).eval
    loader = torch.utils.data.DataLoader(test, batch_size=500)
    matrix = [[0] * 10 for _ in range(10)]
    with torch.no_grad():
        for pixels, labels in loader:
            for truth, guess in zip(labels.tolist(), model(pixel_values=pixels).logits.argmax(-1).tolist()):
                matrix[truth][guess] += 1
    return matrix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", help="the four IDX files (default: Debian's location or the package cache)")
    parser.add_argument("--quick", action="store_true", help="short runs (about 10 minutes on 2 cores)")
    parser.add_argument("--steps", type=int, help="steps of every final run (default 900; --quick 80)")
    parser.add_argument("--sweep-steps", type=int, help="steps of every sweep run (default 200; --quick 30)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="outputs/fashion_mnist")
    args = parser.parse_args(argv)
    steps = args.steps or (80 if args.quick else 900)
    sweep_steps = args.sweep_steps or (30 if args.quick else 200)
    import polar_vit_hf as P  # noqa: F401  (registers the model with the Auto classes)
    from polar_vit_hf.training import fashion_mnist

    fashion_mnist.load_fashion_mnist(args.data_dir)  # a missing data set fails here, before any training
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweep: dict[str, dict[float, float]] = {}
    results: dict[str, dict] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("Euclidean ViT (same shape)", "Polar-ViT"):
            arch, extra = MODELS[name]
            sweep[name] = {
                lr: float(
                    train(
                        arch,
                        Path(scratch) / f"sweep-{arch}-{lr}",
                        sweep_steps,
                        lr,
                        0,
                        extra,
                        args.data_dir,
                        tuning=True,
                    )[-1]["eval_accuracy"]
                )
                for lr in args.lrs
            }
        best = {name: max(scores, key=scores.get) for name, scores in sweep.items()}
        for name, (arch, extra) in MODELS.items():
            lr = best[TUNED[name]]
            results[name] = {"lr": lr, "acc": [], "losses": [], "seconds": []}
            for seed in args.seeds:
                run_dir = Path(scratch) / f"{name}-{seed}".replace(" ", "_").replace(",", "")
                began = time.perf_counter()
                rows = train(arch, run_dir, steps, lr, seed, extra, args.data_dir, tuning=False)
                results[name]["seconds"].append(time.perf_counter() - began)
                results[name]["acc"].append(float(rows[-1]["eval_accuracy"]))
                results[name]["losses"].append([float(row["loss"]) for row in rows])
                if seed == args.seeds[0]:
                    results[name]["confusion"] = confusion(run_dir / "model", args.data_dir)

    print(
        f"\nFashion-MNIST, learning-rate sweep ({sweep_steps} steps on 54,000 images, validation accuracy "
        f"on the other 6,000 of the training set):"
    )
    print(f"{'model':<28}" + "".join(f"{'lr ' + format(lr, 'g'):>12}" for lr in args.lrs))
    for name, scores in sweep.items():
        print(f"{name:<28}" + "".join(f"{100 * scores[lr]:>11.2f}%" for lr in args.lrs))
    print(f"\nFashion-MNIST test accuracy (10,000 images), {steps} steps on 60,000, batch 128, seeds {args.seeds}:")
    print(f"{'model':<28} {'lr':>7} {'test accuracy':>20} {'train time':>11}")
    for name, result in results.items():
        print(
            f"{name:<28} {result['lr']:>7g} {accuracy_summary(result['acc']):>20} "
            f"{statistics.mean(result['seconds']):>9.0f} s"
        )
    print(f"total {time.perf_counter() - start:.0f} s")
    with open(out / "fashion_mnist.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "lr", "seed", "test_accuracy", "seconds"])
        for name, result in results.items():
            for seed, acc, seconds in zip(args.seeds, result["acc"], result["seconds"]):
                writer.writerow([name, result["lr"], seed, acc, seconds])
    plot(results, out)
    print(f"wrote {out / 'fashion_mnist.csv'}, {out / 'curves.png'} and {out / 'confusion.png'}")
    return 0


def plot(results: dict, out: Path) -> None:
    """Training-loss curves of every run; the test confusion matrix of each model's first seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from polar_vit_hf.training.fashion_mnist import CLASS_NAMES

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, result), color in zip(results.items(), plt.get_cmap("tab10").colors):
        for index, losses in enumerate(result["losses"]):
            ax.plot(range(1, len(losses) + 1), losses, color=color, alpha=0.7, label=name if index == 0 else None)
    ax.set(xlabel="optimizer step", ylabel="training loss", yscale="log", title="Fashion-MNIST training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.6))
    for ax, (name, result) in zip(np.atleast_1d(axes), results.items()):
        matrix = np.asarray(result["confusion"], dtype=float)
        ax.imshow(matrix / matrix.sum(1, keepdims=True), cmap="Blues", vmin=0, vmax=1)
        ax.set_xticks(range(10), CLASS_NAMES, rotation=90, fontsize=7)
        ax.set_yticks(range(10), CLASS_NAMES, fontsize=7)
        ax.set(title=f"{name}\n{100 * np.trace(matrix) / matrix.sum():.1f} % (seed 0)", xlabel="predicted")
    fig.tight_layout()
    fig.savefig(out / "confusion.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
