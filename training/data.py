"""Image-classification data and augmentation for the training scripts.

Datasets by Hugging Face name (``cifar100``, ``imagenet-1k``, ``zh-plus/tiny-imagenet``, ...),
a local ``imagefolder`` (``data_dir/<split>/<label>/<image>``), ``fashion_mnist`` (the original IDX
files, :mod:`polar_vit_hf.training.fashion_mnist`), or ``digits`` (scikit-learn's
digits: 1797 grey 8 x 8 images of 10 classes that ship inside scikit-learn, upsampled to an RGB
image of ``image_size`` pixels; the offline default).  Augmentation uses torchvision's v2
transforms (random resized crop, flip, AutoAugment / RandAugment, random erasing) and timm's
Mixup/CutMix with label smoothing.

Bad data never kills a run: an image that cannot be decoded (or has zero size) is skipped - the
next readable index of the split takes its place, so batches keep their size and the order stays
deterministic (``--resume`` is exact) - with a warning and a line in ``bad_samples.txt``; past
``max_bad_fraction`` of what was read (after ``MIN_READS_FOR_THRESHOLD`` reads) the run stops with
:class:`BadSampleError`.  Greyscale, palette, RGBA, CMYK and 16-bit images are converted to 8-bit RGB.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from polar_vit_hf.cli import UserError

# what decoding a broken image raises: PIL.UnidentifiedImageError and truncated files are OSErrors, some
# decoders raise ValueError / SyntaxError
BAD_IMAGE_ERRORS = (OSError, ValueError, SyntaxError)
DEFAULT_MAX_BAD_FRACTION = 0.01
MIN_READS_FOR_THRESHOLD = 100  # the fraction of bad images is judged once this many have been read
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")


class BadSampleError(UserError):
    """Too many unreadable images: the data set itself is broken."""

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


def to_rgb(image: Image.Image) -> Image.Image:
    """Decode ``image`` and convert it to 8-bit RGB (greyscale, palette, RGBA, CMYK, 16-bit and float images).

    Raises ``ValueError`` for a zero-size image and what PIL raises for an undecodable one.
    """
    image.load()  # decode now: a broken file fails here, inside the bad-sample guard
    if image.width == 0 or image.height == 0:
        raise ValueError(f"zero-size image ({image.width} x {image.height})")
    if image.mode in (*SIXTEEN_BIT_MODES, "I", "F"):
        values = np.asarray(image, dtype=np.float64)
        if image.mode in SIXTEEN_BIT_MODES or (image.mode == "I" and values.max() > 255):
            top = 65535.0
        elif image.mode == "F" and values.max() <= 1.0:
            top = 1.0
        else:
            top = max(255.0, float(values.max()))
        image = Image.fromarray(np.clip(np.rint(values / top * 255.0), 0, 255).astype(np.uint8))
    return image.convert("RGB")


@dataclass
class ClassificationData:
    train: Dataset
    eval: Dataset
    id2label: dict[int, str]


class TransformedDataset(Dataset):
    """``(image, label)`` pairs from ``get(index)``, images converted to RGB and passed through ``transform``.

    An unreadable image is skipped: the next readable index takes its place (deterministic), a
    warning names it (``describe(index)``, e.g. its path) and a line goes to ``bad_sample_log``
    when set; :class:`BadSampleError` once more than ``max_bad_fraction`` of the reads failed.
    """

    def __init__(self, length: int, get: Callable[[int], tuple[Image.Image, int]], transform: Callable,
                 describe: Callable[[int], str] | None = None, max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
                 bad_sample_log: Path | None = None):
        self.length, self.get, self.transform = length, get, transform
        self.describe = describe or (lambda index: f"index {index}")
        self.max_bad_fraction, self.bad_sample_log = float(max_bad_fraction), bad_sample_log
        self.reads = self.bad = 0  # per process (each DataLoader worker counts its own)

    def with_transform(self, transform: Callable) -> TransformedDataset:
        """The same images through another transform."""
        return TransformedDataset(self.length, self.get, transform, self.describe, self.max_bad_fraction,
                                  self.bad_sample_log)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        for offset in range(self.length):
            position = (int(index) + offset) % self.length
            self.reads += 1
            try:
                image, label = self.get(position)
                image = to_rgb(image)
            except BAD_IMAGE_ERRORS as error:
                self._skip(position, error)
                continue
            return self.transform(image), int(label)
        raise BadSampleError(f"none of the {self.length} images could be read; see {self.bad_sample_log}")

    def _skip(self, position: int, error: Exception) -> None:
        self.bad += 1
        where = self.describe(position)
        reason = f"{type(error).__name__}: {error}".replace("\n", " ")
        warnings.warn(f"skipping an unreadable image ({where}): {reason}", stacklevel=2)
        if self.bad_sample_log is not None:
            with open(self.bad_sample_log, "a") as handle:
                handle.write(f"{where}\t{reason}\n")
        if self.reads >= MIN_READS_FOR_THRESHOLD and self.bad > self.max_bad_fraction * self.reads:
            raise BadSampleError(
                f"{self.bad} of the last {self.reads} images read could not be decoded (more than "
                f"{self.max_bad_fraction:.1%}): the data set looks broken. The files are listed in "
                f"{self.bad_sample_log}; repair or remove them, or allow more with --max_bad_fraction"
            )


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


@dataclass
class _Split:
    """Raw access to one split: ``get(i) -> (PIL image, label)`` and ``describe(i)`` for messages."""

    get: Callable[[int], tuple[Image.Image, int]]
    describe: Callable[[int], str]
    length: int


def digits_splits(count: int = 1797, validation_fraction: float = 0.2) -> dict[str, np.ndarray]:
    """Indices of the digits splits: ``train`` / ``test`` (:func:`digits_split_indices`) and, for tuning without
    looking at ``test``, ``fit`` / ``validation`` (a fixed ``validation_fraction`` of ``train``)."""
    train, test = digits_split_indices(count)
    cut = int(round(validation_fraction * len(train)))
    return {"train": train, "test": test, "fit": train[cut:], "validation": train[:cut]}


def _digits(image_size: int, train_split: str = "train", eval_split: str = "test"
            ) -> tuple[_Split, _Split, dict[int, str]]:
    images, labels = digits_images(image_size)
    splits = digits_splits(len(labels))
    for name in (train_split, eval_split):
        if name not in splits:
            raise UserError(f"dataset 'digits' has no split {name!r}; it has {sorted(splits)}")

    def split(indices) -> _Split:
        return _Split(lambda i: (Image.fromarray(images[indices[i]]), int(labels[indices[i]])),
                      lambda i: f"digits image {indices[i]}", len(indices))

    return split(splits[train_split]), split(splits[eval_split]), {i: str(i) for i in range(10)}


def _load_hf(name: str, data_dir: str | None):
    """``datasets.load_dataset`` with the user's mistakes turned into :class:`UserError`."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    if name == "imagefolder":
        if not data_dir:
            raise UserError("dataset 'imagefolder' needs --data_dir DIR (layout: DIR/<split>/<label>/<image>)")
        if not Path(data_dir).is_dir():
            raise UserError(f"--data_dir {data_dir}: no such directory "
                            f"(an imagefolder is DIR/<split>/<label>/<image>)")
        try:
            return datasets.load_dataset("imagefolder", data_dir=data_dir)
        except FileNotFoundError as error:  # EmptyDatasetError is one
            raise UserError(f"--data_dir {data_dir}: no images found ({error}); expected "
                            f"DIR/<split>/<label>/<image>") from None
    repo = HF_ALIASES.get(name, name)
    try:
        return datasets.load_dataset(repo, data_dir=data_dir)
    except (ConnectionError, DatasetNotFoundError, FileNotFoundError) as error:
        raise UserError(
            f"dataset {repo!r} could not be loaded ({type(error).__name__}: {str(error).splitlines()[0]}): it is "
            f"not in the local cache and the Hub is not reachable (offline?). Download it once with network "
            f"access, or train on local images with --dataset imagefolder --data_dir DIR"
        ) from None


def _hf(name: str, loaded, train_split: str, eval_split: str) -> tuple[_Split, _Split, dict]:
    """The two splits of a loaded ``datasets.DatasetDict`` with an ``Image`` and a ``ClassLabel`` column."""
    import datasets

    for split in (train_split, eval_split):
        if split not in loaded:
            raise UserError(f"dataset {name!r} has no split {split!r}; it has {sorted(loaded)} "
                            f"(choose with --train_split / --eval_split)")
    features = loaded[train_split].features
    image_key = next((k for k, f in features.items() if isinstance(f, datasets.Image)), None)
    label_key = next((k for k, f in features.items() if isinstance(f, datasets.ClassLabel)), None)
    if image_key is None or label_key is None:
        raise UserError(f"dataset {name!r} needs an Image and a ClassLabel column, it has {dict(features)}")
    names = features[label_key].names

    def split(name_: str) -> _Split:
        table = loaded[name_]
        undecoded = table.cast_column(image_key, datasets.Image(decode=False))

        def describe(i: int) -> str:
            path = undecoded[i][image_key].get("path")
            return f"{name_}[{i}]" + (f" {path}" if path else "")

        return _Split(lambda i: (table[i][image_key], table[i][label_key]), describe, len(table))

    return split(train_split), split(eval_split), dict(enumerate(names))


def build_data(dataset: str, image_size: int, augment: dict[str, Any], data_dir: str | None = None,
               train_split: str = "train", eval_split: str = "test",
               max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION, bad_sample_log: Path | None = None,
               ) -> ClassificationData:
    """Train and held-out datasets with their transforms, and ``id2label``."""
    if dataset == "digits":
        train, held_out, id2label = _digits(image_size, train_split, eval_split)
    elif dataset in ("fashion_mnist", "fashion-mnist"):
        from polar_vit_hf.training.fashion_mnist import load_fashion_mnist

        train, held_out, id2label = _hf(dataset, load_fashion_mnist(data_dir), train_split, eval_split)
    else:
        train, held_out, id2label = _hf(dataset, _load_hf(dataset, data_dir), train_split, eval_split)

    def wrap(split: _Split, is_train: bool) -> TransformedDataset:
        return TransformedDataset(split.length, split.get, build_transforms(image_size, augment, train=is_train),
                                  split.describe, max_bad_fraction, bad_sample_log)

    return ClassificationData(wrap(train, True), wrap(held_out, False), id2label)


def unique_bad_samples(log: Path) -> list[str]:
    """The distinct entries of a ``bad_samples.txt`` (each unreadable file once, in first-seen order)."""
    if not log.exists():
        return []
    return list(dict.fromkeys(line.rstrip("\n") for line in log.read_text().splitlines() if line.strip()))
