"""The demo preset learns scikit-learn's digits (shipped with the package, upsampled to 32 x 32)."""

from __future__ import annotations

import torch

import polar_vit_hf as P
from polar_vit_hf.data import digits_splits
from polar_vit_hf.demo import accuracy, fit_classifier

STEPS = 200  # a fixed, seeded step budget: batch 32, AdamW lr 5e-3, cosine


def test_demo_preset_reaches_90_percent_on_held_out_digits():
    train, test = digits_splits(image_size=32, seed=0)
    torch.manual_seed(0)
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo"))
    losses = fit_classifier(model, train, steps=STEPS, batch_size=32, lr=5e-3, seed=0)
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    assert accuracy(model, test) >= 0.90
