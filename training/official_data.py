"""The mission's datasets in the layouts researchers download them: CUB-200-2011, FGVC-Aircraft 2013b,
ImageNet-1k (ILSVRC2012), webdataset tar shards, and the Hub aliases.

Every loader returns a :class:`datasets.DatasetDict` with an ``image`` column (:class:`datasets.Image`) and a
``label`` column (:class:`datasets.ClassLabel` with the real class names), plus the dataset's own extras:

* :func:`load_cub` - ``CUB_200_2011/`` as extracted from ``CUB_200_2011.tgz``: splits ``train`` (5,994) and
  ``test`` (5,794) from ``train_test_split.txt``, 200 species named from ``classes.txt``
  (``001.Black_footed_Albatross`` -> ``Black footed Albatross``), extras ``image_id`` and ``bbox``
  (``x, y, width, height`` from ``bounding_boxes.txt``); ``crop_to_bbox=True`` crops every image to its box.
* :func:`load_aircraft` - ``fgvc-aircraft-2013b/data/`` as extracted from ``fgvc-aircraft-2013b.tar.gz``:
  splits ``train`` (3,334), ``val`` (3,333), ``trainval`` (6,667) and ``test`` (3,333) from
  ``images_<annotation>_<split>.txt``, labels at the ``variant`` (100, default), ``family`` (70) or
  ``manufacturer`` (30) level in the order of ``variants.txt`` / ``families.txt`` / ``manufacturers.txt``,
  the other levels as extra columns, ``image_id`` (7-digit strings) and ``bbox`` (``xmin, ymin, xmax, ymax``
  from ``images_box.txt``).  The dataset's standard protocol removes the 20-pixel copyright banner at the
  bottom of every image: done on decoding unless ``keep_banner=True``.
* :func:`load_imagenet` - ILSVRC2012 as extracted: ``train/<wnid>/*.JPEG`` and the flat
  ``val/ILSVRC2012_val_*.JPEG`` (or ``val/<wnid>/``) labelled from the devkit
  (``ILSVRC2012_devkit_t12/data/meta.mat`` read by scipy's ``loadmat`` and
  ``ILSVRC2012_validation_ground_truth.txt``, or the devkit ``.tar.gz`` itself); splits ``train`` (1,281,167)
  and ``validation`` (50,000); labels in the standard sorted-wnid order, named by the synsets' words
  (``tench, Tinca tinca``), so ``id2label`` matches every other ImageNet-1k checkpoint; extra ``wnid``.
* :func:`load_webdataset` - tar shards with ``jpg`` and ``cls`` members through ``datasets``' webdataset
  builder (``shards/imagenet-{train-{0000..1023},validation-{00..63}}.tar``, split by file name as ``datasets``
  does), optionally streamed.
* :func:`load_hub` - a Hub dataset by name or alias (``cub``, ``aircraft``, ``cifar100``, ...), the label column
  chosen by name (:data:`HUB_ALIASES` holds each alias's documented fine label), optionally streamed.

Every mistake in a layout is a :class:`LayoutError` (a one-line user error, exit status 2) naming the file
and line: a missing file, an id in a split file with no image, a class id or name out of range, a truncated
devkit, a shard without ``cls``.
"""

from __future__ import annotations

import argparse
import os
import re
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import datasets
from PIL import Image

from polar_vit_hf.cli import UserError

AIRCRAFT_BANNER_PIXELS = 20  # the copyright banner at the bottom of every FGVC-Aircraft image
AIRCRAFT_ANNOTATIONS = {"variant": "variants.txt", "family": "families.txt", "manufacturer": "manufacturers.txt"}
AIRCRAFT_SPLITS = ("train", "val", "trainval", "test")
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png", ".bmp", ".tif", ".tiff", ".webp"}
DEVKIT = "ILSVRC2012_devkit_t12"


class LayoutError(UserError):
    """A dataset on disk that does not have the official layout (names the file and, where it applies, the line)."""


@dataclass(frozen=True)
class HubAlias:
    """A short ``--dataset`` name for a Hub dataset: its repository and its documented fine-label column."""

    repo: str
    label_column: str
    image_column: str = "image"
    local_layout: str | None = None  # what to pass with --data_dir instead, for the error message offline


HUB_ALIASES = {
    "cub": HubAlias(
        "bentrevett/caltech-ucsd-birds-200-2011",
        "label",
        local_layout="--dataset cub --data_dir ROOT with ROOT/CUB_200_2011/images.txt (from CUB_200_2011.tgz)",
    ),
    "aircraft": HubAlias(
        "HuggingFaceM4/FGVC-Aircraft",
        "variant",
        local_layout="--dataset aircraft --data_dir ROOT with ROOT/fgvc-aircraft-2013b/data/"
        "images_variant_trainval.txt (from fgvc-aircraft-2013b.tar.gz)",
    ),
    "imagenet-1k": HubAlias(
        "ILSVRC/imagenet-1k",
        "label",
        local_layout="--dataset imagenet-1k --data_dir ROOT with ROOT/train/<wnid>/, ROOT/val/ "
        "and ROOT/ILSVRC2012_devkit_t12(.tar.gz)",
    ),
    "cifar100": HubAlias("uoft-cs/cifar100", "fine_label", "img"),
    "cifar10": HubAlias("uoft-cs/cifar10", "label", "img"),
    "tiny-imagenet": HubAlias("zh-plus/tiny-imagenet", "label"),
}
ALIAS_NAMES = {
    "imagenet1k": "imagenet-1k",
    "imagenet": "imagenet-1k",
    "fgvc-aircraft": "aircraft",
    "cub-200-2011": "cub",
    "cub200": "cub",
}


def canonical_name(name: str) -> str:
    """The alias a ``--dataset`` name stands for (``imagenet1k`` -> ``imagenet-1k``), or the name itself."""
    return ALIAS_NAMES.get(name.lower(), name.lower() if name.lower() in HUB_ALIASES else name)


# --------------------------------------------------------------------------------------------
# reading the annotation files
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One line of an annotation file: where it is and its fields."""

    path: Path
    line: int
    fields: tuple[str, ...]

    def error(self, problem: str) -> LayoutError:
        """``LayoutError("PATH:LINE: problem")``."""
        return LayoutError(f"{self.path}:{self.line}: {problem}")

    def integer(self, index: int, what: str) -> int:
        try:
            return int(self.fields[index])
        except ValueError:
            raise self.error(f"{what} {self.fields[index]!r} is not an integer") from None

    def number(self, index: int, what: str) -> float:
        try:
            return float(self.fields[index])
        except ValueError:
            raise self.error(f"{what} {self.fields[index]!r} is not a number") from None


def read_rows(path: Path, fields: int, description: str, last_takes_rest: bool = False) -> list[Row]:
    """The non-empty lines of ``path`` split on whitespace into ``fields`` fields (the last one keeps its spaces
    with ``last_takes_rest``, e.g. aircraft names such as ``Cessna 172``); ``description`` names the format in
    errors."""
    if not path.is_file():
        raise LayoutError(f"{path}: missing ({description})")
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            text = text.strip()
            if not text:
                continue
            parts = text.split(None, fields - 1) if last_takes_rest else text.split()
            if len(parts) != fields:
                raise LayoutError(f"{path}:{number}: expected {description}, got {text!r}")
            rows.append(Row(path, number, tuple(parts)))
    if not rows:
        raise LayoutError(f"{path}: empty (expected {description})")
    return rows


def keyed(rows: list[Row], what: str) -> dict[str, Row]:
    """``{first field: row}``; a repeated key is an error."""
    table: dict[str, Row] = {}
    for row in rows:
        if row.fields[0] in table:
            raise row.error(f"{what} {row.fields[0]} appears twice (first on line {table[row.fields[0]].line})")
        table[row.fields[0]] = row
    return table


def _first_existing(*candidates: Path) -> Path | None:
    return next((path for path in candidates if path.exists()), None)


def _image_features(label_names: list[str], **extras: datasets.features.FeatureType) -> datasets.Features:
    return datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=label_names), **extras})


def _dataset(columns: dict[str, list], features: datasets.Features) -> datasets.Dataset:
    return datasets.Dataset.from_dict(columns, features=features)


def with_image_transform(
    data: datasets.DatasetDict,
    crop: Callable[[Image.Image, dict], Image.Image],
) -> datasets.DatasetDict:
    """Every split decoding its images through ``crop(image, row)`` (``datasets``' ``set_transform``: applied on
    access, so the arrow table keeps the files as they are)."""

    def transform(batch: dict[str, list]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        batch["image"] = [crop(row["image"], row) for row in rows]
        return batch

    for split in data.values():
        split.set_transform(transform)
    return data


# --------------------------------------------------------------------------------------------
# CUB-200-2011
# --------------------------------------------------------------------------------------------
def cub_root(root: str | os.PathLike) -> Path | None:
    """The ``CUB_200_2011`` folder in ``root`` (or ``root`` itself), or ``None``."""
    root = Path(root)
    return next((p for p in (root / "CUB_200_2011", root) if (p / "images.txt").is_file()), None)


def cub_class_name(folder_name: str) -> str:
    """``001.Black_footed_Albatross`` -> ``Black footed Albatross``."""
    return folder_name.split(".", 1)[-1].replace("_", " ")


def _crop_to_bbox(image: Image.Image, row: dict) -> Image.Image:
    x, y, width, height = row["bbox"]
    return image.crop((int(round(x)), int(round(y)), int(round(x + width)), int(round(y + height))))


def load_cub(root: str | os.PathLike, crop_to_bbox: bool = False) -> datasets.DatasetDict:
    """CUB-200-2011 from its official files (module docstring): ``train`` / ``test`` with ``image``, ``label``
    (200 species), ``image_id`` and ``bbox`` (``x, y, width, height``)."""
    base = cub_root(root)
    if base is None:
        raise LayoutError(f"{root}: no CUB_200_2011/images.txt (extract CUB_200_2011.tgz there)")
    classes = read_rows(base / "classes.txt", 2, "'<class id> <NNN.Name>'")
    names = []
    for expected, row in enumerate(classes, start=1):
        if row.integer(0, "class id") != expected:
            raise row.error(f"class ids must run 1, 2, ... in order; expected {expected}")
        names.append(cub_class_name(row.fields[1]))
    images = keyed(read_rows(base / "images.txt", 2, "'<image id> <relative path>'"), "image id")
    tables = {
        "labels": keyed(read_rows(base / "image_class_labels.txt", 2, "'<image id> <class id>'"), "image id"),
        "split": keyed(read_rows(base / "train_test_split.txt", 2, "'<image id> <1 train | 0 test>'"), "image id"),
        "bbox": keyed(read_rows(base / "bounding_boxes.txt", 5, "'<image id> <x> <y> <width> <height>'"), "image id"),
    }
    for table in tables.values():  # ids that name no image
        for key, row in table.items():
            if key not in images:
                raise row.error(f"image id {key} is not in {base / 'images.txt'}")
    columns = {split: {"image": [], "label": [], "image_id": [], "bbox": []} for split in ("train", "test")}
    for key, row in images.items():
        path = base / "images" / row.fields[1]
        if not path.is_file():
            raise row.error(f"image id {key}: no file {path}")
        for table in tables.values():
            if key not in table:
                raise row.error(f"image id {key} has no line in {next(iter(table.values())).path}")
        label_row, split_row, box_row = tables["labels"][key], tables["split"][key], tables["bbox"][key]
        label = label_row.integer(1, "class id")
        if not 1 <= label <= len(names):
            raise label_row.error(f"class id {label} is outside 1..{len(names)} (classes.txt)")
        flag = split_row.fields[1]
        if flag not in ("0", "1"):
            raise split_row.error(f"is_training_image must be 1 or 0, got {flag!r}")
        target = columns["train" if flag == "1" else "test"]
        target["image"].append(str(path))
        target["label"].append(label - 1)
        target["image_id"].append(int(key))
        target["bbox"].append([box_row.number(i, "bounding box coordinate") for i in range(1, 5)])
    features = _image_features(
        names, image_id=datasets.Value("int32"), bbox=datasets.List(datasets.Value("float32"), length=4)
    )
    data = datasets.DatasetDict({split: _dataset(cols, features) for split, cols in columns.items()})
    return with_image_transform(data, _crop_to_bbox) if crop_to_bbox else data


# --------------------------------------------------------------------------------------------
# FGVC-Aircraft 2013b
# --------------------------------------------------------------------------------------------
def aircraft_root(root: str | os.PathLike) -> Path | None:
    """The ``data`` folder of FGVC-Aircraft in ``root`` (``fgvc-aircraft-2013b/data``, ``data`` or ``root``)."""
    root = Path(root)
    return next(
        (
            p
            for p in (root / "fgvc-aircraft-2013b" / "data", root / "data", root)
            if (p / "images").is_dir() and (p / "variants.txt").is_file()
        ),
        None,
    )


def remove_banner(image: Image.Image, row: dict | None = None) -> Image.Image:
    """The image without its bottom ``AIRCRAFT_BANNER_PIXELS`` rows (the FGVC-Aircraft copyright banner)."""
    if image.height <= AIRCRAFT_BANNER_PIXELS:
        raise ValueError(f"image of height {image.height} has no room for the {AIRCRAFT_BANNER_PIXELS}-pixel banner")
    return image.crop((0, 0, image.width, image.height - AIRCRAFT_BANNER_PIXELS))


def _aircraft_level(base: Path, level: str, split: str, names: list[str]) -> dict[str, tuple[Row, int]]:
    """``{image id: (row, class index)}`` of ``images_<level>_<split>.txt``."""
    index = {name: i for i, name in enumerate(names)}
    rows = read_rows(base / f"images_{level}_{split}.txt", 2, f"'<image id> <{level} name>'", last_takes_rest=True)
    out = {}
    for key, row in keyed(rows, "image id").items():
        if row.fields[1] not in index:
            raise row.error(f"{level} {row.fields[1]!r} is not in {base / AIRCRAFT_ANNOTATIONS[level]}")
        out[key] = (row, index[row.fields[1]])
    return out


def load_aircraft(
    root: str | os.PathLike,
    annotation: str = "variant",
    keep_banner: bool = False,
) -> datasets.DatasetDict:
    """FGVC-Aircraft 2013b from its official files (module docstring): ``train`` / ``val`` / ``trainval`` /
    ``test`` with ``image``, ``label`` (at the ``annotation`` level), the other levels whose files are there,
    ``image_id`` and ``bbox`` (``xmin, ymin, xmax, ymax``); the banner removed unless ``keep_banner``."""
    if annotation not in AIRCRAFT_ANNOTATIONS:
        raise UserError(f"--annotation {annotation}: expected one of {', '.join(AIRCRAFT_ANNOTATIONS)}")
    base = aircraft_root(root)
    if base is None:
        raise LayoutError(
            f"{root}: no fgvc-aircraft-2013b/data/ with images/ and variants.txt (extract "
            f"fgvc-aircraft-2013b.tar.gz there)"
        )
    names = {}
    for level, filename in AIRCRAFT_ANNOTATIONS.items():
        if level == annotation or (base / filename).is_file():
            names[level] = [
                row.fields[0] for row in read_rows(base / filename, 1, "one class name per line", last_takes_rest=True)
            ]
    levels = [annotation] + [
        level
        for level in names
        if level != annotation and all((base / f"images_{level}_{s}.txt").is_file() for s in AIRCRAFT_SPLITS)
    ]
    boxes = keyed(read_rows(base / "images_box.txt", 5, "'<image id> <xmin> <ymin> <xmax> <ymax>'"), "image id")
    features = _image_features(
        names[annotation],
        image_id=datasets.Value("string"),
        bbox=datasets.List(datasets.Value("float32"), length=4),
        **{level: datasets.ClassLabel(names=names[level]) for level in levels[1:]},
    )
    data = {}
    for split in AIRCRAFT_SPLITS:
        labels = {level: _aircraft_level(base, level, split, names[level]) for level in levels}
        columns = {name: [] for name in features}
        for key, (row, label) in labels[annotation].items():
            path = base / "images" / f"{key}.jpg"
            if not path.is_file():
                raise row.error(f"image id {key}: no file {path}")
            if key not in boxes:
                raise row.error(f"image id {key} has no line in {base / 'images_box.txt'}")
            columns["image"].append(str(path))
            columns["label"].append(label)
            columns["image_id"].append(key)
            columns["bbox"].append([boxes[key].number(i, "box coordinate") for i in range(1, 5)])
            for level in levels[1:]:
                if key not in labels[level]:
                    raise row.error(f"image id {key} has no line in {base / f'images_{level}_{split}.txt'}")
                columns[level].append(labels[level][key][1])
        data[split] = _dataset(columns, features)
    data = datasets.DatasetDict(data)
    return data if keep_banner else with_image_transform(data, remove_banner)


# --------------------------------------------------------------------------------------------
# ImageNet-1k (ILSVRC2012)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageNetMeta:
    """The devkit's leaf synsets: ``wnids`` in the standard sorted order, their ``words`` (class names), and the
    wnid of every validation image in file order (``None`` without the devkit's ground truth)."""

    wnids: list[str]
    words: dict[str, str]
    validation_wnids: list[str] | None


def imagenet_root(root: str | os.PathLike) -> Path | None:
    """``root`` when it holds ``train/`` or ``val/`` with the ILSVRC2012 layout, else ``None``."""
    root = Path(root)
    return root if (root / "train").is_dir() or (root / "val").is_dir() else None


def _read_devkit(devkit: Path) -> ImageNetMeta:
    """``meta.mat`` (scipy's ``loadmat``; the 1,000 synsets without children) and the validation ground truth."""
    from scipy.io import loadmat
    from scipy.io.matlab import MatReadError

    meta_path = devkit / "data" / "meta.mat"
    if not meta_path.is_file():
        raise LayoutError(f"{meta_path}: missing (the devkit is incomplete: extract ILSVRC2012_devkit_t12.tar.gz)")
    try:
        synsets = loadmat(str(meta_path), squeeze_me=True)["synsets"]
        records = [(int(s["ILSVRC2012_ID"]), str(s["WNID"]), str(s["words"]), int(s["num_children"])) for s in synsets]
    except (MatReadError, ValueError, KeyError, TypeError, OSError) as error:
        raise LayoutError(
            f"{meta_path}: not a readable ILSVRC2012 meta.mat (truncated?): {type(error).__name__}: {error}"
        ) from None
    leaves = [(index, wnid, words) for index, wnid, words, children in records if children == 0]
    id_to_wnid = {index: wnid for index, wnid, _ in leaves}
    truth_path = devkit / "data" / "ILSVRC2012_validation_ground_truth.txt"
    validation = None
    if truth_path.is_file():
        validation = []
        for row in read_rows(truth_path, 1, "one ILSVRC2012_ID per line"):
            index = row.integer(0, "ILSVRC2012_ID")
            if index not in id_to_wnid:
                raise row.error(f"ILSVRC2012_ID {index} is not a leaf synset of {meta_path}")
            validation.append(id_to_wnid[index])
    return ImageNetMeta(sorted(id_to_wnid.values()), {wnid: words for _, wnid, words in leaves}, validation)


def read_devkit(root: Path) -> ImageNetMeta | None:
    """The devkit in ``root``: the extracted ``ILSVRC2012_devkit_t12/`` folder or ``ILSVRC2012_devkit_t12.tar.gz``
    (read without extracting it next to the data), or ``None`` when there is neither."""
    folder = root / DEVKIT
    if folder.is_dir():
        return _read_devkit(folder)
    archive = _first_existing(root / f"{DEVKIT}.tar.gz", root / f"{DEVKIT}.tar")
    if archive is None:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        try:
            with tarfile.open(archive) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(f"{DEVKIT}/data/")]
                tar.extractall(scratch, members=members, filter="data")
        except (tarfile.TarError, EOFError, OSError) as error:
            raise LayoutError(f"{archive}: not a readable devkit archive (truncated?): {error}") from None
        return _read_devkit(Path(scratch) / DEVKIT)


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _class_folders(folder: Path) -> dict[str, list[Path]]:
    return {child.name: _images_in(child) for child in sorted(folder.iterdir()) if child.is_dir()}


def load_imagenet(root: str | os.PathLike) -> datasets.DatasetDict:
    """ILSVRC2012 as extracted (module docstring): ``train`` and ``validation`` with ``image``, ``label`` (sorted
    wnid order, named by the synsets' words) and ``wnid``."""
    root = Path(root)
    if imagenet_root(root) is None:
        raise LayoutError(
            f"{root}: no train/ or val/ folder (the ILSVRC2012 layout: train/<wnid>/*.JPEG, "
            f"val/ILSVRC2012_val_*.JPEG, {DEVKIT}/)"
        )
    meta = read_devkit(root)
    splits: dict[str, list[tuple[Path, str]]] = {}
    if (root / "train").is_dir():
        splits["train"] = [(path, wnid) for wnid, paths in _class_folders(root / "train").items() for path in paths]
    if (root / "val").is_dir():
        flat = _images_in(root / "val")
        if flat:  # the official flat folder: labels from the devkit's ground truth, in file-name order
            if meta is None or meta.validation_wnids is None:
                raise LayoutError(
                    f"{root / 'val'}: {len(flat)} images in one folder need the devkit's labels: put "
                    f"{DEVKIT}/ (or {DEVKIT}.tar.gz) in {root}"
                )
            truth = root / DEVKIT / "data" / "ILSVRC2012_validation_ground_truth.txt"
            if len(meta.validation_wnids) != len(flat):
                raise LayoutError(
                    f"{truth}: {len(meta.validation_wnids)} labels for {len(flat)} images in "
                    f"{root / 'val'} (truncated devkit or image folder?)"
                )
            splits["validation"] = list(zip(flat, meta.validation_wnids))
        else:
            splits["validation"] = [
                (path, wnid) for wnid, paths in _class_folders(root / "val").items() for path in paths
            ]
    wnids = meta.wnids if meta is not None else sorted({wnid for pairs in splits.values() for _, wnid in pairs})
    index = {wnid: i for i, wnid in enumerate(wnids)}
    names = [meta.words[wnid] for wnid in wnids] if meta is not None else wnids
    features = _image_features(names, wnid=datasets.Value("string"))
    data = {}
    for split, pairs in splits.items():
        unknown = next((wnid for _, wnid in pairs if wnid not in index), None)
        if unknown is not None:
            raise LayoutError(
                f"{root / ('train' if split == 'train' else 'val') / unknown}: {unknown} is not one "
                f"of the {len(wnids)} ILSVRC2012 classes of the devkit"
            )
        data[split] = _dataset(
            {
                "image": [str(p) for p, _ in pairs],
                "label": [index[w] for _, w in pairs],
                "wnid": [w for _, w in pairs],
            },
            features,
        )
    return datasets.DatasetDict(data)


# --------------------------------------------------------------------------------------------
# webdataset shards
# --------------------------------------------------------------------------------------------
def expand_shards(pattern: str) -> list[str]:
    """The shard paths of a brace pattern (``shards/train-{0000..1023}.tar``; ``braceexpand``, as webdataset)."""
    from braceexpand import braceexpand

    return list(braceexpand(pattern))


def split_of(path: str) -> str:
    """The split a shard's file name names, by ``datasets``' keywords (``train``/``validation``/``test`` and their
    synonyms, between non-word characters); ``train`` when it names none."""
    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    name = os.path.basename(path).lower()
    separator = re.escape(NON_WORDS_CHARS).replace(r"0\-9", "0-9")
    for split, keywords in SPLIT_KEYWORDS.items():
        for keyword in keywords:
            if re.search(rf"(^|[{separator}]){keyword}($|[{separator}])", name):
                return str(split)
    return "train"


def _label_names(path: str | os.PathLike) -> list[str]:
    return [row.fields[0] for row in read_rows(Path(path), 1, "one class name per line", last_takes_rest=True)]


def load_webdataset(
    pattern: str,
    label_names: str | os.PathLike | None = None,
    image_key: str = "jpg",
    label_key: str = "cls",
    streaming: bool = False,
) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """Webdataset tar shards with ``image_key`` and ``label_key`` members (``datasets``' webdataset builder),
    grouped into splits by :func:`split_of`; columns renamed to ``image`` / ``label``.

    Class names come from ``label_names`` (one per line), else ``classes.txt`` beside the shards, else (not
    streaming) the label ids found, as strings.  A sample without ``label_key`` is a :class:`LayoutError`
    naming its shard and key (while loading, or when the stream reaches it).
    """
    shards = expand_shards(pattern)
    remote = "://" in pattern
    missing = [s for s in shards if not remote and not Path(s).is_file()]
    if missing:
        raise LayoutError(
            f"{missing[0]}: no such shard ({len(missing)} of the {len(shards)} shards of {pattern!r} are missing)"
        )
    files: dict[str, list[str]] = {}
    for shard in shards:
        files.setdefault(split_of(shard), []).append(shard)
    beside = Path(shards[0]).parent / "classes.txt"
    names = _label_names(label_names) if label_names else (_label_names(beside) if beside.is_file() else None)
    if streaming and names is None:
        raise UserError(
            f"--streaming webdataset shards need the class names: --label_names FILE (one per line) or {beside}"
        )
    features = None
    if streaming:  # the columns are known up front (a stream infers nothing before it is read)
        features = datasets.Features(
            {
                image_key: datasets.Image(),
                label_key: datasets.ClassLabel(names=names),
                "__key__": datasets.Value("string"),
                "__url__": datasets.Value("string"),
            }
        )
    loaded = datasets.load_dataset("webdataset", data_files=files, streaming=streaming, features=features)
    for split, table in loaded.items():
        if streaming:
            continue
        if label_key not in table.column_names:
            raise LayoutError(
                f"{files[split][0]}: its samples have no {label_key!r} member (members: "
                f"{', '.join(c for c in table.column_names if not c.startswith('__'))})"
            )
        labels = table[label_key]
        hole = next((i for i, label in enumerate(labels) if label is None), None)
        if hole is not None:
            row = table.select([hole]).remove_columns([c for c in table.column_names if not c.startswith("__")])[0]
            raise LayoutError(f"{row['__url__']}: sample {row['__key__']!r} has no {label_key!r} member")
    if names is None:
        found = sorted({int(label) for table in loaded.values() for label in table[label_key]})
        names = [str(i) for i in range(found[-1] + 1)]
    out = {}
    for split, table in loaded.items():
        table = table.rename_columns({image_key: "image", label_key: "label"})
        if streaming:
            out[split] = table.map(_require_label(files[split], label_key), features=table.features)
        else:
            out[split] = table.cast_column("label", datasets.ClassLabel(names=names))
    return (datasets.IterableDatasetDict if streaming else datasets.DatasetDict)(out)


def _require_label(shards: list[str], label_key: str) -> Callable[[dict], dict]:
    """A check for streamed samples: one without ``label_key`` is a :class:`LayoutError` naming its shard."""

    def check(example: dict) -> dict:
        if example.get("label") is None:
            raise LayoutError(
                f"{example.get('__url__', shards[0])}: sample {example.get('__key__')!r} has no {label_key!r} member"
            )
        return example

    return check


# --------------------------------------------------------------------------------------------
# the Hub
# --------------------------------------------------------------------------------------------
def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def load_hub(
    name: str,
    data_dir: str | None = None,
    streaming: bool = False,
) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """A Hub dataset (or a local folder in a Hub repository's layout) by name or alias; the user's mistakes and
    an unreachable Hub as one-line :class:`UserError`s (naming the local layout to use for the aliases)."""
    from datasets.exceptions import DatasetNotFoundError

    alias = HUB_ALIASES.get(canonical_name(name))
    repo = alias.repo if alias else name
    try:
        loaded = datasets.load_dataset(repo, data_dir=data_dir if alias is None else None, streaming=streaming)
    except (ConnectionError, DatasetNotFoundError, FileNotFoundError, RuntimeError, ValueError) as error:
        instead = (
            f"; or use the local files: {alias.local_layout}"
            if alias and alias.local_layout
            else "; or train on local images with --dataset imagefolder --data_dir DIR"
        )
        raise UserError(
            f"dataset {repo!r} could not be loaded ({type(error).__name__}: {_first_line(error)}): it "
            f"is not in the local cache and the Hub is not reachable (offline?), or it is not a dataset "
            f"`datasets` can load (loading scripts are no longer supported){instead}"
        ) from None
    if canonical_name(name) == "aircraft" and not streaming and {"train", "validation"} <= set(loaded):
        # the paper's protocol trains on the official trainval split
        loaded["trainval"] = datasets.concatenate_datasets([loaded["train"], loaded["validation"]])
    return loaded


def label_column(features: datasets.Features, name: str, requested: str | None) -> str:
    """The label column, by name: ``requested`` (``--label_column``), else the alias's documented fine label,
    else ``label``, else the only ``ClassLabel`` column; never chosen by position."""
    class_labels = [key for key, feature in features.items() if isinstance(feature, datasets.ClassLabel)]
    alias = HUB_ALIASES.get(canonical_name(name))
    choice = requested or (alias.label_column if alias and alias.label_column in features else None)
    if choice is None:
        choice = "label" if "label" in class_labels else (class_labels[0] if len(class_labels) == 1 else None)
    if choice is None:
        raise UserError(
            f"dataset {name!r} has several label columns ({', '.join(class_labels) or 'none'}); choose "
            f"one with --label_column"
        )
    if choice not in features:
        raise UserError(f"--label_column {choice}: dataset {name!r} has no such column (it has {', '.join(features)})")
    if not isinstance(features[choice], datasets.ClassLabel):
        raise UserError(f"--label_column {choice}: the column is {features[choice]}, not a ClassLabel")
    return choice


def image_column(features: datasets.Features, name: str) -> str:
    """The image column: ``image``, else the alias's, else the only ``Image`` column."""
    images = [key for key, feature in features.items() if isinstance(feature, datasets.Image)]
    alias = HUB_ALIASES.get(canonical_name(name))
    for candidate in ("image", alias.image_column if alias else None):
        if candidate in images:
            return candidate
    if len(images) == 1:
        return images[0]
    raise UserError(
        f"dataset {name!r} needs one Image column, it has {', '.join(images) or 'none'} "
        f"(columns: {', '.join(features)})"
    )


# --------------------------------------------------------------------------------------------
# choosing a loader
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataOptions:
    """What ``--dataset`` / ``--data_dir`` and the dataset flags of the training scripts ask for."""

    name: str
    data_dir: str | None = None
    annotation: str = "variant"
    keep_banner: bool = False
    crop_to_bbox: bool = False
    label_names: str | None = None
    streaming: bool = False

    @classmethod
    def from_arguments(cls, name: str, args: argparse.Namespace) -> DataOptions:
        """The options of ``name`` from the flags :func:`add_dataset_arguments` defines (``--streaming`` where the
        script has it)."""
        return cls(
            name,
            args.data_dir,
            annotation=args.annotation,
            keep_banner=args.keep_banner,
            crop_to_bbox=args.crop_to_bbox,
            label_names=args.label_names,
            streaming=bool(getattr(args, "streaming", False)),
        )


def add_dataset_arguments(group: argparse._ActionsContainer) -> None:
    """The dataset flags both training scripts share: ``--label_column`` and the per-dataset options."""
    group.add_argument("--label_column", help="the ClassLabel column to train on (default: the dataset's fine label)")
    group.add_argument("--label_names", help="webdataset: a file of class names, one per line")
    group.add_argument("--annotation", default="variant", help="FGVC-Aircraft level: variant, family or manufacturer")
    group.add_argument("--keep_banner", action="store_true", help="FGVC-Aircraft: keep the 20-pixel copyright banner")
    group.add_argument("--crop_to_bbox", action="store_true", help="CUB: crop every image to its bounding box")


def official_layout(options: DataOptions) -> Callable[[], datasets.DatasetDict] | None:
    """The loader for ``--dataset NAME --data_dir ROOT`` when ROOT holds NAME's official layout, else ``None``."""
    name, root = canonical_name(options.name), options.data_dir
    if root is None:
        return None
    if name == "cub" and cub_root(root) is not None:
        return lambda: load_cub(root, crop_to_bbox=options.crop_to_bbox)
    if name == "aircraft" and aircraft_root(root) is not None:
        return lambda: load_aircraft(root, options.annotation, keep_banner=options.keep_banner)
    if name == "imagenet-1k" and imagenet_root(root) is not None:
        return lambda: load_imagenet(root)
    return None


def load(options: DataOptions) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """The dataset ``options`` name: an official layout under ``data_dir``, webdataset shards, or the Hub."""
    name = canonical_name(options.name)
    if name == "webdataset":
        if not options.data_dir:
            raise UserError(
                "dataset 'webdataset' needs --data_dir 'SHARDS' (e.g. "
                "'shards/imagenet-{train-{0000..1023},validation-{00..63}}.tar')"
            )
        return load_webdataset(options.data_dir, options.label_names, streaming=options.streaming)
    loader = official_layout(options)
    if loader is not None:
        return loader()
    if name in ("cub", "aircraft", "imagenet-1k") and options.data_dir:
        layout = HUB_ALIASES[name].local_layout
        raise LayoutError(f"--data_dir {options.data_dir}: not the official layout of {name} (expected {layout})")
    return load_hub(options.name, options.data_dir, streaming=options.streaming)


def summary(
    name: str, data: datasets.DatasetDict | datasets.IterableDatasetDict, splits: Iterable[str] | None = None
) -> str:
    """``cub: train 5,994 / test 5,794 images, 200 classes`` (streamed splits count as ``?``)."""
    parts = []
    for split in splits or data:
        table = data[split]
        size = f"{len(table):,}" if isinstance(table, datasets.Dataset) else "?"
        parts.append(f"{split} {size}")
    first = next(iter(data.values()))
    labels = first.features.get("label") if first.features else None
    classes = f", {labels.num_classes} classes" if isinstance(labels, datasets.ClassLabel) else ""
    return f"{name}: {' / '.join(parts)} images{classes}"


__all__ = [
    "AIRCRAFT_BANNER_PIXELS",
    "HUB_ALIASES",
    "DataOptions",
    "HubAlias",
    "ImageNetMeta",
    "LayoutError",
    "canonical_name",
    "cub_class_name",
    "expand_shards",
    "image_column",
    "label_column",
    "load",
    "load_aircraft",
    "load_cub",
    "load_hub",
    "load_imagenet",
    "load_webdataset",
    "official_layout",
    "read_devkit",
    "remove_banner",
    "split_of",
    "summary",
]
