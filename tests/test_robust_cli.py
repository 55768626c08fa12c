"""Robust command lines: user errors end with exit status 2 and a short message, bad data never kills a run."""

from __future__ import annotations

import csv
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from polar_vit_hf.cli import DEBUG_ENV
from polar_vit_hf.conversion import verify
from polar_vit_hf.training import finetune, pretrain
from polar_vit_hf.training.data import TransformedDataset, digits_images, to_rgb

TINY = ["--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--batch_size", "8", "--no_progress"]


def user_error(capsys, main, *argv: str) -> str:
    """Run ``main(argv)`` in-process; it must return 2 and print one short message (no traceback)."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ": error: " in err
    return err


def test_missing_imagefolder_is_a_clean_error(capsys, tmp_path):
    err = user_error(
        capsys,
        pretrain.main,
        "--output_dir",
        str(tmp_path / "o"),
        "--dataset",
        "imagefolder",
        "--data_dir",
        "/nonexistent",
        *TINY,
    )
    assert "--data_dir /nonexistent: no such directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = user_error(
        capsys,
        pretrain.main,
        "--output_dir",
        str(tmp_path / "o"),
        "--dataset",
        "imagefolder",
        "--data_dir",
        str(empty),
        *TINY,
    )
    assert "no images found" in err


def test_a_hub_dataset_offline_points_to_imagefolder(capsys, tmp_path):
    err = user_error(capsys, pretrain.main, "--output_dir", str(tmp_path / "o"), "--dataset", "cifar100", *TINY)
    assert "uoft-cs/cifar100" in err and "--dataset imagefolder --data_dir" in err


def test_invalid_settings_and_output_dirs(capsys, tmp_path):
    out = ["--output_dir", str(tmp_path / "o"), *TINY]
    assert "hidden_size" in user_error(capsys, pretrain.main, *out, "--set", "model.hidden_size=30")
    assert "optim has no setting 'lrr'" in user_error(capsys, pretrain.main, *out, "--set", "optim.lrr=1")
    assert "SECTION.KEY=VALUE" in user_error(capsys, pretrain.main, *out, "--set", "nonsense")
    assert "--recipe nope: not found" in user_error(capsys, pretrain.main, *out, "--recipe", "nope")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    err = user_error(capsys, pretrain.main, "--output_dir", str(a_file), *TINY)
    assert "exists and is not a directory" in err


def test_finetune_tells_a_missing_folder_from_a_hub_id(capsys, tmp_path):
    common = ["--dataset", "digits", "--output_dir", str(tmp_path / "o"), "--max_steps", "1"]
    assert "--model /nonexistent: no such folder" in user_error(
        capsys, finetune.main, "--model", "/nonexistent", *common
    )
    err = user_error(capsys, finetune.main, "--model", "someone/not-cached", *common)
    assert "could not load it" in err and "Hub id" in err


def test_verify_a_folder_without_weights(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert "no model weights" in user_error(capsys, verify.main, str(tmp_path))


def test_console_script_exit_status_and_debug_traceback(tmp_path):
    """The real process: status 2 and one line; ``--debug`` (or the environment variable) shows the traceback."""
    command = [
        sys.executable,
        "-m",
        "polar_vit_hf.training.pretrain",
        "--output_dir",
        str(tmp_path / "o"),
        "--dataset",
        "imagefolder",
        "--data_dir",
        "/nonexistent",
        *TINY,
    ]
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("polar-vit-pretrain: error: --data_dir /nonexistent")
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, env=env, timeout=300)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "UserError" in debug.stderr


# --------------------------------------------------------------------------------------------
# bad samples
# --------------------------------------------------------------------------------------------
def test_image_modes_are_converted_not_rejected(tmp_path):
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    images = {
        "L": Image.fromarray(grey),
        "P": Image.fromarray(grey).convert("P"),
        "RGBA": Image.fromarray(np.dstack([grey] * 3 + [np.full_like(grey, 128)])),
        "CMYK": Image.fromarray(np.dstack([grey] * 3)).convert("CMYK"),
        "I;16": Image.fromarray(grey.astype(np.uint16) * 257),
    }
    for mode, image in images.items():
        path = tmp_path / f"{mode.replace(';', '')}.{'jpg' if mode == 'CMYK' else 'png'}"
        image.save(path)
        rgb = np.asarray(to_rgb(Image.open(path)))
        assert rgb.shape == (8, 8, 3) and rgb.dtype == np.uint8, mode
        tolerance = 8 if mode == "CMYK" else 0  # JPEG
        assert np.abs(rgb[..., 0].astype(int) - grey).max() <= tolerance, mode
    with pytest.raises(ValueError, match="zero-size"):
        to_rgb(Image.new("RGB", (0, 4)))


def test_dataset_skips_unreadable_images_deterministically_and_stops_past_the_threshold(tmp_path):
    good = Image.new("RGB", (4, 4), (10, 20, 30))
    broken = {3, 4}

    def get(i: int):
        if i in broken:
            raise OSError(f"cannot identify image file {i}")
        return good, i

    log = tmp_path / "bad.txt"
    data = TransformedDataset(
        10, get, lambda image: torch.tensor(np.asarray(image)), max_bad_fraction=0.5, bad_sample_log=log
    )
    with pytest.warns(UserWarning, match="skipping an unreadable image"):
        labels = [data[i][1] for i in range(10)]
    assert labels == [0, 1, 2, 5, 5, 5, 6, 7, 8, 9]  # the next readable index takes the place
    assert log.read_text().count("cannot identify image file 3") == 1
    strict = TransformedDataset(10, get, lambda image: 0, max_bad_fraction=0.01)
    with pytest.warns(UserWarning), pytest.raises(Exception, match="could not be decoded"):
        for _ in range(20):
            for i in range(10):
                strict[i]


def make_imagefolder(root: Path, corrupt: bool = True) -> str:
    """20 training images (one of them corrupt, one per odd image mode) and 10 test images of 2 classes."""
    images, labels = digits_images(32)
    for split, count, offset in (("train", 10, 0), ("test", 5, 100)):
        for label in (0, 1):
            folder = root / split / str(label)
            folder.mkdir(parents=True)
            chosen = np.flatnonzero(labels == label)[offset : offset + count]
            for n, index in enumerate(chosen):
                image = Image.fromarray(images[index])
                if split == "train" and n == 1:
                    image = image.convert("L")
                elif split == "train" and n == 2:
                    image = image.convert("P")
                elif split == "train" and n == 3:
                    image = image.convert("RGBA")
                image.save(folder / f"{n}.png")
    if corrupt:
        (root / "train" / "1" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    return str(root)


def run_pretrain(out: Path, *extra: str, limit_file_size: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:  # the checkpoint writes fail like on a full disk (EFBIG instead of ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

    command = [
        sys.executable,
        "-m",
        "polar_vit_hf.training.pretrain",
        "--output_dir",
        str(out),
        "--batch_size",
        "10",
        "--no_progress",
        *extra,
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
        preexec_fn=limit if limit_file_size else None,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_imagefolder(tmp_path_factory.mktemp("imagefolder"))


IMAGEFOLDER = ["--dataset", "imagefolder", "--max_bad_fraction", "0.1"]


@pytest.mark.slow
def test_a_corrupt_image_is_skipped_reported_and_resume_stays_exact(folder, tmp_path):
    steps = ["--max_steps", "8", "--eval_steps", "8", "--save_steps", "4"]
    whole = run_pretrain(tmp_path / "whole", *IMAGEFOLDER, "--data_dir", folder, *steps)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "skipped 1 unreadable image(s)" in whole.stdout + whole.stderr
    listed = (tmp_path / "whole" / "bad_samples.txt").read_text()
    assert "9.png" in listed and "UnidentifiedImageError" in listed
    # interrupted after step 4 and resumed: the same data order around the skipped image, the same weights
    first = run_pretrain(tmp_path / "resumed", *IMAGEFOLDER, "--data_dir", folder, *steps, "--stop_after_steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_pretrain(tmp_path / "resumed", *IMAGEFOLDER, "--data_dir", folder, *steps, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    expected, got = (
        load_file(tmp_path / "whole" / "model" / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model" / "model.safetensors"),
    )
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
def test_too_many_corrupt_images_stop_the_run(folder, tmp_path):
    done = run_pretrain(
        tmp_path / "strict",
        "--dataset",
        "imagefolder",
        "--data_dir",
        folder,
        "--max_steps",
        "14",
        "--eval_steps",
        "14",
        "--save_steps",
        "14",
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "could not be decoded" in done.stderr and "bad_samples.txt" in done.stderr


# --------------------------------------------------------------------------------------------
# non-finite steps and checkpoints that cannot be written
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_non_finite_steps_are_skipped_and_never_reach_the_weights(tmp_path):
    out = tmp_path / "diverged"
    done = run_pretrain(
        out,
        "--max_steps",
        "12",
        "--save_steps",
        "1",
        "--eval_steps",
        "12",
        "--lr",
        "1e30",
        "--max_nonfinite_steps",
        "3",
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "non-finite loss, gradient or update" in done.stderr and "--resume" in done.stderr
    with open(out / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["skipped"] for row in rows[-3:]] == ["1", "1", "1"]
    for checkpoint in (out / "checkpoints").glob("step_*"):
        weights = load_file(checkpoint / "model.safetensors")
        assert all(bool(torch.isfinite(t).all()) for t in weights.values()), checkpoint.name


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one(tmp_path):
    out = tmp_path / "full-disk"
    steps = ["--max_steps", "6", "--save_steps", "2", "--eval_steps", "6"]
    first = run_pretrain(out, *steps, "--stop_after_steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in (out / "checkpoints" / "step_2").iterdir() if p.is_file()}
    # (no loader workers: their shared-memory batches would hit the file-size limit before the checkpoint does)
    failed = run_pretrain(out, *steps, "--resume", "--num_workers", "0", limit_file_size=64 * 1024)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert "could not write checkpoint step_4" in failed.stderr and "step_2 is intact" in failed.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]  # no partial folder left
    assert {p.name: p.read_bytes() for p in (out / "checkpoints" / "step_2").iterdir() if p.is_file()} == before
    again = run_pretrain(out, *steps, "--resume")  # space is back: the run continues from step 2
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "model" / "model.safetensors").exists()
