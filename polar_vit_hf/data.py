"""Offline data that ships with installed packages: scikit-learn's handwritten digits.

``load_digits`` gives 1797 grey 8 x 8 images of 10 classes; Polar-ViT's demo upsamples them to an
RGB image of ``image_size`` pixels.  Everything here runs without network access.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

DIGIT_LABELS = {i: str(i) for i in range(10)}


@dataclass
class DigitsSplit:
    """Pixel tensors ``(N, 3, S, S)`` normalised to [-1, 1] (mean 0.5, std 0.5) and labels ``(N,)``."""

    pixel_values: Tensor
    labels: Tensor


def digits_images(image_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """All digits as uint8 RGB arrays ``(1797, S, S, 3)`` and labels, upsampled bilinearly."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    big = F.interpolate(grey, size=(image_size, image_size), mode="bilinear", align_corners=False)
    rgb = (big.clamp(0, 1) * 255.0).round().to(torch.uint8).repeat(1, 3, 1, 1).permute(0, 2, 3, 1)
    return rgb.numpy(), digits.target.astype(np.int64)


def digits_split_indices(count: int = 1797, test_fraction: float = 0.25, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` indices of the seeded digits split used everywhere in the project."""
    order = np.random.default_rng(seed).permutation(count)
    n_test = int(round(test_fraction * count))
    return order[n_test:], order[:n_test]


def digits_splits(image_size: int = 32, test_fraction: float = 0.25, seed: int = 0) -> tuple[DigitsSplit, DigitsSplit]:
    """The seeded train/test split of the digits as normalised tensors."""
    images, labels = digits_images(image_size)
    train, test = digits_split_indices(len(labels), test_fraction, seed)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    pixels = (pixels - 0.5) / 0.5
    targets = torch.from_numpy(labels)
    return DigitsSplit(pixels[train], targets[train]), DigitsSplit(pixels[test], targets[test])
