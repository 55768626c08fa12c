"""Render the example card for a `small` Polar-ViT (``model_cards/example-polar-vit-small.md``).

Run:  python model_cards/render_example.py

The example is the card ``conversion/export.py`` writes for an ImageNet-1k-sized ``small`` model;
since no ImageNet run exists in this repository, it carries no evaluation results (a card never
reports numbers that were not measured for that model).
"""

from __future__ import annotations

from pathlib import Path

import torch

import polar_vit_hf as P
from polar_vit_hf.model_card import render_model_card


def main() -> int:
    config = P.PolarViTConfig.from_preset("small", num_labels=1000)
    with torch.device("meta"):
        model = P.PolarViTForImageClassification(config)
    summary = (
        "Recipe `training/recipes/imagenet1k.yaml`: ImageNet-1k at 224 px, 90 epochs, Beyer et al. 2022 "
        "with Riemannian AdamW in place of AdamW (paper Appendix D.4). This example was rendered without a "
        "training run, so it lists no results."
    )
    card = render_model_card(model, "polar-vit/polar-vit-small", [], summary, datasets=["imagenet-1k"])
    path = Path(__file__).with_name("example-polar-vit-small.md")
    card.save(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
