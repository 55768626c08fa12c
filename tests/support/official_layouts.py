"""Small copies of the official dataset layouts, written by the tests: the same file names, id formats, class-name
forms and annotation formats as the real archives (CUB_200_2011.tgz, fgvc-aircraft-2013b.tar.gz, the ILSVRC2012
train/val folders and devkit, webdataset shards), with a few tiny images per class."""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

BANNER_VALUE = 250  # the fixture's banner rows are this grey; the aircraft body is dark
BODY_VALUE = 40


def _jpeg(path: Path, size: tuple[int, int], value: int, banner: int = 0) -> None:
    """A ``size = (width, height)`` JPEG of one grey ``value`` with a bottom ``banner`` rows at BANNER_VALUE."""
    width, height = size
    pixels = np.full((height, width, 3), value, dtype=np.uint8)
    if banner:
        pixels[height - banner :] = BANNER_VALUE
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, quality=95)


@dataclass(frozen=True)
class CubFixture:
    root: Path  # the folder holding CUB_200_2011/
    class_folders: tuple[str, ...]
    train_ids: tuple[int, ...]
    test_ids: tuple[int, ...]
    boxes: dict[int, tuple[float, float, float, float]]
    labels: dict[int, int]  # image id -> class id (1-based)


CUB_CLASSES = ("001.Black_footed_Albatross", "002.Laysan_Albatross", "003.Sooty_Albatross")


def write_cub(root: Path, per_class: int = 4) -> CubFixture:
    """``root/CUB_200_2011/`` with images.txt, image_class_labels.txt, classes.txt, train_test_split.txt,
    bounding_boxes.txt and images/<NNN.Name>/<Name>_<n>_<m>.jpg; every other image of a class is a test image."""
    base = root / "CUB_200_2011"
    images, labels, split, boxes = [], {}, {}, {}
    image_id = 0
    for class_id, folder in enumerate(CUB_CLASSES, start=1):
        for n in range(per_class):
            image_id += 1
            relative = f"{folder}/{folder.split('.', 1)[1]}_{n + 1:04d}_{790 + image_id}.jpg"
            _jpeg(base / "images" / relative, (48 + 4 * n, 40), 30 * class_id)
            images.append((image_id, relative))
            labels[image_id] = class_id
            split[image_id] = 1 if n % 2 == 0 else 0
            boxes[image_id] = (2.0 + n, 3.5, 20.0, 16.25 + n)
    (base / "images.txt").write_text("".join(f"{i} {rel}\n" for i, rel in images))
    (base / "image_class_labels.txt").write_text("".join(f"{i} {c}\n" for i, c in labels.items()))
    (base / "classes.txt").write_text("".join(f"{c} {name}\n" for c, name in enumerate(CUB_CLASSES, start=1)))
    (base / "train_test_split.txt").write_text("".join(f"{i} {s}\n" for i, s in split.items()))
    (base / "bounding_boxes.txt").write_text("".join(f"{i} {x} {y} {w} {h}\n" for i, (x, y, w, h) in boxes.items()))
    return CubFixture(
        root,
        CUB_CLASSES,
        tuple(i for i, s in split.items() if s == 1),
        tuple(i for i, s in split.items() if s == 0),
        boxes,
        labels,
    )


# (variant, family, manufacturer): names with spaces, slashes and dashes as in the real lists
AIRCRAFT_CLASSES = (
    ("F/A-18", "F/A-18", "McDonnell Douglas"),
    ("Cessna 172", "Cessna 172", "Cessna"),
    ("DHC-1", "DHC-1", "de Havilland"),
    ("737-700", "Boeing 737", "Boeing"),
    ("737-800", "Boeing 737", "Boeing"),
)


@dataclass(frozen=True)
class AircraftFixture:
    root: Path  # the folder holding fgvc-aircraft-2013b/
    splits: dict[str, tuple[str, ...]]  # split -> image ids
    variant_of: dict[str, str]
    height: int


def write_aircraft(root: Path, per_split: int = 1, height: int = 60) -> AircraftFixture:
    """``root/fgvc-aircraft-2013b/data/`` with images/<7-digit id>.jpg (a BANNER_VALUE banner in the bottom 20
    rows), variants.txt / families.txt / manufacturers.txt, images_<level>_{train,val,trainval,test}.txt and
    images_box.txt; ``per_split`` images of every variant in train, val and test."""
    base = root / "fgvc-aircraft-2013b" / "data"
    variants = [v for v, _, _ in AIRCRAFT_CLASSES]
    families = list(dict.fromkeys(f for _, f, _ in AIRCRAFT_CLASSES))
    manufacturers = list(dict.fromkeys(m for _, _, m in AIRCRAFT_CLASSES))
    for name, values in (("variants.txt", variants), ("families.txt", families), ("manufacturers.txt", manufacturers)):
        base.mkdir(parents=True, exist_ok=True)
        (base / name).write_text("".join(f"{v}\n" for v in values))
    splits: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    variant_of, levels = {}, {}
    number = 34309
    boxes = []
    for variant, family, manufacturer in AIRCRAFT_CLASSES:
        for split in splits:
            for _ in range(per_split):
                number += 7
                key = f"{number:07d}"
                _jpeg(base / "images" / f"{key}.jpg", (64, height), BODY_VALUE, banner=20)
                splits[split].append(key)
                variant_of[key] = variant
                levels[key] = {"variant": variant, "family": family, "manufacturer": manufacturer}
                boxes.append(f"{key} 3 4 50 {height - 25}\n")
    splits["trainval"] = splits["train"] + splits["val"]
    for level in ("variant", "family", "manufacturer"):
        for split, keys in splits.items():
            (base / f"images_{level}_{split}.txt").write_text("".join(f"{k} {levels[k][level]}\n" for k in keys))
    (base / "images_box.txt").write_text("".join(boxes))
    return AircraftFixture(root, {s: tuple(k) for s, k in splits.items()}, variant_of, height)


# ILSVRC2012 leaf synsets (ILSVRC2012_ID, WNID, words); the ids are deliberately not in sorted-wnid order here
IMAGENET_SYNSETS = (
    (2, "n01443537", "goldfish, Carassius auratus"),
    (1, "n01440764", "tench, Tinca tinca"),
    (3, "n01484850", "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias"),
)


@dataclass(frozen=True)
class ImageNetFixture:
    root: Path
    validation_wnids: tuple[str, ...]  # in file-name order
    train_counts: dict[str, int]


def write_meta_mat(path: Path, synsets=IMAGENET_SYNSETS) -> None:
    """``meta.mat`` as in the devkit (a struct array ``synsets`` with the devkit's fields), written by scipy,
    including one non-leaf synset (``num_children > 0``) that the loader must skip."""
    from scipy.io import savemat

    fields = [
        ("ILSVRC2012_ID", "O"),
        ("WNID", "O"),
        ("words", "O"),
        ("gloss", "O"),
        ("num_children", "O"),
        ("children", "O"),
        ("wordnet_height", "O"),
        ("num_train_images", "O"),
    ]
    rows = [
        (index, wnid, words, f"gloss of {wnid}", 0, np.zeros((0,), dtype=np.uint8), 0, 1300)
        for index, wnid, words in synsets
    ]
    rows.append((1001, "n00004475", "organism, being", "a living thing", 2, np.array([1, 2], dtype=np.uint8), 9, 0))
    table = np.empty((len(rows),), dtype=fields)
    for i, row in enumerate(rows):
        table[i] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(str(path), {"synsets": table})


def write_imagenet(
    root: Path,
    train_per_class: int = 3,
    validation: int = 5,
    devkit: str = "folder",
) -> ImageNetFixture:
    """``root/train/<wnid>/<wnid>_<n>.JPEG``, the flat ``root/val/ILSVRC2012_val_<8 digits>.JPEG`` and the devkit
    (``devkit="folder"``: ``ILSVRC2012_devkit_t12/data/{meta.mat, ILSVRC2012_validation_ground_truth.txt}``,
    ``"archive"``: the same as ``ILSVRC2012_devkit_t12.tar.gz``)."""
    counts = {}
    for index, wnid, _ in IMAGENET_SYNSETS:
        for n in range(train_per_class):
            _jpeg(root / "train" / wnid / f"{wnid}_{n + 10}.JPEG", (40, 36), 20 * index)
        counts[wnid] = train_per_class
    ids = [IMAGENET_SYNSETS[i % len(IMAGENET_SYNSETS)][0] for i in range(validation)]
    wnid_of = {index: wnid for index, wnid, _ in IMAGENET_SYNSETS}
    for n, index in enumerate(ids, start=1):
        _jpeg(root / "val" / f"ILSVRC2012_val_{n:08d}.JPEG", (36, 40), 20 * index)
    folder = root / "ILSVRC2012_devkit_t12"
    write_meta_mat(folder / "data" / "meta.mat")
    (folder / "data" / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{i}\n" for i in ids))
    if devkit == "archive":
        with tarfile.open(root / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as tar:
            tar.add(folder, arcname="ILSVRC2012_devkit_t12")
        import shutil

        shutil.rmtree(folder)
    return ImageNetFixture(root, tuple(wnid_of[i] for i in ids), counts)


def write_shards(
    folder: Path,
    split: str,
    shards: int,
    per_shard: int,
    num_classes: int = 3,
    drop_label: tuple[int, int] | None = None,
) -> list[int]:
    """``folder/imagenet-<split>-<NNNN>.tar`` webdataset shards of ``<key>.jpg`` + ``<key>.cls`` samples; returns
    the labels in order.  ``drop_label=(shard, sample)`` leaves out that sample's ``cls`` member."""
    labels = []
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(folder / f"imagenet-{split}-{s:04d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"{split}_{s:04d}_{i:06d}"
                label = (s * per_shard + i) % num_classes
                buffer = io.BytesIO()
                Image.fromarray(np.full((32, 32, 3), 60 * label, dtype=np.uint8)).save(buffer, format="JPEG")
                members = [(f"{key}.jpg", buffer.getvalue())]
                if drop_label != (s, i):
                    members.append((f"{key}.cls", str(label).encode()))
                    labels.append(label)
                for name, payload in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return labels
