"""Fashion-MNIST from IDX files: the reader (on small IDX files written here, corrupt ones included),
where the files are looked for, the dataset it becomes, the fetch command and the training scripts."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from polar_vit_hf.cli import UserError
from polar_vit_hf.training import fashion_mnist as fm, fetch_data


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    return b"\0\0" + bytes([code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_split(directory, split: str, count: int, seed: int = 0, gz: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
    labels = (np.arange(count) % 10).astype(np.uint8)
    for stem, array in zip(fm.FILES[split], (images, labels)):
        data = idx_bytes(array)
        (directory / (stem + (".gz" if gz else ""))).write_bytes(gzip.compress(data) if gz else data)
    return images, labels


@pytest.fixture
def idx_dir(tmp_path, monkeypatch):
    """A small Fashion-MNIST (30 training, 12 test images) and no Debian copy or cache on this machine."""
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no-debian")
    monkeypatch.setenv("POLAR_VIT_DATA", str(tmp_path / "cache"))
    fm.load_fashion_mnist.cache_clear()
    directory = tmp_path / "idx"
    directory.mkdir()
    write_split(directory, "train", 30, seed=1)
    write_split(directory, "test", 12, seed=2, gz=False)  # plain files are read too
    yield directory
    fm.load_fashion_mnist.cache_clear()


def test_read_idx_round_trips_gzipped_and_plain(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "a.gz").write_bytes(gzip.compress(idx_bytes(array)))
    (tmp_path / "a").write_bytes(idx_bytes(array))
    assert np.array_equal(fm.read_idx(tmp_path / "a.gz", expect_dims=3), array)
    assert np.array_equal(fm.read_idx(tmp_path / "a"), array)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda data: gzip.compress(data)[:-9], "cannot be read as gzip"),  # truncated download
        (lambda data: b"PK\x03\x04" + data, "not an IDX file"),
        (lambda data: data[:2] + b"\x0d" + data[3:], "type code 0x0d"),
        (lambda data: data[:-5], "truncated: the header declares shape (3, 28, 28)"),
        (lambda data: data + b"\0", "longer than declared"),
        (lambda data: data[:3] + b"\x02" + data[4:], "2 dimensions, expected 3"),
        (lambda data: data[:6], "truncated inside its header"),
    ],
)
def test_corrupt_idx_files_name_the_file_and_the_fault(tmp_path, damage, message):
    data = idx_bytes(np.zeros((3, 28, 28), dtype=np.uint8))
    damaged = damage(data)
    path = tmp_path / ("images.gz" if damaged[:2] == b"\x1f\x8b" else "images")
    path.write_bytes(damaged)
    with pytest.raises(fm.IdxError, match="images") as caught:
        fm.read_idx(path, expect_dims=3)
    assert message in str(caught.value)
    assert isinstance(caught.value, UserError)  # the scripts report it in one line, exit status 2


def test_images_and_labels_must_agree(idx_dir):
    (idx_dir / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(29, np.uint8))))
    with pytest.raises(fm.IdxError, match="30 images but .*29 labels"):
        fm.read_split(idx_dir, "train")
    (idx_dir / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.full(30, 10, np.uint8))))
    with pytest.raises(fm.IdxError, match="label 10 outside the 10 classes"):
        fm.read_split(idx_dir, "train")


def test_dataset_has_image_and_class_label_columns_and_a_validation_part(idx_dir):
    import datasets

    images, labels = write_split(idx_dir, "train", 30, seed=1)
    splits = fm.load_fashion_mnist(str(idx_dir))
    assert {name: len(split) for name, split in splits.items()} == {
        "train": 30,
        "test": 12,
        "fit": 27,
        "validation": 3,
    }
    features = splits["train"].features
    assert isinstance(features["image"], datasets.Image) and isinstance(features["label"], datasets.ClassLabel)
    assert features["label"].names[9] == "Ankle boot"
    first = splits["train"][0]
    assert first["image"].mode == "L" and np.array_equal(np.asarray(first["image"]), images[0])
    assert first["label"] == labels[0]
    fit = set(map(bytes, (np.asarray(x["image"]).tobytes() for x in splits["fit"])))
    held = set(map(bytes, (np.asarray(x["image"]).tobytes() for x in splits["validation"])))
    assert not fit & held and len(fit | held) == 30  # a partition of train; test untouched


def test_missing_files_and_no_source_give_the_fetch_command(tmp_path, idx_dir):
    (idx_dir / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(UserError, match="missing Fashion-MNIST file.*t10k-labels-idx1-ubyte.*fetch_data"):
        fm.load_fashion_mnist(str(idx_dir))
    with pytest.raises(UserError, match="fetch_data fashion-mnist"):  # offline (conftest): the Hub fails too
        fm.load_fashion_mnist(None)


def test_build_data_selects_fashion_mnist(idx_dir):
    from polar_vit_hf.training.data import build_data

    data = build_data("fashion_mnist", 28, {"horizontal_flip": True}, str(idx_dir))
    pixels, label = data.train[3]
    assert tuple(pixels.shape) == (3, 28, 28) and label == 3
    assert len(data.eval) == 12 and data.id2label[0] == "T-shirt/top"
    tuning = build_data("fashion_mnist", 28, {}, str(idx_dir), train_split="fit", eval_split="validation")
    assert (len(tuning.train), len(tuning.eval)) == (27, 3)


def test_fetch_copies_checked_files_from_the_debian_location(tmp_path, idx_dir, monkeypatch, capsys):
    monkeypatch.setattr(fm, "DEBIAN_DIR", idx_dir)
    assert fetch_data.main(["fashion-mnist", "--dest", str(tmp_path / "dest")]) == 0
    assert "files in" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == sorted(p.name for p in idx_dir.iterdir())
    (idx_dir / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b broken")
    assert fetch_data.main(["fashion-mnist", "--dest", str(tmp_path / "again")]) == 2  # a damaged source file
    assert "train-images-idx3-ubyte.gz" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_pretrain_runs_on_fashion_mnist(tmp_path, idx_dir):
    from polar_vit_hf.training import pretrain
    from polar_vit_hf.training.demo import read_metrics

    out = tmp_path / "run"
    code = pretrain.main(
        [
            "--recipe",
            "fashion-mnist",
            "--data_dir",
            str(idx_dir),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--eval_steps",
            "2",
            "--save_steps",
            "2",
            "--batch_size",
            "8",
            "--no_progress",
            "--set",
            "model.num_hidden_layers=1",
        ]
    )
    assert code == 0
    rows = read_metrics(out)
    assert len(rows) == 2 and rows[-1]["eval_accuracy"] != ""


def test_digits_have_fit_and_validation_splits_inside_train_for_tuning():
    from polar_vit_hf.training.data import build_data, digits_splits

    splits = digits_splits()
    assert sorted(splits) == ["fit", "test", "train", "validation"]
    assert set(splits["fit"]).isdisjoint(splits["validation"])
    assert sorted([*splits["fit"], *splits["validation"]]) == sorted(splits["train"])
    assert set(splits["train"]).isdisjoint(splits["test"])
    data = build_data("digits", 16, {}, train_split="fit", eval_split="validation")
    assert (len(data.train), len(data.eval)) == (len(splits["fit"]), len(splits["validation"]))
    with pytest.raises(UserError, match="dataset 'digits' has no split 'dev'"):
        build_data("digits", 16, {}, train_split="dev")
