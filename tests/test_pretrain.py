"""training/pretrain.py: exact resume after SIGKILL, clear checkpoint errors, 2-process equality."""

from __future__ import annotations

import csv
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # processes, training runs or compiles: `make test-fast` skips them

MODULE = ["-m", "polar_vit_hf.training.pretrain"]
COMMON = ["--max_steps", "12", "--save_steps", "6", "--eval_steps", "12", "--batch_size", "16", "--no_progress"]


def run(output_dir: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, *MODULE, "--output_dir", str(output_dir), *COMMON, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if check:
        assert done.returncode == 0, done.stderr[-4000:]
    return done


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def losses(output_dir: Path) -> list[float]:
    with open(output_dir / "metrics.csv") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    run(out)
    return out


def test_a_run_writes_metrics_curves_tensorboard_and_the_model(uninterrupted):
    for name in (
        "metrics.csv",
        "curves.png",
        "recipe.json",
        "model/config.json",
        "model/model.safetensors",
        "model/preprocessor_config.json",
        "best_model/model.safetensors",
        "checkpoints/step_12",
    ):
        assert (uninterrupted / name).exists(), name
    assert any((uninterrupted / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(losses(uninterrupted)) == 12


def test_sigkill_after_a_checkpoint_then_resume_is_exact(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, *MODULE, "--output_dir", str(out), *COMMON],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    checkpoint = out / "checkpoints" / "step_6"
    deadline = time.time() + 300
    while not checkpoint.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert checkpoint.exists() and not (out / "model").exists()
    resumed = run(out, "--resume")
    assert "resumed from" in resumed.stdout + resumed.stderr
    expected, got = weights(uninterrupted / "model"), weights(out / "model")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert losses(out) == losses(uninterrupted)


def test_stop_after_steps_exits_cleanly_at_the_checkpoint(uninterrupted, tmp_path):
    out = tmp_path / "preempted"
    done = run(out, "--stop_after_steps", "6")
    assert "stopping after the checkpoint at step 6" in done.stdout + done.stderr
    assert (out / "checkpoints" / "step_6").exists() and not (out / "model").exists()
    run(out, "--resume")
    expected, got = weights(uninterrupted / "model"), weights(out / "model")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_corrupt_or_mismatched_checkpoints_are_errors_not_restarts(uninterrupted, tmp_path):
    out = tmp_path / "corrupt"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(out / "checkpoints" / "step_12")  # resume from step 6
    (out / "checkpoints" / "step_6" / "model.safetensors").write_bytes(b"garbage")
    done = run(out, "--resume", check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "polar-vit-pretrain: error: checkpoint" in done.stderr and "corrupt or incomplete" in done.stderr
    mismatched = run(out, "--resume", "--seed", "1", check=False)
    assert mismatched.returncode == 2 and "different run" in mismatched.stderr
    fresh = run(out, check=False)  # no --resume on a folder with checkpoints: refuse to overwrite
    assert fresh.returncode == 2 and "already holds checkpoints" in fresh.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _loopback_only() -> list[str] | None:
    """Command prefix running inside a new network namespace with only loopback (root + unshare)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0:
        return None
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return None if probe.returncode else ["unshare", "-n"]


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    prefix = _loopback_only()
    if prefix is None:
        pytest.skip("needs root and unshare to keep the gloo rendezvous inside a loopback-only namespace")
    single = tmp_path / "single"
    run(single, "--max_steps", "6", "--save_steps", "6", "--eval_steps", "6")
    double = tmp_path / "double"
    launch = (
        f"ip link set lo up && {sys.executable} -m accelerate.commands.launch --multi_gpu --num_processes 2 "
        f"--num_machines 1 --mixed_precision no --dynamo_backend no --main_process_port {_free_port()} "
        f"-m polar_vit_hf.training.pretrain --output_dir {double} {' '.join(COMMON)} "
        f"--max_steps 6 --save_steps 6 --eval_steps 6 --cpu"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    done = subprocess.run([*prefix, "bash", "-c", launch], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    one, two = losses(single), losses(double)
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)
    expected, got = weights(single / "model"), weights(double / "model")
    assert max(float((expected[k] - got[k]).abs().max()) for k in expected) < 1e-3


def test_augmentations_gradient_accumulation_calibration_and_the_euclidean_baseline(tmp_path):
    augmented = tmp_path / "augmented"
    done = run(
        augmented,
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--eval_steps",
        "2",
        "--grad_accum",
        "2",
        "--set",
        "augment.mixup=0.8",
        "--set",
        "augment.cutmix=1.0",
        "--set",
        "augment.mix_prob=1.0",
        "--set",
        "augment.label_smoothing=0.1",
        "--set",
        "augment.auto_augment=randaugment",
        "--set",
        "augment.random_erasing=0.25",
        "--set",
        "augment.random_resized_crop=true",
        "--set",
        "model.calibrate_radius=2.5",
        "--set",
        "model.calibrate_images=8",
    )
    assert len(losses(augmented)) == 2 and all(math.isfinite(x) for x in losses(augmented))
    assert "calibrated 13 Polar-FC layers on 8 images" in done.stdout and "-> 2.5" in done.stdout
    euclidean = tmp_path / "euclidean"
    run(euclidean, "--arch", "euclidean", "--max_steps", "2", "--save_steps", "2", "--eval_steps", "2")
    from transformers import AutoImageProcessor, ViTForImageClassification

    model = ViTForImageClassification.from_pretrained(euclidean / "model")
    assert model.config.num_labels == 10
    assert type(AutoImageProcessor.from_pretrained(euclidean / "model")).__name__.startswith("ViTImageProcessor")


def test_a_transformers_vit_checkpoint_starts_the_euclidean_baseline(tmp_path):
    from transformers import ViTForImageClassification

    import polar_vit_hf as P
    from polar_vit_hf.baselines import euclidean_vit

    torch.manual_seed(0)
    vit = euclidean_vit(P.PolarViTConfig.from_preset("demo", num_labels=3))
    source = tmp_path / "vit"
    vit.save_pretrained(source)
    out = tmp_path / "from-vit"
    run(
        out,
        "--arch",
        "euclidean",
        "--init_from",
        str(source),
        "--max_steps",
        "1",
        "--save_steps",
        "1",
        "--eval_steps",
        "1",
        "--lr",
        "0",
    )
    trained = ViTForImageClassification.from_pretrained(out / "model")
    assert trained.config.num_labels == 10  # new head for the digits
    name = "vit.encoder.layer.0.attention.attention.query.weight"
    name = name if name in vit.state_dict() else next(k for k in vit.state_dict() if "query" in k or "q_proj" in k)
    assert torch.equal(trained.state_dict()[name], vit.state_dict()[name])  # lr 0: the loaded weights survive


def _console(name: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(Path(sys.executable).parent / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_pretrain_on_the_imagenet_layout_with_clipping(tmp_path):
    import json

    from official_layouts import write_imagenet

    write_imagenet(tmp_path / "ilsvrc", devkit="archive")
    out = tmp_path / "imagenet-run"
    done = _console(
        "polar-vit-pretrain",
        "--dataset",
        "imagenet-1k",
        "--data_dir",
        str(tmp_path / "ilsvrc"),
        "--set",
        "data.eval_split=validation",
        "--max_steps",
        "2",
        "--eval_steps",
        "2",
        "--save_steps",
        "2",
        "--batch_size",
        "4",
        "--max_grad_norm",
        "1.0",
        "--output_dir",
        str(out),
        "--no_progress",
    )
    assert "imagenet-1k: train 9 / validation 5 images, 3 classes" in done.stdout
    labels = json.loads((out / "labels.json").read_text())
    assert labels == {
        "0": "tench, Tinca tinca",
        "1": "goldfish, Carassius auratus",
        "2": "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias",
    }
    with open(out / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert all(float(row["grad_norm"]) > 0 for row in rows) and rows[-1]["eval_top5_accuracy"] == "1.0"
    scores = json.loads((out / "model" / "eval_results.json").read_text())
    assert scores["eval_split"] == "validation" and scores["dataset"] == "imagenet-1k"


def test_pretrain_streams_webdataset_shards(tmp_path):
    from official_layouts import write_shards

    write_shards(tmp_path / "shards", "train", shards=2, per_shard=6)
    write_shards(tmp_path / "shards", "validation", shards=1, per_shard=5)
    (tmp_path / "shards" / "classes.txt").write_text("tench\ngoldfish\nshark\n")
    out = tmp_path / "wds-run"
    pattern = str(tmp_path / "shards" / "imagenet-{train-{0000..0001},validation-0000}.tar")
    done = _console(
        "polar-vit-pretrain",
        "--dataset",
        "webdataset",
        "--data_dir",
        pattern,
        "--streaming",
        "--set",
        "data.eval_split=validation",
        "--max_steps",
        "3",
        "--eval_steps",
        "3",
        "--save_steps",
        "3",
        "--batch_size",
        "4",
        "--num_workers",
        "0",
        "--output_dir",
        str(out),
        "--no_progress",
    )
    assert "webdataset: train ? / validation ? images, 3 classes" in done.stdout
    assert len(losses(out)) == 3 and (out / "model" / "model.safetensors").exists()
