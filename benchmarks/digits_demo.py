"""Polar-ViT ``demo`` vs the same-size Euclidean ViT on scikit-learn's digits, each at its own tuned learning rate.

Run:  python benchmarks/digits_demo.py [--steps 200] [--seeds 0 1 2] [--lrs 1e-3 3e-3 1e-2 3e-2]

Both models (``PolarViTForImageClassification`` with the ``demo`` preset and transformers'
``ViTForImageClassification`` with the same image/patch size, depth, width, MLP width and heads)
are trained by the loop behind ``make demo`` (``training/pretrain.py`` with the ``digits-demo``
recipe: batch 32, AdamW, weight decay 0.05, 10 warm-up steps, cosine decay).  The same rule tunes
both (the rule of ``benchmarks/fashion_accuracy.py``): one run per learning rate of ``--lrs`` trained on
``fit`` (80 % of the training digits) and scored on ``validation`` (the other 20 %), the held-out test
digits never looked at; then each model at its best learning rate, trained on all training digits once
per seed.  Prints the sweep and held-out accuracy (mean +- std over seeds); writes ``digits_demo.png``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import polar_vit_hf as P
from polar_vit_hf.baselines import euclidean_vit
from polar_vit_hf.training.demo import run_digits

TUNING = ["--set", "data.train_split=fit", "--set", "data.eval_split=validation"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[1e-3, 3e-3, 1e-2, 3e-2],
        help="learning rates swept for every model (on fit / validation, seed 0)",
    )
    parser.add_argument("--out", default="outputs/digits_demo")
    args = parser.parse_args(argv)
    archs = {"Polar-ViT (demo)": "polar", "Euclidean ViT (same size)": "euclidean"}
    sweep = sweep_learning_rates(archs, args.lrs, args.steps)
    best = {name: max(scores, key=scores.get) for name, scores in sweep.items()}
    runs = {name: (arch, ["--lr", str(best[name])]) for name, arch in archs.items()}
    results = train_runs(runs, args.seeds, args.steps)
    config = P.PolarViTConfig.from_preset("demo", id2label={i: str(i) for i in range(10)})
    params = {
        "polar": sum(p.numel() for p in P.PolarViTForImageClassification(config).parameters()),
        "euclidean": sum(p.numel() for p in euclidean_vit(config).parameters()),
    }
    print(f"\nlearning-rate sweep ({args.steps} steps on fit, accuracy on validation; seed 0)")
    print(f"{'model':<28}" + "".join(f"{'lr ' + format(lr, 'g'):>11}" for lr in args.lrs))
    for name, scores in sweep.items():
        print(f"{name:<28}" + "".join(f"{100 * scores[lr]:>10.2f}%" for lr in args.lrs))
    print(
        f"\nDigits (1348 train / 449 held-out, 32 x 32), {args.steps} steps, each model at its best lr, "
        f"seeds {args.seeds}"
    )
    print_table(
        {f"{name}, lr {best[name]:g}": result for name, result in results.items()},
        {f"{name}, lr {best[name]:g}": params[arch] for name, arch in archs.items()},
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "digits_demo.png", "digits: Polar-ViT vs Euclidean ViT of the same size, both tuned")
    print(f"wrote {out / 'digits_demo.png'}")
    return 0


def sweep_learning_rates(archs: dict[str, str], lrs: list[float], steps: int) -> dict[str, dict[float, float]]:
    """Validation accuracy of every ``name: arch`` at every learning rate (trained on ``fit``, seed 0)."""
    with tempfile.TemporaryDirectory() as scratch:
        return {
            name: {
                lr: float(
                    run_digits(
                        arch, Path(scratch) / f"{arch}-{lr}", steps, ["--lr", str(lr), "--no_progress", *TUNING]
                    )[-1]["eval_accuracy"]
                )
                for lr in lrs
            }
            for name, arch in archs.items()
        }


def train_runs(runs: dict[str, tuple[str, list[str]]], seeds: list[int], steps: int) -> dict[str, dict]:
    """Train every ``name: (arch, extra pretrain.py arguments)`` once per seed; losses, accuracies, seconds."""
    results = {name: {"acc": [], "losses": [], "seconds": []} for name in runs}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in seeds:
            for index, (name, (arch, extra)) in enumerate(runs.items()):
                start = time.perf_counter()
                rows = run_digits(arch, Path(scratch) / f"{seed}-{index}", steps, ["--seed", str(seed), *extra])
                results[name]["seconds"].append(time.perf_counter() - start)
                results[name]["losses"].append([float(row["loss"]) for row in rows])
                results[name]["acc"].append(float(rows[-1]["eval_accuracy"]))
    return results


def print_table(results: dict[str, dict], params: dict[str, int]) -> None:
    """One row per run: parameters, held-out accuracy (mean +- population std over seeds), train time."""
    width = max(28, *(len(name) + 1 for name in results))
    print(f"{'model':<{width}} {'params':>8} {'held-out accuracy':>24} {'train time':>11}")
    for name, result in results.items():
        print(
            f"{name:<{width}} {params[name]:>8,} {accuracy_summary(result['acc'], sample=False):>24}"
            f" {statistics.mean(result['seconds']):>9.1f} s"
        )


def accuracy_summary(values: list[float], sample: bool = True) -> str:
    """``"mean +- std %"`` of accuracies in [0, 1]: sample (or population) standard deviation over seeds."""
    spread = (statistics.stdev if sample else statistics.pstdev)(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} +- {100 * spread:.2f} %"


def plot(results: dict, path: Path, title: str) -> None:
    """Training-loss curves of every run and seed (one colour per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, result), color in zip(results.items(), plt.get_cmap("tab10").colors):
        for index, losses in enumerate(result["losses"]):
            ax.plot(range(1, len(losses) + 1), losses, color=color, alpha=0.8, label=name if index == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (logged steps)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
