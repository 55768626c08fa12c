"""training/finetune.py: Trainer fine-tuning through the console script on the official CUB and Aircraft layouts
(pushed to the local Hub server), exactly the same result on 1 and 2 processes, the same seed giving the same
weights, and an exact resume after preemption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from local_hub import TEST_TOKEN, TEST_USER
from official_layouts import write_aircraft, write_cub
from safetensors.torch import load_file

import polar_vit_hf as P

pytestmark = pytest.mark.slow  # processes, training runs or compiles: `make test-fast` skips them

SCRIPT = str(Path(sys.executable).parent / "polar-vit-finetune")
# no randomness but the data order: stochastic depth, augmentation and mixing would draw per process
PLAIN = [
    "--rand_augment",
    "none",
    "--color_jitter",
    "0",
    "--random_erasing",
    "0",
    "--crop_scale",
    "1",
    "--hflip",
    "0",
    "--mixup",
    "0",
    "--cutmix",
    "0",
    "--drop_path",
    "0",
    "--report_to",
    "none",
    "--logging_steps",
    "1",
    "--dataloader_num_workers",
    "0",
    "--image_size",
    "32",
]


def finetune(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**(env or os.environ), "OMP_NUM_THREADS": "1"},
    )
    if check:
        assert done.returncode == 0, done.stderr[-4000:]
    return done


def cub_run(model: Path, cub: Path, out: Path, steps: int, batch: int, *extra: str) -> list[str]:
    """The arguments of a plain CUB fine-tuning run: ``steps`` steps of ``batch`` images per process, no
    accumulation, ``extra`` flags appended."""
    return [
        "--model",
        str(model),
        "--dataset",
        "cub",
        "--data_dir",
        str(cub),
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--per_device_batch_size",
        str(batch),
        "--grad_accum",
        "1",
        *extra,
        *PLAIN,
    ]


def losses(folder: Path) -> list[float]:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("pretrained")
    P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cub(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cub")
    write_cub(root)
    return root


@pytest.fixture(scope="module")
def single(pretrained, cub, tmp_path_factory) -> Path:
    """Three steps on one process, batch 4, checkpoints every step."""
    out = tmp_path_factory.mktemp("single") / "run"
    finetune(*cub_run(pretrained, cub, out, 3, 4, "--save_strategy", "steps", "--save_steps", "1"))
    return out


def test_finetune_cub_official_layout_with_the_recipe_and_push(pretrained, cub, tmp_path, local_hub):
    out = tmp_path / "finetuned"
    env = local_hub.client_env(tmp_path / "hf-home", TEST_TOKEN)
    done = finetune(
        "--recipe",
        "cub",
        "--model",
        str(pretrained),
        "--data_dir",
        str(cub),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--per_device_batch_size",
        "2",
        "--effective_batch",
        "4",
        "--image_size",
        "32",
        "--report_to",
        "none",
        "--push_to_hub",
        env=env,
    )
    assert "cub: train 6 / test 6 images, 3 classes" in done.stdout
    assert "new label set (3 classes): a new classifier head" in done.stdout
    assert "held-out accuracy (test, 6 images) at the last step: top-1" in done.stdout
    model = P.PolarViTForImageClassification.from_pretrained(out)
    assert model.config.id2label == {0: "Black footed Albatross", 1: "Laysan Albatross", 2: "Sooty Albatross"}
    assert model.config.drop_path_rate == 0.1  # the recipe's stochastic depth
    info = json.loads((out / "run_info.json").read_text())
    assert info["effective_batch"] == 4 and info["grad_accum"] == 2 and info["recipe"] == "cub"
    assert info["lr"] == pytest.approx(5e-4 * 4 / 512) and info["eval_split"] == "test"
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_count"] == 6 and 0 <= results["eval_top_5_accuracy"] <= 1
    before, after = load_file(pretrained / "model.safetensors"), load_file(out / "model.safetensors")
    name = "polar_vit.layers.0.attention.q_proj.weight"
    assert (before[name] - after[name]).abs().max() < 0.05  # the backbone was loaded, then trained a few steps
    # --push_to_hub: exported with the card, verified, pushed to <user>/<output dir name>
    assert "verified: wrote" in done.stdout and "pushed" in done.stdout
    repo = local_hub.repos[f"{TEST_USER}/finetuned"]
    files = repo.commits[repo.branches["main"]].files
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "modeling_polar_vit.py"} <= set(files)
    card = yaml.safe_load(files["README.md"].content.decode().split("---")[1])
    assert card["pipeline_tag"] == "image-classification" and card["datasets"] == ["cub"]
    top1 = next(m for m in card["model-index"][0]["results"][0]["metrics"] if m["type"] == "accuracy")
    assert top1["value"] == round(results["eval_accuracy"], 6)
    assert card["model-index"][0]["results"][0]["dataset"]["split"] == "test"


def test_finetune_aircraft_trains_on_trainval_and_scores_test(pretrained, tmp_path):
    write_aircraft(tmp_path / "data")
    out = tmp_path / "aircraft"
    done = finetune(
        "--recipe",
        "aircraft",
        "--model",
        str(pretrained),
        "--data_dir",
        str(tmp_path / "data"),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_batch_size",
        "2",
        "--effective_batch",
        "2",
        *PLAIN,
    )
    assert "aircraft: train 5 / val 5 / trainval 10 / test 5 images, 5 classes" in done.stdout
    assert "held-out accuracy (test, 5 images)" in done.stdout
    info = json.loads((out / "run_info.json").read_text())
    assert info["train_split"] == "trainval" and info["eval_split"] == "test" and info["num_labels"] == 5
    assert P.PolarViTConfig.from_pretrained(out).id2label[0] == "F/A-18"


@pytest.mark.parametrize("arch", ["polar", "euclidean"])
def test_finetune_under_bf16_for_both_architectures(arch, cub, tmp_path):
    """``--bf16`` (Trainer's autocast: the precision policy for Polar-ViT) and the same-size ViT baseline of Table 3
    (``--arch euclidean``, AdamW) from a transformers ViT checkpoint."""
    from polar_vit_hf.baselines import euclidean_vit

    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset("demo")
    model = euclidean_vit(config) if arch == "euclidean" else P.PolarViTForImageClassification(config)
    model.save_pretrained(tmp_path / "pretrained")
    out = tmp_path / arch
    done = finetune("--arch", arch, *cub_run(tmp_path / "pretrained", cub, out, 2, 2, "--bf16"))
    assert "held-out accuracy (test, 6 images)" in done.stdout
    info = json.loads((out / "run_info.json").read_text())
    assert info["arch"] == arch
    trained = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in trained.values())  # fp32 masters
    logged = losses(out)
    assert logged and all(torch.isfinite(torch.tensor(loss)) for loss in logged)


def test_the_same_seed_gives_bit_identical_weights(single, pretrained, cub, tmp_path):
    again = tmp_path / "again"
    finetune(*cub_run(pretrained, cub, again, 3, 4, "--save_strategy", "no"))
    expected, got = load_file(single / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert losses(single) == losses(again)


def test_a_preempted_run_resumes_exactly(single, pretrained, cub, tmp_path):
    out = tmp_path / "preempted"
    args = cub_run(pretrained, cub, out, 3, 4, "--save_strategy", "steps", "--save_steps", "1")
    done = finetune(*args, "--stop_after_steps", "2")
    assert "stopping after the checkpoint at step 2" in done.stdout and not (out / "model.safetensors").exists()
    again = finetune(*args, check=False)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr
    finetune(*args, "--resume_from_checkpoint")
    expected, got = load_file(single / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def _loopback_only() -> list[str] | None:
    """Command prefix running inside a new network namespace with only loopback (root + unshare)."""
    import shutil

    if shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0:
        return None
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return None if probe.returncode else ["unshare", "-n"]


def test_two_processes_equal_one_process_with_the_same_global_batch(single, pretrained, cub, tmp_path):
    prefix = _loopback_only()
    if prefix is None:
        pytest.skip("needs root and unshare to keep the gloo rendezvous inside a loopback-only namespace")
    double = tmp_path / "double"
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        "2",
        SCRIPT,
        *cub_run(pretrained, cub, double, 3, 2, "--save_strategy", "no"),
    ]
    done = subprocess.run(
        [*prefix, "bash", "-c", 'ip link set lo up && exec "$@"', "-", *command],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    one, two = losses(single), losses(double)
    assert len(one) == len(two) == 3
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
    first, second = (json.loads((f / "eval_results.json").read_text()) for f in (single, double))
    assert first["eval_count"] == second["eval_count"] == 6  # 6 test images, eval batch 4 / 2 x 2: none twice
    assert round(first["eval_accuracy"] * 6) == round(second["eval_accuracy"] * 6)
    assert json.loads((double / "run_info.json").read_text())["processes"] == 2
    assert done.stdout.count("held-out accuracy") == 1  # only the main process reports and writes
