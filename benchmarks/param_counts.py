"""Exact parameter counts of the presets (1000 classes), with and without the classifier head,
next to transformers' ``ViTForImageClassification`` of the same shape.

Run:  python benchmarks/param_counts.py
"""

from __future__ import annotations

import torch

import polar_vit_hf as P
from polar_vit_hf.baselines import euclidean_vit

PAPER = {"tiny": "2.9 M", "small": "21.7 M"}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def main() -> int:
    print(f"{'preset':<11} {'Polar-ViT':>12} {'without head':>13} {'ViT (same shape)':>17} {'paper':>7}")
    for name in P.PRESETS:
        labels = 10 if name == "demo" else 1000
        config = P.PolarViTConfig.from_preset(name, num_labels=labels)
        with torch.device("meta"):
            model, vit = P.PolarViTForImageClassification(config), euclidean_vit(config)
        total = count(model)
        print(
            f"{name:<11} {total:>12,} {total - count(model.classifier):>13,} {count(vit):>17,} "
            f"{PAPER.get(name, '-'):>7}" + ("  (10 classes)" if labels == 10 else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
