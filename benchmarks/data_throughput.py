"""Images per second of the ImageNet-1k training input pipeline, per DataLoader worker, and how many workers a
GPU needs at Polar-ViT's step rate.

Run:  python benchmarks/data_throughput.py [--images 256] [--workers 0 1 2] [--batch 64] [--out DIR]

The pipeline is the one ``training/pretrain.py --recipe imagenet1k`` runs: JPEG decoding from an ILSVRC2012
``train/<wnid>/`` folder (:func:`official_data.load_imagenet`), the recipe's Inception crop to 224 px, flip,
RandAugment(2, 10), tensor conversion and normalisation, collated into batches.  The JPEGs are photographs
shipped with scikit-image (astronaut, coffee, chelsea, rocket, ...), cropped and resized to ImageNet's
typical 500 x 375 and saved at quality 90 (ImageNet's median file is about 110 KB at that size).

The GPU side: the paper's Table 8 step time (RTX A5000, fp32, compiled, batch 128 of ViT-Tiny at CIFAR
shape: 58 ms Polar-ViT, 21 ms Euclidean ViT) scaled by the multiply-adds per image of each preset
(:func:`macs_per_image`), an estimate of the images per second one GPU consumes; the workers it needs are
that rate over the measured rate per worker.  Writes ``data_throughput.csv`` and ``data_throughput.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PAPER_STEP_MS = {"polar": 58.0, "euclidean": 21.0}  # Table 8: ViT-Tiny, CIFAR-100 shape, batch 128, RTX A5000
PAPER_STEP_BATCH, PAPER_STEP_PRESET = 128, "tiny-cifar"
IMAGENET_SIZE = (500, 375)  # the typical ILSVRC2012 training image


@dataclass(frozen=True)
class Measurement:
    workers: int
    images_per_second: float

    @property
    def per_worker(self) -> float:
        """Images per second each worker process delivers (the main process counts as one without workers)."""
        return self.images_per_second / max(1, self.workers)


def macs_per_image(preset: str, image_size: int | None = None) -> float:
    """Multiply-adds of one forward pass of a same-shape ViT: patch embedding, Q/K/V/O and MLP products, and the
    attention's ``N^2 d`` score and value products per layer (Polar-ViT's elementwise work scales the same way
    or more slowly, so the estimate below is conservative)."""
    from polar_vit_hf import PolarViTConfig

    config = PolarViTConfig.from_preset(preset, **({"image_size": image_size} if image_size else {}))
    tokens = (config.image_size // config.patch_size) ** 2
    width, mlp = config.hidden_size, config.intermediate_size
    per_layer = 4 * tokens * width**2 + 2 * tokens * width * mlp + 2 * tokens**2 * width
    embed = tokens * config.num_channels * config.patch_size**2 * width
    return float(config.num_hidden_layers * per_layer + embed)


def gpu_images_per_second(model: str, preset: str) -> float:
    """Training images per second on the paper's GPU (fp32, compiled), from Table 8 scaled by the multiply-adds."""
    per_image_ms = PAPER_STEP_MS[model] / PAPER_STEP_BATCH * macs_per_image(preset) / macs_per_image(PAPER_STEP_PRESET)
    return 1000.0 / per_image_ms


def write_imagenet_folder(root: Path, count: int, classes: int = 8) -> None:
    """``root/train/<wnid>/*.JPEG`` (``count`` images over ``classes`` synsets) and a devkit-free layout."""
    import numpy as np
    import skimage.data
    from PIL import Image

    photos = [
        getattr(skimage.data, name)()
        for name in ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry")
    ]
    rng = np.random.default_rng(0)
    for i in range(count):
        photo = photos[i % len(photos)]
        height, width = photo.shape[:2]
        top, left = (int(rng.integers(0, max(1, height // 4))), int(rng.integers(0, max(1, width // 4))))
        crop = Image.fromarray(photo[top:, left:]).convert("RGB").resize(IMAGENET_SIZE, Image.BICUBIC)
        folder = root / "train" / f"n{1440764 + i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        crop.save(folder / f"{folder.name}_{i}.JPEG", quality=90)


def measure(root: Path, workers: int, batch: int, epochs: int) -> Measurement:
    """Images per second through the recipe's training pipeline with ``workers`` DataLoader workers."""
    import torch
    import yaml

    from polar_vit_hf.training.data import build_data
    from polar_vit_hf.training.pretrain import RECIPES

    recipe = yaml.safe_load((RECIPES / "imagenet1k.yaml").read_text())
    data = build_data("imagenet-1k", 224, recipe["augment"], str(root), "train", "train")
    loader = torch.utils.data.DataLoader(
        data.train,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
        drop_last=True,
    )
    for _ in loader:  # warm-up epoch: workers started, files in the page cache
        pass
    start, images = time.perf_counter(), 0
    for _ in range(epochs):
        for pixels, _ in loader:
            images += pixels.shape[0]
    return Measurement(workers, images / (time.perf_counter() - start))


def plot(rows: list[Measurement], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r.workers for r in rows], [r.images_per_second for r in rows], "o-")
    ax.set_xlabel("DataLoader workers (0: the main process)")
    ax.set_ylabel("images / s")
    ax.set_title("ImageNet-1k training pipeline at 224 px")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256, help="JPEGs in the temporary ILSVRC2012 folder")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="timed passes over the images (after one warm-up)")
    parser.add_argument("--out", type=Path, default=Path("outputs/data_throughput"))
    args = parser.parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(1)  # as in a worker: the transforms run one thread per process
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_imagenet_folder(root, args.images)
        rows = [measure(root, workers, args.batch, args.epochs) for workers in tqdm(args.workers, desc="workers")]
    print(
        f"ImageNet-1k training pipeline (imagenet1k recipe, 224 px), {args.images} JPEGs of "
        f"{IMAGENET_SIZE[0]}x{IMAGENET_SIZE[1]}, batch {args.batch}, {os.cpu_count()} CPUs"
    )
    print(f"{'workers':>8} {'images/s':>10} {'per worker':>11}")
    for row in rows:
        print(f"{row.workers:>8} {row.images_per_second:>10.1f} {row.per_worker:>11.1f}")
    per_worker = (
        max(row.per_worker for row in rows if row.workers > 0) if any(r.workers for r in rows) else rows[0].per_worker
    )
    print("\nGPU demand (paper Table 8 on an RTX A5000, fp32, compiled, scaled by multiply-adds per image):")
    print(f"{'model':>22} {'preset':>7} {'GPU images/s':>13} {'workers per GPU':>16}")
    for model in ("polar", "euclidean"):
        for preset in ("small", "tiny"):
            rate = gpu_images_per_second(model, preset)
            name = "Polar-ViT" if model == "polar" else "Euclidean ViT"
            print(f"{name:>22} {preset:>7} {rate:>13.0f} {rate / per_worker:>16.1f}")
    with open(args.out / "data_throughput.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["workers", "images_per_second", "per_worker"])
        writer.writerows([r.workers, f"{r.images_per_second:.2f}", f"{r.per_worker:.2f}"] for r in rows)
    plot(rows, args.out / "data_throughput.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
