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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, IterableDataset

from polar_vit_hf.cli import UserError
from polar_vit_hf.modeling.image_processing_polar_vit import to_eight_bit

if TYPE_CHECKING:
    from polar_vit_hf.training.official_data import DataOptions

# what decoding a broken image raises: PIL.UnidentifiedImageError and truncated files are OSErrors, some
# decoders raise ValueError / SyntaxError
BAD_IMAGE_ERRORS = (OSError, ValueError, SyntaxError)
DEFAULT_MAX_BAD_FRACTION = 0.01
MIN_READS_FOR_THRESHOLD = 100  # the fraction of bad images is judged once this many have been read


class BadSampleError(UserError):
    """Too many unreadable images: the data set itself is broken."""


STREAM_SHUFFLE_BUFFER = 10_000  # examples in the shuffle buffer of a streamed training split


def digits_images(image_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """All digits as uint8 RGB arrays ``(1797, S, S, 3)`` and labels, upsampled bilinearly."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    big = F.interpolate(grey, size=(image_size, image_size), mode="bilinear", align_corners=False)
    rgb = (big.clamp(0, 1) * 255.0).round().to(torch.uint8).repeat(1, 3, 1, 1).permute(0, 2, 3, 1)
    return rgb.numpy(), digits.target.astype(np.int64)


def digits_split_indices(
    count: int = 1797, test_fraction: float = 0.25, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)`` indices of the seeded digits split used everywhere in the project."""
    order = np.random.default_rng(seed).permutation(count)
    n_test = int(round(test_fraction * count))
    return order[n_test:], order[:n_test]


def to_rgb(image: Image.Image) -> Image.Image:
    """Decode ``image`` and convert it to 8-bit RGB (greyscale, palette, RGBA, CMYK; 16-bit and float images by
    the image processor's :func:`to_eight_bit`).

    Raises ``ValueError`` for a zero-size image and what PIL raises for an undecodable one.
    """
    image.load()  # decode now: a broken file fails here, inside the bad-sample guard
    if image.width == 0 or image.height == 0:
        raise ValueError(f"zero-size image ({image.width} x {image.height})")
    return to_eight_bit(image).convert("RGB")


@dataclass
class ClassificationData:
    train: Dataset
    eval: Dataset
    id2label: dict[int, str]


class BadSampleGuard:
    """Counts reads and unreadable images of one process: a warning and a line in ``bad_sample_log`` per bad
    image, :class:`BadSampleError` once more than ``max_bad_fraction`` of the reads failed.  The fraction is judged
    after ``MIN_READS_FOR_THRESHOLD`` reads in all; each of ``W`` DataLoader workers reads its share of the
    (shuffled) data and judges its own fraction after ``MIN_READS_FOR_THRESHOLD / W`` reads."""

    def __init__(self, max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION, bad_sample_log: Path | None = None):
        self.max_bad_fraction, self.bad_sample_log = float(max_bad_fraction), bad_sample_log
        self.reads = self.bad = 0

    @staticmethod
    def min_reads() -> int:
        """Reads before this process judges its fraction (its share of ``MIN_READS_FOR_THRESHOLD``)."""
        worker = torch.utils.data.get_worker_info()
        return max(1, MIN_READS_FOR_THRESHOLD // (worker.num_workers if worker is not None else 1))

    def read(self) -> None:
        self.reads += 1

    def skip(self, where: str, error: Exception) -> None:
        self.bad += 1
        reason = f"{type(error).__name__}: {error}".replace("\n", " ")
        warnings.warn(f"skipping an unreadable image ({where}): {reason}", stacklevel=3)
        if self.bad_sample_log is not None:
            with open(self.bad_sample_log, "a") as handle:
                handle.write(f"{where}\t{reason}\n")
        if self.reads >= self.min_reads() and self.bad > self.max_bad_fraction * self.reads:
            raise BadSampleError(
                f"{self.bad} of the last {self.reads} images read could not be decoded (more than "
                f"{self.max_bad_fraction:.1%}): the data set looks broken. The files are listed in "
                f"{self.bad_sample_log}; repair or remove them, or allow more with --max_bad_fraction"
            )


class TransformedDataset(Dataset):
    """``(image, label)`` pairs from ``get(index)``, images converted to RGB and passed through ``transform``.

    An unreadable image is skipped: the next readable index takes its place (deterministic), a
    warning names it (``describe(index)``, e.g. its path) and a line goes to ``bad_sample_log``
    when set (:class:`BadSampleGuard`).
    """

    def __init__(
        self,
        length: int,
        get: Callable[[int], tuple[Image.Image, int]],
        transform: Callable,
        describe: Callable[[int], str] | None = None,
        max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
        bad_sample_log: Path | None = None,
    ):
        self.length, self.get, self.transform = length, get, transform
        self.describe = describe or (lambda index: f"index {index}")
        self.max_bad_fraction, self.bad_sample_log = float(max_bad_fraction), bad_sample_log
        self.guard = BadSampleGuard(max_bad_fraction, bad_sample_log)

    def with_transform(self, transform: Callable) -> TransformedDataset:
        """The same images through another transform."""
        return TransformedDataset(
            self.length, self.get, transform, self.describe, self.max_bad_fraction, self.bad_sample_log
        )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        for offset in range(self.length):
            position = (int(index) + offset) % self.length
            self.guard.read()
            try:
                image, label = self.get(position)
                image = to_rgb(image)
            except BAD_IMAGE_ERRORS as error:
                self.guard.skip(self.describe(position), error)
                continue
            return self.transform(image), int(label)
        raise BadSampleError(f"none of the {self.length} images could be read; see {self.bad_sample_log}")


class TransformedStream(IterableDataset):
    """A streamed split (``datasets.IterableDataset``) as ``(image, label)`` pairs through ``transform``; an
    unreadable image is skipped (:class:`BadSampleGuard`).  ``set_epoch`` reshuffles the stream's buffer."""

    def __init__(
        self,
        table,
        image_key: str,
        label_key: str,
        transform: Callable,
        name: str,
        max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
        bad_sample_log: Path | None = None,
    ):
        self.table, self.image_key, self.label_key, self.transform, self.name = (
            table,
            image_key,
            label_key,
            transform,
            name,
        )
        self.max_bad_fraction, self.bad_sample_log = float(max_bad_fraction), bad_sample_log
        self.guard = BadSampleGuard(max_bad_fraction, bad_sample_log)

    def with_transform(self, transform: Callable) -> TransformedStream:
        """The same stream through another transform."""
        return TransformedStream(
            self.table,
            self.image_key,
            self.label_key,
            transform,
            self.name,
            self.max_bad_fraction,
            self.bad_sample_log,
        )

    def set_epoch(self, epoch: int) -> None:
        self.table.set_epoch(epoch)

    def __iter__(self):
        for position, example in enumerate(self.table):
            self.guard.read()
            try:
                image = to_rgb(example[self.image_key])
            except BAD_IMAGE_ERRORS as error:
                self.guard.skip(f"{self.name} stream position {position}", error)
                continue
            yield self.transform(image), int(example[self.label_key])


RANDAUGMENT_LEVELS = 10  # RandAugment's magnitude scale in the recipes: 0..10 (big_vision, timm's "m10" = the maximum)
TORCHVISION_RANDAUGMENT_BINS = 31  # torchvision's RandAugment magnitudes run 0..30


def randaugment_magnitude(level: float) -> int:
    """torchvision's RandAugment ``magnitude`` (of 31 bins, 0..30) for a magnitude on the recipes' 0..10 scale:
    ``level 10`` (big_vision's ``randaug(2, 10)``) is torchvision's maximum, 30."""
    if not 0 <= level <= RANDAUGMENT_LEVELS:
        raise ValueError(f"augment.randaugment_magnitude={level} is outside 0..{RANDAUGMENT_LEVELS}")
    return int(round(level / RANDAUGMENT_LEVELS * (TORCHVISION_RANDAUGMENT_BINS - 1)))


def build_transforms(image_size: int, augment: dict[str, Any], train: bool):
    """torchvision v2 pipeline; images end as float tensors normalised with mean = std = 0.5.

    Training: ``random_resized_crop`` (Inception crop of at least ``crop_min_scale`` of the area; default 0.08,
    0.5 for images of 64 pixels or less) or a resize (then a ``random_crop_padding`` padded random crop),
    ``horizontal_flip``, ``auto_augment`` (``autoaugment`` with ``autoaugment_policy`` imagenet / cifar10 / svhn,
    or ``randaugment`` with ``randaugment_ops`` operations of ``randaugment_magnitude`` on the 0..10 scale),
    ``random_erasing`` (erased areas up to ``random_erasing_max_area``).  Evaluation: with ``eval_resize`` the
    short side is resized to it and the centre ``image_size`` square cropped (ImageNet's resize-256 /
    centre-crop-224), else the image is resized to ``image_size`` square.
    """
    from torchvision.transforms import v2

    steps: list = []
    if train and augment.get("random_resized_crop"):
        low = float(augment.get("crop_min_scale") or (0.08 if image_size > 64 else 0.5))
        steps.append(v2.RandomResizedCrop(image_size, scale=(low, 1.0), antialias=True))
    elif not train and augment.get("eval_resize"):
        steps += [v2.Resize(int(augment["eval_resize"]), antialias=True), v2.CenterCrop(image_size)]
    else:
        steps.append(v2.Resize((image_size, image_size), antialias=True))
        if train and augment.get("random_crop_padding"):  # CIFAR's RandomCrop(32, padding=4)
            steps.append(v2.RandomCrop(image_size, padding=int(augment["random_crop_padding"])))
    if train and augment.get("horizontal_flip"):
        steps.append(v2.RandomHorizontalFlip())
    policy = augment.get("auto_augment") if train else None
    if policy == "autoaugment":
        name = str(augment.get("autoaugment_policy", "imagenet")).upper()
        if name not in v2.AutoAugmentPolicy.__members__:
            raise ValueError(
                f"augment.autoaugment_policy={name.lower()!r} is not one of "
                f"{[m.lower() for m in v2.AutoAugmentPolicy.__members__]}"
            )
        steps.append(v2.AutoAugment(v2.AutoAugmentPolicy[name]))
    elif policy == "randaugment":
        magnitude = randaugment_magnitude(float(augment.get("randaugment_magnitude", RANDAUGMENT_LEVELS)))
        steps.append(
            v2.RandAugment(
                num_ops=int(augment.get("randaugment_ops", 2)),
                magnitude=magnitude,
                num_magnitude_bins=TORCHVISION_RANDAUGMENT_BINS,
            )
        )
    elif policy:
        raise ValueError(f"augment.auto_augment={policy!r} is not one of null, 'autoaugment', 'randaugment'")
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.5] * 3)]
    if train and float(augment.get("random_erasing", 0.0)) > 0:
        largest = float(augment.get("random_erasing_max_area", 0.33))  # torchvision's default scale (0.02, 0.33)
        steps.append(v2.RandomErasing(p=float(augment["random_erasing"]), scale=(0.02, largest)))
    return v2.Compose(steps)


def build_mixup(augment: dict[str, Any], num_classes: int):
    """timm's Mixup/CutMix (with label smoothing) or ``None`` when both are off."""
    mixup, cutmix = float(augment.get("mixup", 0.0)), float(augment.get("cutmix", 0.0))
    if mixup <= 0 and cutmix <= 0:
        return None
    from timm.data import Mixup

    return Mixup(
        mixup_alpha=mixup,
        cutmix_alpha=cutmix,
        prob=float(augment.get("mix_prob", 1.0)),
        switch_prob=0.5,
        label_smoothing=float(augment.get("label_smoothing", 0.0)),
        num_classes=num_classes,
    )


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


def _digits(
    image_size: int, train_split: str = "train", eval_split: str = "test"
) -> tuple[_Split, _Split, dict[int, str]]:
    images, labels = digits_images(image_size)
    splits = digits_splits(len(labels))
    for name in (train_split, eval_split):
        if name not in splits:
            raise UserError(f"dataset 'digits' has no split {name!r}; it has {sorted(splits)}")

    def split(indices) -> _Split:
        return _Split(
            lambda i: (Image.fromarray(images[indices[i]]), int(labels[indices[i]])),
            lambda i: f"digits image {indices[i]}",
            len(indices),
        )

    return split(splits[train_split]), split(splits[eval_split]), {i: str(i) for i in range(10)}


def _hf(
    name: str,
    loaded,
    train_split: str,
    eval_split: str,
    label_column: str | None = None,
) -> tuple[_Split | IterableDataset, _Split | IterableDataset, dict[int, str]]:
    """The two splits of a loaded ``datasets.DatasetDict`` (or a streamed ``IterableDatasetDict``): the image
    and label columns chosen by name (:func:`official_data.image_column`, :func:`official_data.label_column`)."""
    from polar_vit_hf.training.official_data import image_column, label_column as choose_label

    for split in (train_split, eval_split):
        if split not in loaded:
            raise UserError(
                f"dataset {name!r} has no split {split!r}; it has {sorted(loaded)} "
                f"(choose with --train_split / --eval_split)"
            )
    features = loaded[train_split].features
    if features is None:
        raise UserError(
            f"dataset {name!r}: its streamed features are unknown, so the image and label columns "
            f"cannot be chosen; load it without --streaming once to cache its metadata"
        )
    image_key, label_key = image_column(features, name), choose_label(features, name, label_column)
    names = features[label_key].names

    def split(name_: str) -> _Split | IterableDataset:
        table = loaded[name_]
        if not hasattr(table, "__len__"):  # streamed
            return StreamedSplit(table, image_key, label_key, name_)
        paths = _image_paths(table, image_key)

        def describe(i: int) -> str:
            return f"{name_}[{i}]" + (f" {paths[i]}" if paths[i] else "")

        return _Split(lambda i: (table[i][image_key], table[i][label_key]), describe, len(table))

    return split(train_split), split(eval_split), dict(enumerate(names))


def _image_paths(table, image_key: str) -> list[str | None]:
    """The file behind every image of a split (for messages), read without decoding."""
    import datasets

    undecoded = table.with_format(None).cast_column(image_key, datasets.Image(decode=False))
    return [item.get("path") if isinstance(item, dict) else None for item in undecoded[image_key]]


@dataclass
class StreamedSplit:
    """A streamed split: ``(image, label)`` pairs in the stream's order (:class:`TransformedStream`)."""

    table: Any
    image_key: str
    label_key: str
    name: str


def build_data(
    dataset: str,
    image_size: int,
    augment: dict[str, Any],
    data_dir: str | None = None,
    train_split: str = "train",
    eval_split: str = "test",
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    bad_sample_log: Path | None = None,
    options: DataOptions | None = None,
    label_column: str | None = None,
    seed: int = 0,
) -> ClassificationData:
    """Train and held-out datasets with their transforms, and ``id2label``.

    ``dataset`` is ``digits``, ``fashion_mnist``, ``webdataset``, an official layout under ``data_dir``
    (``cub``, ``aircraft``, ``imagenet-1k``: :mod:`official_data`) or a Hub name / alias; ``options`` carries
    the dataset flags (annotation level, banner, bounding-box crop, streaming).  A streamed training split is
    shuffled with ``seed`` in a buffer (deterministic for a given seed and stream).
    """
    from polar_vit_hf.training.official_data import DataOptions, load, summary

    options = options or DataOptions(dataset, data_dir)
    if dataset == "digits":
        train, held_out, id2label = _digits(image_size, train_split, eval_split)
    elif dataset in ("fashion_mnist", "fashion-mnist"):
        from polar_vit_hf.training.fashion_mnist import load_fashion_mnist

        train, held_out, id2label = _hf(dataset, load_fashion_mnist(data_dir), train_split, eval_split)
    elif dataset == "imagefolder":
        train, held_out, id2label = _hf(dataset, _imagefolder(data_dir), train_split, eval_split, label_column)
    else:
        loaded = load(options)
        print(summary(dataset, loaded), flush=True)
        train, held_out, id2label = _hf(dataset, loaded, train_split, eval_split, label_column)

    def wrap(split: _Split | StreamedSplit, is_train: bool) -> Dataset:
        transform = build_transforms(image_size, augment, train=is_train)
        if isinstance(split, StreamedSplit):
            table = split.table.shuffle(seed=seed, buffer_size=STREAM_SHUFFLE_BUFFER) if is_train else split.table
            return TransformedStream(
                table, split.image_key, split.label_key, transform, split.name, max_bad_fraction, bad_sample_log
            )
        return TransformedDataset(split.length, split.get, transform, split.describe, max_bad_fraction, bad_sample_log)

    return ClassificationData(wrap(train, True), wrap(held_out, False), id2label)


def _imagefolder(data_dir: str | None):
    """``datasets.load_dataset("imagefolder")`` with the user's mistakes turned into :class:`UserError`."""
    import datasets

    if not data_dir:
        raise UserError("dataset 'imagefolder' needs --data_dir DIR (layout: DIR/<split>/<label>/<image>)")
    if not Path(data_dir).is_dir():
        raise UserError(f"--data_dir {data_dir}: no such directory (an imagefolder is DIR/<split>/<label>/<image>)")
    try:
        return datasets.load_dataset("imagefolder", data_dir=data_dir)
    except FileNotFoundError as error:  # EmptyDatasetError is one
        raise UserError(
            f"--data_dir {data_dir}: no images found ({error}); expected DIR/<split>/<label>/<image>"
        ) from None


def unique_bad_samples(log: Path) -> list[str]:
    """The distinct entries of a ``bad_samples.txt`` (each unreadable file once, in first-seen order)."""
    if not log.exists():
        return []
    return list(dict.fromkeys(line.rstrip("\n") for line in log.read_text().splitlines() if line.strip()))
