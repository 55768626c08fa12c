"""training/finetune.py: Trainer fine-tuning of a saved Polar-ViT on a local imagefolder, pushed
(export -> verify -> push) to the local Hub server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from local_hub import TEST_TOKEN, TEST_USER
from PIL import Image
from safetensors.torch import load_file

import polar_vit_hf as P
from polar_vit_hf.training.data import digits_images


def make_imagefolder(root: Path, classes=(0, 1, 2), per_class=(16, 6)) -> None:
    images, labels = digits_images(32)
    for split, count in zip(("train", "test"), per_class):
        for label in classes:
            folder = root / split / f"digit_{label}"
            folder.mkdir(parents=True)
            picks = [i for i, y in enumerate(labels) if y == label]
            offset = 0 if split == "train" else per_class[0]
            for index in picks[offset : offset + count]:
                Image.fromarray(images[index]).save(folder / f"{index}.png")


def test_finetune_with_trainer_on_a_local_imagefolder_and_push(tmp_path, local_hub):
    torch.manual_seed(0)
    source = tmp_path / "pretrained"
    P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo")).save_pretrained(source)
    data = tmp_path / "data"
    make_imagefolder(data)
    out = tmp_path / "finetuned"
    command = [sys.executable, "-m", "polar_vit_hf.training.finetune", "--model", str(source), "--dataset",
               "imagefolder", "--data_dir", str(data), "--output_dir", str(out), "--max_steps", "4",
               "--per_device_batch_size", "8", "--grad_accum", "1", "--warmup_epochs", "0", "--push_to_hub"]
    env = {**local_hub.client_env(tmp_path / "hf-home", TEST_TOKEN), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "held-out accuracy (test) at the last step:" in done.stdout
    assert "new label set (3 classes): classifier head re-initialised" in done.stdout
    model = P.PolarViTForImageClassification.from_pretrained(out)
    assert model.config.id2label == {0: "digit_0", 1: "digit_1", 2: "digit_2"}
    assert model.classifier.weight.shape == (3, model.config.hidden_size)
    assert model.config.drop_path_rate == 0.1
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    # the backbone was loaded (then trained a few steps), the head replaced
    name = "polar_vit.layers.0.attention.q_proj.weight"
    assert (before[name] - after[name]).abs().max() < 0.05
    assert (out / "preprocessor_config.json").exists()
    # --push_to_hub: exported with the card, verified, pushed to <user>/<output dir name>
    assert "verified: wrote" in done.stdout and "pushed" in done.stdout
    repo = local_hub.repos[f"{TEST_USER}/finetuned"]
    files = repo.commits[repo.branches["main"]].files
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "modeling_polar_vit.py"} <= set(files)
    readme = files["README.md"].content.decode()
    card = yaml.safe_load(readme.split("---")[1])
    assert card["pipeline_tag"] == "image-classification" and card["datasets"] == ["imagefolder"]
    (result,) = card["model-index"][0]["results"]
    accuracy = json.loads((out / "eval_results.json").read_text())["eval_accuracy"]
    assert result["metrics"][0]["value"] == round(accuracy, 6) and result["dataset"]["split"] == "test"
    assert "Fine-tuned from" in readme
