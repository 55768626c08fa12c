"""training/official_data.py on copies of the official layouts (tests/support/official_layouts.py): CUB-200-2011,
FGVC-Aircraft 2013b, ILSVRC2012 with its devkit, webdataset shards, the Hub aliases; every layout mistake is a
one-line error naming the file and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from official_layouts import (
    AIRCRAFT_CLASSES,
    BANNER_VALUE,
    CUB_CLASSES,
    IMAGENET_SYNSETS,
    write_aircraft,
    write_cub,
    write_imagenet,
    write_shards,
)

from polar_vit_hf.cli import UserError
from polar_vit_hf.training import official_data as O


def test_cub_splits_labels_names_and_boxes(tmp_path):
    fixture = write_cub(tmp_path)
    data = O.load_cub(tmp_path)
    assert set(data) == {"train", "test"}
    assert len(data["train"]) == len(fixture.train_ids) == 6 and len(data["test"]) == len(fixture.test_ids) == 6
    names = data["train"].features["label"].names
    assert names == ["Black footed Albatross", "Laysan Albatross", "Sooty Albatross"]
    assert isinstance(data["train"].features["image"], datasets.Image)
    for split, ids in (("train", fixture.train_ids), ("test", fixture.test_ids)):
        table = data[split]
        assert tuple(table["image_id"]) == ids
        assert list(table["label"]) == [fixture.labels[i] - 1 for i in ids]
        assert [list(b) for b in table["bbox"]] == [list(fixture.boxes[i]) for i in ids]
    assert O.summary("cub", data) == "cub: train 6 / test 6 images, 3 classes"
    assert O.load_cub(tmp_path / "CUB_200_2011")["train"]["image_id"] == data["train"]["image_id"]  # either root


def test_cub_crop_to_bbox_crops_each_image_to_its_box(tmp_path):
    fixture = write_cub(tmp_path)
    cropped = O.load_cub(tmp_path, crop_to_bbox=True)["train"]
    for row in cropped:
        x, y, w, h = fixture.boxes[row["image_id"]]
        assert row["image"].size == (round(x + w) - round(x), round(y + h) - round(y))
    assert O.load_cub(tmp_path)["train"][0]["image"].size == (48, 40)  # off by default


def test_aircraft_splits_levels_and_the_banner(tmp_path):
    fixture = write_aircraft(tmp_path, per_split=2)
    data = O.load_aircraft(tmp_path)
    assert {split: len(data[split]) for split in data} == {"train": 10, "val": 10, "trainval": 20, "test": 10}
    variants = [v for v, _, _ in AIRCRAFT_CLASSES]
    assert data["train"].features["label"].names == variants  # the order of variants.txt
    assert data["train"].features["family"].names == ["F/A-18", "Cessna 172", "DHC-1", "Boeing 737"]
    for split in data:
        table = data[split]
        assert tuple(table["image_id"]) == fixture.splits[split]
        assert [variants[i] for i in table["label"]] == [fixture.variant_of[k] for k in fixture.splits[split]]
    assert all(len(key) == 7 and key.startswith("00") for key in data["test"]["image_id"])
    assert list(data["train"][0]["bbox"]) == [3.0, 4.0, 50.0, float(fixture.height - 25)]
    # the bottom 20 rows (the banner) are gone on decoding, the body is kept
    image = np.asarray(data["test"][0]["image"])
    assert image.shape[:2] == (fixture.height - 20, 64)
    assert abs(float(image[-1].mean()) - 40) < 8 and abs(float(image[0].mean()) - 40) < 8
    kept = np.asarray(O.load_aircraft(tmp_path, keep_banner=True)["test"][0]["image"])
    assert kept.shape[:2] == (fixture.height, 64)
    assert abs(float(kept[-20:].mean()) - BANNER_VALUE) < 8 and abs(float(kept[-21].mean()) - 40) < 8
    family = O.load_aircraft(tmp_path / "fgvc-aircraft-2013b", annotation="family")
    assert family["trainval"].features["label"].num_classes == 4 and "variant" in family["trainval"].features
    manufacturer = O.load_aircraft(tmp_path / "fgvc-aircraft-2013b" / "data", annotation="manufacturer")
    assert manufacturer["test"].features["label"].names == ["McDonnell Douglas", "Cessna", "de Havilland", "Boeing"]


@pytest.mark.parametrize("devkit", ["folder", "archive"])
def test_imagenet_train_folders_and_the_flat_validation_set_labelled_by_the_devkit(tmp_path, devkit):
    fixture = write_imagenet(tmp_path, devkit=devkit)
    data = O.load_imagenet(tmp_path)
    wnids = sorted(wnid for _, wnid, _ in IMAGENET_SYNSETS)  # the standard order: sorted wnids, not ILSVRC2012_ID
    names = data["train"].features["label"].names
    assert names == [next(w for _, n, w in IMAGENET_SYNSETS if n == wnid) for wnid in wnids]
    assert names[0] == "tench, Tinca tinca" and len(names) == 3  # the non-leaf synset of meta.mat is skipped
    assert len(data["train"]) == 9 and len(data["validation"]) == 5
    assert tuple(data["validation"]["wnid"]) == fixture.validation_wnids
    assert [wnids[i] for i in data["validation"]["label"]] == list(fixture.validation_wnids)
    assert [wnids[i] for i in data["train"]["label"]] == list(data["train"]["wnid"])
    # torchvision's ImageFolder convention (sorted class folders) gives the same label order
    from torchvision.datasets import ImageFolder

    assert ImageFolder(str(tmp_path / "train")).classes == wnids


def test_imagenet_validation_in_class_folders_needs_no_ground_truth(tmp_path):
    write_imagenet(tmp_path)
    for image in sorted((tmp_path / "val").iterdir()):
        image.unlink()
    wnid = IMAGENET_SYNSETS[0][1]
    (tmp_path / "val" / wnid).mkdir()
    (tmp_path / "train" / wnid / f"{wnid}_10.JPEG").rename(tmp_path / "val" / wnid / "x.JPEG")
    data = O.load_imagenet(tmp_path)
    assert list(data["validation"]["wnid"]) == [wnid]


def test_webdataset_shards_split_by_file_name(tmp_path):
    train = write_shards(tmp_path, "train", shards=2, per_shard=4)
    validation = write_shards(tmp_path, "validation", shards=1, per_shard=3)
    (tmp_path / "classes.txt").write_text("tench\ngoldfish\ngreat white shark\n")
    data = O.load_webdataset(str(tmp_path / "imagenet-{train-{0000..0001},validation-0000}.tar"))
    assert {split: len(data[split]) for split in data} == {"train": 8, "validation": 3}
    assert list(data["train"]["label"]) == train and list(data["validation"]["label"]) == validation
    assert data["train"].features["label"].names == ["tench", "goldfish", "great white shark"]
    assert isinstance(data["train"].features["image"], datasets.Image)
    assert [O.split_of(n) for n in ("a-train-0001.tar", "val_03.tar", "x-test.tar", "shard-0001.tar")] == [
        "train",
        "validation",
        "test",
        "train",
    ]


def test_hub_aliases_fail_offline_naming_the_local_layout_and_labels_are_chosen_by_name():
    with pytest.raises(UserError) as caught:
        O.load_hub("aircraft")
    message = str(caught.value)
    assert "HuggingFaceM4/FGVC-Aircraft" in message and "fgvc-aircraft-2013b/data" in message
    assert "\n" not in message
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "family": datasets.ClassLabel(names=["a", "b"]),
            "variant": datasets.ClassLabel(names=["x", "y", "z"]),
        }
    )
    assert O.label_column(features, "aircraft", None) == "variant"  # the documented fine label, not the first
    assert O.label_column(features, "aircraft", "family") == "family"
    with pytest.raises(UserError, match="several label columns"):
        O.label_column(features, "some/dataset", None)
    with pytest.raises(UserError, match="no such column"):
        O.label_column(features, "aircraft", "manufacturer")
    cifar = datasets.Features(
        {
            "img": datasets.Image(),
            "fine_label": datasets.ClassLabel(names=["a"]),
            "coarse_label": datasets.ClassLabel(names=["b"]),
        }
    )
    assert O.label_column(cifar, "cifar100", None) == "fine_label" and O.image_column(cifar, "cifar100") == "img"


def _error(call) -> str:
    with pytest.raises(O.LayoutError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_cub_layout_mistakes_name_the_file_and_line(tmp_path):
    write_cub(tmp_path)
    base = tmp_path / "CUB_200_2011"
    split = base / "train_test_split.txt"
    original = split.read_text()
    split.unlink()
    assert _error(lambda: O.load_cub(tmp_path)).startswith(f"{split}: missing")
    split.write_text(original + "9999 1\n")
    assert _error(lambda: O.load_cub(tmp_path)) == f"{split}:13: image id 9999 is not in {base / 'images.txt'}"
    split.write_text(original)
    labels = base / "image_class_labels.txt"
    labels.write_text(labels.read_text().replace("2 1\n", "2 7\n", 1))
    assert _error(lambda: O.load_cub(tmp_path)) == f"{labels}:2: class id 7 is outside 1..3 (classes.txt)"
    labels.write_text(labels.read_text().replace("2 7\n", "2 1\n", 1))
    (base / "images" / CUB_CLASSES[0] / "Black_footed_Albatross_0001_791.jpg").unlink()
    assert _error(lambda: O.load_cub(tmp_path)).startswith(f"{base / 'images.txt'}:1: image id 1: no file ")


def test_aircraft_and_imagenet_layout_mistakes_name_the_file_and_line(tmp_path):
    write_aircraft(tmp_path / "air")
    base = tmp_path / "air" / "fgvc-aircraft-2013b" / "data"
    test_split = base / "images_variant_test.txt"
    test_split.rename(base / "moved.txt")
    assert _error(lambda: O.load_aircraft(tmp_path / "air")).startswith(f"{test_split}: missing")
    (base / "moved.txt").rename(test_split)
    train_split = base / "images_variant_train.txt"
    train_split.write_text(train_split.read_text() + "9999999 DHC-1\n")
    assert _error(lambda: O.load_aircraft(tmp_path / "air")) == (
        f"{train_split}:6: image id 9999999: no file {base / 'images' / '9999999.jpg'}"
    )
    train_split.write_text(train_split.read_text().replace("9999999 DHC-1\n", "0034316 F/A-18\n"))
    assert _error(lambda: O.load_aircraft(tmp_path / "air")) == (
        f"{train_split}:6: image id 0034316 appears twice (first on line 1)"
    )
    lines = train_split.read_text().splitlines(keepends=True)[:-1]
    train_split.write_text("".join([lines[0].replace("F/A-18", "Concorde"), *lines[1:]]))
    assert _error(lambda: O.load_aircraft(tmp_path / "air")) == (
        f"{train_split}:1: variant 'Concorde' is not in {base / 'variants.txt'}"
    )

    write_imagenet(tmp_path / "in", devkit="archive")
    archive = tmp_path / "in" / "ILSVRC2012_devkit_t12.tar.gz"
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    assert "not a readable devkit archive (truncated?)" in _error(lambda: O.load_imagenet(tmp_path / "in"))
    write_imagenet(tmp_path / "in2")
    truth = tmp_path / "in2" / "ILSVRC2012_devkit_t12" / "data" / "ILSVRC2012_validation_ground_truth.txt"
    truth.write_text("".join(truth.read_text().splitlines(keepends=True)[:3]))
    assert _error(lambda: O.load_imagenet(tmp_path / "in2")) == (
        f"{truth}: 3 labels for 5 images in {tmp_path / 'in2' / 'val'} (truncated devkit or image folder?)"
    )
    truth.write_text("1\n2\n3\n1\n77\n")
    assert _error(lambda: O.load_imagenet(tmp_path / "in2")).startswith(f"{truth}:5: ILSVRC2012_ID 77 is not a leaf")


def test_a_shard_without_cls_is_an_error_naming_the_shard_and_sample(tmp_path):
    write_shards(tmp_path, "train", shards=2, per_shard=3, drop_label=(1, 2))
    message = _error(lambda: O.load_webdataset(str(tmp_path / "imagenet-train-{0000..0001}.tar")))
    assert message == f"{tmp_path / 'imagenet-train-0001.tar'}: sample 'train_0001_000002' has no 'cls' member"
    (tmp_path / "classes.txt").write_text("a\nb\nc\n")
    stream = O.load_webdataset(str(tmp_path / "imagenet-train-{0000..0001}.tar"), streaming=True)["train"]
    assert _error(lambda: list(stream)) == message  # a stream reports it when it reaches the sample
    missing = _error(lambda: O.load_webdataset(str(tmp_path / "imagenet-train-{0000..0003}.tar")))
    assert missing.startswith(f"{tmp_path / 'imagenet-train-0002.tar'}: no such shard (2 of the 4 shards")


def test_a_layout_error_ends_the_console_script_with_one_line_and_status_2(tmp_path):
    write_cub(tmp_path / "data")
    labels = tmp_path / "data" / "CUB_200_2011" / "image_class_labels.txt"
    labels.write_text(labels.read_text().replace("3 1\n", "3 0\n", 1))
    script = Path(sys.executable).parent / "polar-vit-pretrain"
    done = subprocess.run(
        [
            str(script),
            "--dataset",
            "cub",
            "--data_dir",
            str(tmp_path / "data"),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"polar-vit-pretrain: error: {labels}:3: class id 0 is outside 1..3 (classes.txt)"
    )
