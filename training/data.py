"""Image-classification data and augmentation for the training scripts.

Datasets by Hugging Face name (``cifar100``, ``imagenet-1k``, ``zh-plus/tiny-imagenet``, ...),
a local ``imagefolder`` (``data_dir/<split>/<label>/<image>``), or ``digits`` (scikit-learn's
digits: 1797 grey 8 x 8 images of 10 classes that ship inside scikit-learn, upsampled to an RGB
image of ``image_size`` pixels; the offline default).  Augmentation uses torchvision's v2
transforms (random resized crop, flip, AutoAugment / RandAugment, random erasing) and timm's
Mixup/CutMix with label smoothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

HF_ALIASES = {"cifar100": "uoft-cs/cifar100", "cifar10": "uoft-cs/cifar10", "tiny-imagenet": "zh-plus/tiny-imagenet",
              "imagenet1k": "imagenet-1k"}


def digits_images(image_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """All digits as uint8 RGB arrays ``(1797, S, S, 3)`` and labels, upsampled bilinearly."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    big = F.interpolate(grey, size=(image_size, image_size), mode="bilinear", align_corners=False)
    rgb = (big.clamp(0, 1) * 255.0).round().to(torch.uint8).repeat(1, 3, 1, 1).permute(0, 2, 3, 1)
    return rgb.numpy(), digits.target.astype(np.int64)


def digits_split_indices(count: int = 1797, test_fraction: float = 0.25,
                         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` indices of the seeded digits split used everywhere in the project."""
    order = np.random.default_rng(seed).permutation(count)
    n_test = int(round(test_fraction * count))
    return order[n_test:], order[:n_test]


@dataclass
class ClassificationData:
    train: Dataset
    eval: Dataset
    id2label: dict[int, str]


class TransformedDataset(Dataset):
    """``(image, label)`` pairs from ``get(index)``, images passed through ``transform``."""

    def __init__(self, length: int, get: Callable[[int], tuple[Image.Image, int]], transform: Callable):
        self.length, self.get, self.transform = length, get, transform

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.get(int(index))
        return self.transform(image.convert("RGB")), int(label)


def build_transforms(image_size: int, augment: dict[str, Any], train: bool):
    """torchvision v2 pipeline; images end as float tensors normalised with mean = std = 0.5."""
    from torchvision.transforms import v2

    steps: list = []
    if train and augment.get("random_resized_crop"):
        steps.append(v2.RandomResizedCrop(image_size, scale=(0.08 if image_size > 64 else 0.5, 1.0), antialias=True))
    else:
        steps.append(v2.Resize((image_size, image_size), antialias=True))
    if train and augment.get("horizontal_flip"):
        steps.append(v2.RandomHorizontalFlip())
    policy = augment.get("auto_augment") if train else None
    if policy == "autoaugment":
        steps.append(v2.AutoAugment())
    elif policy == "randaugment":
        steps.append(v2.RandAugment(num_ops=2, magnitude=9))
    elif policy:
        raise ValueError(f"augment.auto_augment={policy!r} is not one of null, 'autoaugment', 'randaugment'")
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.5] * 3)]
    if train and float(augment.get("random_erasing", 0.0)) > 0:
        steps.append(v2.RandomErasing(p=float(augment["random_erasing"])))
    return v2.Compose(steps)


def build_mixup(augment: dict[str, Any], num_classes: int):
    """timm's Mixup/CutMix (with label smoothing) or ``None`` when both are off."""
    mixup, cutmix = float(augment.get("mixup", 0.0)), float(augment.get("cutmix", 0.0))
    if mixup <= 0 and cutmix <= 0:
        return None
    from timm.data import Mixup

    return Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, prob=float(augment.get("mix_prob", 1.0)),
                 switch_prob=0.5, label_smoothing=float(augment.get("label_smoothing", 0.0)),
                 num_classes=num_classes)


def _digits(image_size: int, seed: int = 0) -> tuple[Callable, Callable, int, int, dict[int, str]]:
    images, labels = digits_images(image_size)
    train, test = digits_split_indices(len(labels), seed=seed)

    def getter(indices):
        return lambda i: (Image.fromarray(images[indices[i]]), int(labels[indices[i]]))

    return getter(train), getter(test), len(train), len(test), {i: str(i) for i in range(10)}


def _hf(name: str, data_dir: str | None, train_split: str, eval_split: str):
    import datasets

    if name == "imagefolder":
        if not data_dir:
            raise ValueError("dataset 'imagefolder' needs --data_dir (layout: data_dir/<split>/<label>/<image>)")
        loaded = datasets.load_dataset("imagefolder", data_dir=data_dir)
    else:
        loaded = datasets.load_dataset(HF_ALIASES.get(name, name), data_dir=data_dir)
    for split in (train_split, eval_split):
        if split not in loaded:
            raise ValueError(f"dataset {name!r} has no split {split!r}; it has {sorted(loaded)}")
    features = loaded[train_split].features
    image_key = next((k for k, f in features.items() if isinstance(f, datasets.Image)), None)
    label_key = next((k for k, f in features.items() if isinstance(f, datasets.ClassLabel)), None)
    if image_key is None or label_key is None:
        raise ValueError(f"dataset {name!r} needs an Image and a ClassLabel column, it has {dict(features)}")
    names = features[label_key].names

    def getter(split):
        table = loaded[split]
        return lambda i: (table[i][image_key], table[i][label_key])

    return (getter(train_split), getter(eval_split), len(loaded[train_split]), len(loaded[eval_split]),
            dict(enumerate(names)))


def build_data(dataset: str, image_size: int, augment: dict[str, Any], data_dir: str | None = None,
               train_split: str = "train", eval_split: str = "test") -> ClassificationData:
    """Train and held-out datasets with their transforms, and ``id2label``."""
    if dataset == "digits":
        get_train, get_eval, n_train, n_eval, id2label = _digits(image_size)
    else:
        get_train, get_eval, n_train, n_eval, id2label = _hf(dataset, data_dir, train_split, eval_split)
    return ClassificationData(
        TransformedDataset(n_train, get_train, build_transforms(image_size, augment, train=True)),
        TransformedDataset(n_eval, get_eval, build_transforms(image_size, augment, train=False)),
        id2label,
    )
