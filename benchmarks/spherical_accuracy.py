"""Spherical digits: SO(3)-RoPE against planar position encodings, trained on unrotated, tested on rotated inputs.

Run:  python benchmarks/spherical_accuracy.py [--steps 600] [--seeds 0 1 2] [--lr 3e-3] [--quick]

The spherical-MNIST protocol of spherical CNNs (Cohen et al. 2018) on scikit-learn's digits: every 8 x 8 digit
is put on the sphere by the inverse stereographic projection around the north pole (a cap of ``--cap`` degrees),
training images unrotated, test images once unrotated and once under a random rotation each (fixed seed).  Four
models of the same depth, width, MLP width and heads, trained the same way (AdamW, ``--lr``, 5 % warm-up, cosine
decay, batch 32, ``--steps``):

* ``ViT (equirectangular)``: transformers' ViT on the 32 x 64 equirectangular image (8 x 8 patches, learned
  positions);
* ``ViT + SO(3)-RoPE (icosphere)``: the same blocks on the icosphere tokens (``euclidean_spherical_vit``);
* ``Polar-ViT, horoshift (equirectangular)``: Polar-ViT on the equirectangular image (sine-cosine positions,
  horoshift relative positions);
* ``Polar-ViT + SO(3)-RoPE (icosphere)``: ``PolarViTSphericalConfig`` preset ``sphere-cpu``
  (icosphere level 4, 2562 vertices, 60 lifted tokens, no absolute positions).

Prints accuracy on both test sets (mean +- std over seeds), time per training step and the icosahedral invariance
error of the untrained icosphere models (float64 and float32); writes ``spherical.csv``
and ``spherical.png`` to ``--out``.  ``--quick`` (a minute): 30 steps, one seed.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import polar_vit_hf as P
from polar_vit_hf.baselines import euclidean_spherical_vit
from polar_vit_hf.benchmarks.digits_demo import accuracy_summary
from polar_vit_hf.modeling.spherical import icosphere, random_rotations

EQUIRECT = (32, 64)  # rows (colatitude) x columns (longitude)
MODELS = (
    "ViT (equirectangular)",
    "ViT + SO(3)-RoPE (icosphere)",
    "Polar-ViT, horoshift (equirectangular)",
    "Polar-ViT + SO(3)-RoPE (icosphere)",
)


def equirect_points(height: int, width: int) -> torch.Tensor:
    """Unit vectors ``(H W, 3)`` of the equirectangular pixel centres (row 0 at the north pole)."""
    theta = (torch.arange(height, dtype=torch.float64) + 0.5) * math.pi / height
    phi = (torch.arange(width, dtype=torch.float64) + 0.5) * 2 * math.pi / width - math.pi
    theta, phi = torch.meshgrid(theta, phi, indexing="ij")
    return torch.stack([theta.sin() * phi.cos(), theta.sin() * phi.sin(), theta.cos()], -1).reshape(-1, 3)


def project(images: torch.Tensor, points: torch.Tensor, rotations: torch.Tensor | None, cap: float) -> torch.Tensor:
    """Values ``(B, P)`` of planar images ``(B, H, W)`` put on the sphere around the north pole and rotated.

    The image square is the stereographic image (from the south pole) of a cap of half-angle ``cap / 2`` degrees
    around ``+z``; the rotated signal at ``p`` is the image at ``R^T p``.
    """
    q = points.expand(images.shape[0], -1, -1) if rotations is None else points @ rotations  # (B, P, 3) = R^T p
    half = math.tan(math.radians(cap) / 4)  # stereographic radius of the cap's rim
    plane = q[..., :2] / (1 + q[..., 2:]).clamp_min(1e-9) / half  # in [-1, 1] on the image
    plane = torch.where(q[..., 2:] > -0.99, plane, torch.full_like(plane, 2.0))  # far side: outside
    grid = plane[:, None].to(images.dtype)  # (B, 1, P, 2): x = column, y = row
    return F.grid_sample(images[:, None], grid, align_corners=False, padding_mode="zeros")[:, 0, 0]


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits in [0, 1], ``(B, 8, 8)``: the demo's 1348 / 449 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float64) / 16.0
    labels = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=0.25, random_state=0, stratify=labels
    )
    return train_x, train_y, test_x, test_y


def inputs(images: torch.Tensor, rotations: torch.Tensor | None, cap: float, level: int) -> dict[str, torch.Tensor]:
    """Model inputs (standardised): icosphere ``(B, 1, V)`` and equirectangular ``(B, 1, H, W)``."""
    sphere = project(images, icosphere(level), rotations, cap)
    plane = project(images, equirect_points(*EQUIRECT), rotations, cap).reshape(-1, 1, *EQUIRECT)
    return {"sphere": ((sphere - 0.1) / 0.3)[:, None].float(), "plane": ((plane - 0.1) / 0.3).float()}


def build(name: str, config: P.PolarViTSphericalConfig) -> tuple[torch.nn.Module, str]:
    """The model of a row and the input it reads (``"sphere"`` or ``"plane"``)."""
    from transformers import ViTConfig, ViTForImageClassification

    sizes = dict(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        num_labels=10,
        num_channels=1,
    )
    if name == "ViT (equirectangular)":
        return ViTForImageClassification(
            ViTConfig(
                image_size=EQUIRECT, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **sizes
            )
        ), "plane"
    if name == "ViT + SO(3)-RoPE (icosphere)":
        return euclidean_spherical_vit(config), "sphere"
    if name == "Polar-ViT, horoshift (equirectangular)":
        return P.PolarViTForImageClassification(
            P.PolarViTConfig(image_size=EQUIRECT[0], patch_size=8, position_embedding="sincos", **sizes)
        ), "plane"
    return P.PolarViTSphericalForImageClassification(config), "sphere"


def train_and_test(name: str, data: dict, args, seed: int) -> dict:
    """Train one row once; accuracies on both test sets, seconds per step, losses."""
    torch.manual_seed(seed)
    config = P.PolarViTSphericalConfig.from_preset("sphere-cpu", icosphere_level=args.level)
    model, kind = build(name, config)
    train_x, train_y = data["train"][kind], data["train_y"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps))))
    )
    generator = torch.Generator().manual_seed(seed)
    losses, times = [], []
    model.train()
    for _ in tqdm(range(args.steps), desc=f"{name}, seed {seed}", leave=False, disable=args.no_progress):
        batch = torch.randint(0, train_x.shape[0], (args.batch,), generator=generator)
        start = time.perf_counter()
        loss = model(pixel_values=train_x[batch], labels=train_y[batch]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    model.eval()
    accuracy = {}
    with torch.no_grad():
        for split in ("test", "rotated"):
            x = data[split][kind]
            predictions = torch.cat(
                [model(pixel_values=x[i : i + 128]).logits.argmax(-1) for i in range(0, x.shape[0], 128)]
            )
            accuracy[split] = float((predictions == data["test_y"]).float().mean())
    steady = times[min(5, len(times) - 1) :]
    return {"accuracy": accuracy, "step_s": statistics.mean(steady), "losses": losses}


def equivariance_errors(level: int) -> dict[str, float]:
    """Largest logit change of the untrained icosphere models (``sphere-cpu``, float64 and float32) over the 60
    icosahedral rotations of two random signals (an exact permutation of the tokens)."""
    from polar_vit_hf.modeling.spherical import icosahedral_rotations, rotate_signal

    config = P.PolarViTSphericalConfig.from_preset("sphere-cpu", icosphere_level=level)
    x = torch.randn(2, 1, config.num_vertices, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rotated = torch.cat([rotate_signal(x, g, level) for g in icosahedral_rotations()])
    errors = {}
    for name, model in (
        ("Polar-ViT + SO(3)-RoPE", P.PolarViTSphericalForImageClassification(config)),
        ("ViT + SO(3)-RoPE", euclidean_spherical_vit(config)),
    ):
        for dtype in (torch.float64, torch.float32):
            model = model.to(dtype).eval()
            with torch.no_grad():
                logits = model(pixel_values=x.to(dtype)).logits
                moved = model(pixel_values=rotated.to(dtype)).logits.reshape(60, *logits.shape)
            errors[f"{name}, {str(dtype)[6:]}"] = float((moved - logits).abs().max() / logits.abs().max())
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="training steps per run (default 600; --quick 30)")
    parser.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cap", type=float, default=100.0, help="angular size of the digit on the sphere (degrees)")
    parser.add_argument("--level", type=int, default=4, help="icosphere level of the spherical inputs")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, metavar="MODEL")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no_progress", action="store_true")
    parser.add_argument("--out", default="outputs/spherical")
    args = parser.parse_args(argv)
    args.steps = args.steps or (30 if args.quick else 600)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    train_x, train_y, test_x, test_y = load_digits_split()
    data = {
        "train": inputs(train_x, None, args.cap, args.level),
        "train_y": train_y,
        "test": inputs(test_x, None, args.cap, args.level),
        "test_y": test_y,
        "rotated": inputs(test_x, random_rotations(test_x.shape[0], seed=1234), args.cap, args.level),
    }
    errors = equivariance_errors(args.level)
    results = {name: [train_and_test(name, data, args, seed) for seed in seeds] for name in args.models}

    print(
        f"\nSpherical digits ({train_x.shape[0]} train unrotated / {test_x.shape[0]} test), {args.steps} steps, "
        f"batch {args.batch}, lr {args.lr:g}, seeds {seeds}"
    )
    print(f"{'model':<40} {'test, unrotated':>20} {'test, rotated':>20} {'s / step':>9}")
    for name, runs in results.items():
        print(
            f"{name:<40} {accuracy_summary([r['accuracy']['test'] for r in runs]):>20} "
            f"{accuracy_summary([r['accuracy']['rotated'] for r in runs]):>20} "
            f"{statistics.mean(r['step_s'] for r in runs):>9.3f}"
        )
    print("\nicosahedral invariance of the untrained models (max |logit change| / max |logit|, 60 rotations):")
    for name, error in errors.items():
        print(f"  {name:<32} {error:.1e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "spherical.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "seed", "test_accuracy", "rotated_accuracy", "seconds_per_step"])
        for name, runs in results.items():
            for seed, run in zip(seeds, runs):
                writer.writerow([name, seed, run["accuracy"]["test"], run["accuracy"]["rotated"], run["step_s"]])
    plot(results, out / "spherical.png")
    print(f"wrote {out / 'spherical.csv'} and {out / 'spherical.png'}")
    return 0


def plot(results: dict, path: Path) -> None:
    """Accuracy on unrotated and rotated test digits per model (bars: mean, ticks: seeds); training losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(results)
    for offset, split, color in ((-0.2, "test", "tab:blue"), (0.2, "rotated", "tab:orange")):
        values = [[100 * run["accuracy"][split] for run in results[name]] for name in names]
        bars.bar(
            [i + offset for i in range(len(names))],
            [statistics.mean(v) for v in values],
            width=0.38,
            color=color,
            label="unrotated" if split == "test" else "randomly rotated",
        )
        for i, v in enumerate(values):
            bars.scatter([i + offset] * len(v), v, color="black", s=8, zorder=3)
    bars.set_xticks(range(len(names)), [name.replace(" (", "\n(") for name in names], fontsize=7)
    bars.set(ylabel="test accuracy (%)", ylim=(0, 100), title="trained on unrotated digits")
    bars.legend()
    for (name, runs), color in zip(results.items(), plt.get_cmap("tab10").colors):
        for index, run in enumerate(runs):
            curves.plot(run["losses"], color=color, alpha=0.6, label=name if index == 0 else None)
    curves.set(xlabel="step", ylabel="training loss", yscale="log")
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
