"""The mixed-precision policy against float64: logits of a whole model at token radii 0-12, and training.

Run:  python benchmarks/precision_policy.py [--radii 0 2 4 8 12] [--train digits fashion] [--seeds 0 1 2]

Precision table (like the paper's Table 7, for the policy): a ``tiny-cifar``-width model (4 layers) in
float64 whose every Polar-FC is calibrated so that its tokens sit at radius ``R`` (``training.calibration``;
``R = 0``: the anchored initialisation), then the same weights and images in

* float32 (the default);
* the bf16 policy (``torch.autocast("cpu", torch.bfloat16)``: the Polar-FC products in bf16, everything else
  float32);
* bf16 weights (every weight matrix rounded to bf16, all arithmetic float32): the model's own sensitivity to a
  bf16-sized change of its weights, which no arithmetic can remove;
* bf16 token storage (the policy plus every layer's output tokens rounded to bf16): what running the geometry in
  bf16 would add, and why the policy keeps radii and directions in float32.

Columns: the largest logit error relative to the largest float64 logit, and the share of images whose top-1
class agrees with float64.  ``--train`` trains in float32 and under the bf16 policy (``training/pretrain.py
--mixed_precision no|bf16``, seeds ``--seeds``) and prints the held-out accuracies: ``digits`` (the
``digits-demo`` recipe, 200 steps, 449 held-out images) and ``fashion`` (the ``fashion-mnist`` recipe at
Polar-ViT's tuned learning rate 0.03, 300 steps, the 10,000 test images).  Writes ``precision_policy.csv`` and
``precision_policy.png``.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class PolicyRow:
    radius: float
    float32: float
    bf16_policy: float
    bf16_weights: float
    bf16_storage: float
    top1_float32: float
    top1_policy: float
    top1_storage: float


def calibrated_model(radius: float, seed: int = 0):
    """A float64 4-layer model of ``tiny-cifar`` width with its tokens calibrated to ``radius`` (0: as initialised)."""
    import polar_vit_hf as P
    from polar_vit_hf.training.calibration import calibrate_radii

    torch.manual_seed(seed)
    config = P.PolarViTConfig.from_preset("tiny-cifar", num_hidden_layers=4, num_labels=100)
    model = P.PolarViTForImageClassification(config).double().eval()
    pixels = images(32, seed)
    if radius > 0:
        calibrate_radii(model, pixels.double(), radius)
    return model, pixels


def images(count: int, seed: int) -> torch.Tensor:
    """Normalised images (RMS ~ 1 per patch) the model and every precision see as the same float32 values."""
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(count, 3, 32, 32, generator=generator)


def _round_tokens_to_bf16(module: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
    hidden, *rest = output
    return (hidden.to(torch.bfloat16).to(hidden.dtype), *rest)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.argmax(-1) == want.argmax(-1)).double().mean())


@torch.no_grad()
def policy_row(radius: float, seed: int = 0) -> PolicyRow:
    """The policy's logit errors against float64 at token radius ``radius``."""
    model, pixels = calibrated_model(radius, seed)
    exact = model(pixels.double()).logits
    model.float()
    float32 = model(pixels).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        policy = model(pixels).logits
        hooks = [layer.register_forward_hook(_round_tokens_to_bf16) for layer in model.polar_vit.encoder]
        try:
            storage = model(pixels).logits
        finally:
            for hook in hooks:
                hook.remove()
    for parameter in model.parameters():
        if parameter.dim() == 2:
            parameter.copy_(parameter.to(torch.bfloat16))
    weights = model(pixels).logits
    return PolicyRow(
        radius,
        relative_error(float32, exact),
        relative_error(policy, exact),
        relative_error(weights, exact),
        relative_error(storage, exact),
        agreement(float32, exact),
        agreement(policy, exact),
        agreement(storage, exact),
    )


@dataclass(frozen=True)
class TrainingRun:
    """A ``training/pretrain.py`` workload: its arguments besides output, seed and precision, and its steps."""

    name: str
    arguments: tuple[str, ...]
    steps: int


WORKLOADS = {
    "digits": TrainingRun("digits demo", (), 200),
    "fashion": TrainingRun(
        "Fashion-MNIST", ("--recipe", "fashion-mnist", "--lr", "0.03", "--set", "optim.warmup_steps=15"), 300
    ),
}


def train(workload: TrainingRun, mixed_precision: str, seed: int, out: Path) -> float:
    """Held-out accuracy of ``workload`` trained with ``--mixed_precision`` (a fresh process per run, as
    Accelerate's state is per process)."""
    folder = out / f"{workload.name.replace(' ', '-')}-{mixed_precision}-seed{seed}"
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run each time
    steps = str(workload.steps)
    command = [
        sys.executable,
        "-m",
        "polar_vit_hf.training.pretrain",
        *workload.arguments,
        "--output_dir",
        str(folder),
        "--max_steps",
        steps,
        "--eval_steps",
        steps,
        "--save_steps",
        steps,
        "--seed",
        str(seed),
        "--mixed_precision",
        mixed_precision,
        "--cpu",
        "--no_progress",
    ]
    subprocess.run(command, check=True)
    with open(folder / "metrics.csv") as handle:
        return float([row for row in csv.DictReader(handle) if row["eval_accuracy"]][-1]["eval_accuracy"])


def plot(rows: list[PolicyRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    radii = [row.radius for row in rows]
    for name, label in (
        ("float32", "float32"),
        ("bf16_policy", "bf16 policy"),
        ("bf16_weights", "bf16 weights"),
        ("bf16_storage", "bf16 tokens"),
    ):
        ax.semilogy(radii, [max(getattr(row, name), 1e-12) for row in rows], "o-", label=label)
    ax.set_xlabel("token radius r")
    ax.set_ylabel("max logit error / max logit")
    ax.set_title("the precision policy against float64")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--radii", type=float, nargs="+", default=[0.0, 2.0, 4.0, 8.0, 12.0])
    parser.add_argument(
        "--train",
        nargs="*",
        choices=sorted(WORKLOADS),
        default=None,
        help="also train these workloads in float32 and under the policy (no names: digits)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("outputs/precision_policy"))
    args = parser.parse_args(argv)
    from tqdm.auto import tqdm

    args.out.mkdir(parents=True, exist_ok=True)
    rows = [policy_row(radius) for radius in tqdm(args.radii, desc="radii")]
    print(
        "logits against float64 (4-layer tiny-cifar width, 32 images, 100 classes); error = max |logit error| / "
        "max |logit|"
    )
    print(
        f"{'r':>5} {'float32':>10} {'bf16 policy':>12} {'bf16 weights':>13} {'bf16 tokens':>12} {'top-1 fp32':>11} "
        f"{'top-1 policy':>13} {'top-1 tokens':>13}"
    )
    for row in rows:
        print(
            f"{row.radius:>5g} {row.float32:>10.1e} {row.bf16_policy:>12.1e} {row.bf16_weights:>13.1e} "
            f"{row.bf16_storage:>12.1e} "
            f"{row.top1_float32:>11.0%} {row.top1_policy:>13.0%} {row.top1_storage:>13.0%}"
        )
    with open(args.out / "precision_policy.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(list(PolicyRow.__dataclass_fields__))
        writer.writerows([list(vars(row).values()) for row in rows])
    plot(rows, args.out / "precision_policy.png")
    for key in ["digits"] if args.train == [] else (args.train or []):
        workload = WORKLOADS[key]
        results = {
            precision: [train(workload, precision, seed, args.out) for seed in args.seeds]
            for precision in ("no", "bf16")
        }
        print(f"\n{workload.name}, {workload.steps} steps, seeds {args.seeds}: held-out accuracy")
        for precision, accuracies in results.items():
            spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
            name = "float32" if precision == "no" else "bf16 policy"
            print(
                f"{name:>12}: {100 * statistics.mean(accuracies):.2f} +- {100 * spread:.2f} % "
                f"({', '.join(f'{100 * a:.2f}' for a in accuracies)})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
