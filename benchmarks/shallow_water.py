"""Shallow-water next-step prediction on the icosphere: SO3ViT, Polar-ViT with SO(3)-RoPE and a ViT with learned
absolute positions, trained side by side with the same data, budget and seeds (SO(3)-RoPE Sec. 4, Appendix B).

Run:  python benchmarks/shallow_water.py [--steps 600] [--seeds 0 1 2] [--quick]

Every (model, seed) trains in a fresh process with ``training/shallow_water.py`` (same simulations, same steps,
batch and learning rate), then, in that process: the l1 / l2 errors on the held-out simulations (normalised
fields), the mean absolute error per vertex (the paper's Figure 3 view), an autoregressive rollout of
``--rollout`` steps on held-out trajectories, the inference time of a batch (median of ``--repeats`` calls), the
peak of the bytes of tensors allocated in one training step (the CPU counterpart of CUDA's ``max_memory_allocated``)
and the reload check (``from_pretrained`` of the saved folder predicts the same fields).  Prints the table (mean
+- std over seeds) and the CPU; writes ``shallow_water.csv``, ``error_maps.png`` and ``rollout.png`` to ``--out``.
``--quick``: 20 steps, one seed.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MODELS = {
    "so3vit": "SO3ViT (Euclidean, SO(3)-RoPE)",
    "polar": "Polar-ViT, SO(3)-RoPE",
    "vit": "ViT, learned absolute positions",
}


def worker_args(args: argparse.Namespace, model: str, seed: int, folder: Path) -> list[str]:
    """The training command line of one run."""
    return [
        *("--model", model, "--output_dir", str(folder), "--seed", str(seed), "--max_steps", str(args.steps)),
        *("--icosphere_level", str(args.level), "--patch_level", str(args.patch_level)),
        *("--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads)),
        *("--num_train", str(args.num_train), "--num_eval", str(args.num_eval)),
        *("--batch_size", str(args.batch), "--learning_rate", str(args.lr)),
        *("--longitude_encoding", str(args.longitude_encoding if model != "vit" else 0)),
        *("--save_steps", str(args.steps), "--no_progress"),
    ]


def measure(folder: Path, train_argv: list[str], rollout: int, repeats: int) -> dict:
    """Train one run (in this process), then every measurement of the table; returns them as a dict."""
    from polar_vit_hf.benchmarks._memory import peak_tensor_growth
    from polar_vit_hf.modeling.spherical import sphere_errors
    from polar_vit_hf.training import shallow_water as sw

    args = sw.parse_args(train_argv)
    done = sw.run(args)
    model, x, y = done.model.eval(), done.held_out.inputs, done.held_out.targets
    with torch.no_grad():
        predicted = model(pixel_values=x).logits
        reload_error = float((reloaded(args.model, folder).eval()(pixel_values=x).logits - predicted).abs().max())
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(pixel_values=x[: args.batch_size])
            times.append(time.perf_counter() - start)
    model.train()
    with peak_tensor_growth() as memory:
        model(pixel_values=x[: args.batch_size], labels=y[: args.batch_size]).loss.backward()
    simulation = sw.Simulation(icosphere_level=args.icosphere_level, dt=args.dt)
    runs = done.normalization(sw.trajectories(simulation, 8, 10_000 + args.data_seed, rollout, progress=False))
    state, rollout_l2 = runs[:, 0], []
    model.eval()
    with torch.no_grad():
        for step in range(1, rollout + 1):
            state = model(pixel_values=state).logits
            rollout_l2.append(float(sphere_errors(state, runs[:, step], args.icosphere_level)[1]))
    metrics = done.metrics
    return {
        "l1": metrics["eval_l1"],
        "l2": metrics["eval_l2"],
        "params": sum(p.numel() for p in model.parameters()),
        "inference_ms": 1e3 * statistics.median(times),
        "train_step_mib": memory.mib,
        "reload_error": reload_error,
        "vertex_mae": (predicted - y).abs().mean((0, 1)).tolist(),
        "rollout_l2": rollout_l2,
        "persistence_l2": float(sphere_errors(x, y, args.icosphere_level)[1]),
    }


def reloaded(model: str, folder: Path) -> torch.nn.Module:
    """The saved folder loaded as a user would: the Auto class (Polar-ViT) or the baseline's ``from_pretrained``."""
    if model == "polar":
        from transformers import AutoModelForImageToImage

        import polar_vit_hf  # noqa: F401 - registers the Auto classes

        return AutoModelForImageToImage.from_pretrained(folder)
    from polar_vit_hf.baselines import SphericalViTForDensePrediction

    return SphericalViTForDensePrediction.from_pretrained(folder)


def run_one(args: argparse.Namespace, model: str, seed: int) -> dict:
    """One (model, seed) in a fresh process; its measurements."""
    folder = Path(args.out) / "runs" / f"{model}-seed{seed}"
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    command = [sys.executable, __file__, "--worker", str(folder), "--rollout", str(args.rollout)]
    command += ["--repeats", str(args.repeats), "--", *worker_args(args, model, seed, folder)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{model}, seed {seed} failed:\n{done.stderr[-4000:]}")
    return json.loads((folder / "benchmark.json").read_text())


def summary(values: list[float], digits: int = 4) -> str:
    """``mean +- std`` (sample standard deviation; the value alone for one run)."""
    mean = statistics.mean(values)
    return f"{mean:.{digits}f}" if len(values) < 2 else f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def print_table(results: dict[str, list[dict]], args: argparse.Namespace, seeds: list[int]) -> None:
    print(
        f"\nShallow water, next step (dt = 1 h), icosphere level {args.level} ({10 * 4**args.level + 2} vertices, "
        f"{60 * 4**args.patch_level} tokens), {args.layers} layers, width {args.width}, {args.heads} heads; "
        f"{args.num_train} training / {args.num_eval} held-out simulations, {args.steps} steps of batch {args.batch}, "
        f"lr {args.lr:g}, seeds {seeds}"
    )
    print(f"CPU: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")
    header = f"{'model':<34} {'params':>9} {'l1':>17} {'l2':>17} {'infer ms':>9} {'step MiB':>9} {'reload':>8}"
    print(header)
    for name, runs in results.items():
        print(
            f"{MODELS[name]:<34} {runs[0]['params']:>9,} {summary([r['l1'] for r in runs]):>17} "
            f"{summary([r['l2'] for r in runs]):>17} {statistics.median(r['inference_ms'] for r in runs):>9.1f} "
            f"{statistics.median(r['train_step_mib'] for r in runs):>9.0f} "
            f"{max(r['reload_error'] for r in runs):>8.0e}"
        )
    persistence = next(iter(results.values()))[0]["persistence_l2"]
    print(f"{'persistence (target = input)':<34} {'':>9} {'':>17} {persistence:>17.4f}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def write_csv(results: dict[str, list[dict]], seeds: list[int], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "seed", "params", "l1", "l2", "inference_ms", "train_step_mib", "reload_error"])
        for name, runs in results.items():
            for seed, r in zip(seeds, runs):
                row = [r["params"], r["l1"], r["l2"], r["inference_ms"], r["train_step_mib"], r["reload_error"]]
                writer.writerow([name, seed, *row])


def plot_error_maps(results: dict[str, list[dict]], level: int, path: Path) -> None:
    """Mean absolute error per vertex (held-out simulations, seeds averaged), Mollweide projection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from polar_vit_hf.modeling.spherical import icosphere

    x, y, z = icosphere(level).unbind(-1)
    longitude, latitude = torch.atan2(y, x), torch.asin(z)
    maps = {name: torch.tensor([r["vertex_mae"] for r in runs]).mean(0) for name, runs in results.items()}
    top = max(float(m.max()) for m in maps.values())
    fig = plt.figure(figsize=(4.2 * len(maps) + 1, 2.9))
    for index, (name, values) in enumerate(maps.items()):
        axis = fig.add_subplot(1, len(maps), index + 1, projection="mollweide")
        points = axis.scatter(longitude, latitude, c=values, s=22, cmap="viridis", vmin=0, vmax=top)
        axis.set_title(f"{MODELS[name]}\nmean {float(values.mean()):.3f}", fontsize=9)
        axis.set_xticklabels([])
        axis.set_yticklabels([])
    fig.colorbar(points, ax=fig.axes, shrink=0.8, pad=0.02, label="mean absolute error (normalised)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_rollout(results: dict[str, list[dict]], path: Path) -> None:
    """l2 error of autoregressive predictions against the solver, per step (seeds: thin lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    for (name, runs), color in zip(results.items(), plt.get_cmap("tab10").colors):
        for index, run in enumerate(runs):
            steps = range(1, len(run["rollout_l2"]) + 1)
            axis.plot(steps, run["rollout_l2"], color=color, alpha=0.7, label=MODELS[name] if index == 0 else None)
    axis.set(xlabel="autoregressive step (hours)", ylabel="l2 error (normalised)", yscale="log")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 600; --quick 20)")
    parser.add_argument("--level", type=int, default=2, help="icosphere level of the fields")
    parser.add_argument("--patch_level", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--num_train", type=int, default=512)
    parser.add_argument("--num_eval", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--longitude_encoding", type=int, default=4, help="for the SO(3)-RoPE models (0: none)")
    parser.add_argument("--rollout", type=int, default=4, help="autoregressive steps of the rollout plot")
    parser.add_argument("--repeats", type=int, default=10, help="timed inference calls per run")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="outputs/shallow-water")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("train_argv", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (20 if args.quick else 600)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # one run, in its own process
        folder = Path(args.worker)
        result = measure(folder, args.train_argv, args.rollout, args.repeats)
        (folder / "benchmark.json").write_text(json.dumps(result))
        return 0
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    from tqdm.auto import tqdm

    jobs = [(model, seed) for model in args.models for seed in seeds]
    results: dict[str, list[dict]] = {model: [] for model in args.models}
    for model, seed in tqdm(jobs, desc="runs"):
        results[model].append(run_one(args, model, seed))
    print_table(results, args, seeds)
    out = Path(args.out)
    write_csv(results, seeds, out / "shallow_water.csv")
    plot_error_maps(results, args.level, out / "error_maps.png")
    plot_rollout(results, out / "rollout.png")
    print(f"wrote {out / 'shallow_water.csv'}, {out / 'error_maps.png'} and {out / 'rollout.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
