"""conversion/export.py and the model card: from a short pretraining run to a Hub-ready folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import save_file

import polar_vit_hf as P
from polar_vit_hf.conversion.export import ExportError, export

pytestmark = pytest.mark.slow  # processes, training runs or compiles: `make test-fast` skips them


@pytest.fixture(scope="module")
def run_dir(digits_run) -> Path:
    return digits_run


def test_export_a_pretraining_run_with_its_model_card(run_dir, tmp_path):
    out = export(run_dir, tmp_path / "polar-vit-demo", repo_id="user/polar-vit-demo", max_shard_size="100KB")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "preprocessor_config.json", "README.md", "modeling_polar_vit.py", "geometry.py"} <= names
    assert "model.safetensors.index.json" in names  # sharded above 100 KB
    assert not any(n.endswith((".bin", ".pt")) for n in names)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["PolarViTForImageClassification"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForImageClassification"}
    assert "AutoImageProcessor" in json.loads((out / "preprocessor_config.json").read_text())["auto_map"]
    source = P.PolarViTForImageClassification.from_pretrained(run_dir / "model").eval()
    exported = P.PolarViTForImageClassification.from_pretrained(out).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(source(x).logits, exported(x).logits)
    # the card: metadata parsed back with huggingface_hub's card tools
    card = ModelCard.load(out / "README.md")
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "image-classification"
    assert data.license == "apache-2.0" and {"hyperbolic", "vision-transformer"} <= set(data.tags)
    assert data.datasets == ["digits"]
    top1, top5 = data.eval_results
    with open(run_dir / "metrics.csv") as handle:
        evaluated = [row for row in csv.DictReader(handle) if row["eval_accuracy"]]
    assert top1.metric_type == "accuracy" and top5.metric_type == "top_5_accuracy"
    assert top1.dataset_split == top5.dataset_split == "test"  # the split the run evaluated (recipe eval_split)
    assert abs(top1.metric_value - float(evaluated[-1]["eval_accuracy"])) < 1e-6
    assert abs(top5.metric_value - float(evaluated[-1]["eval_top5_accuracy"])) < 1e-6
    # --which best: the best weights and the score of those weights
    best = export(run_dir, tmp_path / "best", repo_id="user/best", which="best")
    scores = json.loads((run_dir / "best_model" / "eval_results.json").read_text())
    best_top1 = ModelCard.load(best / "README.md").data.eval_results[0]
    assert best_top1.metric_value == round(scores["eval_accuracy"], 6)
    assert scores["eval_accuracy"] == max(float(row["eval_accuracy"]) for row in evaluated)
    assert "k = 1.0" in card.text and "trust_remote_code=True" in card.text and "@article" in card.text


def test_export_from_checkpoint_weights_file_and_pickle_refusal(run_dir, tmp_path):
    only_checkpoints = tmp_path / "preempted"
    only_checkpoints.mkdir()
    for name in ("checkpoints", "recipe.json", "labels.json", "metrics.csv"):
        src = run_dir / name
        target = only_checkpoints / name
        if src.is_dir():
            import shutil

            shutil.copytree(src, target)
        else:
            target.write_bytes(src.read_bytes())
    out = export(only_checkpoints, tmp_path / "from-checkpoint")
    reference = P.PolarViTForImageClassification.from_pretrained(run_dir / "model")
    restored = P.PolarViTForImageClassification.from_pretrained(out)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, weights)
    (tmp_path / "config.json").write_text(reference.config.to_json_string())
    export(weights, tmp_path / "from-file", config_spec=str(tmp_path / "config.json"))
    pickle = tmp_path / "weights.pt"
    torch.save(reference.state_dict(), pickle)
    with pytest.raises(ExportError, match="pickle"):
        export(pickle, tmp_path / "refused", config_spec=str(tmp_path / "config.json"))
    export(pickle, tmp_path / "allowed", config_spec=str(tmp_path / "config.json"), allow_pickle=True)
    with pytest.raises(ExportError, match="do not match"):
        export(weights, tmp_path / "mismatch", config_spec="tiny")


def test_export_refuses_damaged_or_diverged_weights(run_dir, tmp_path):
    import shutil

    reference = P.PolarViTForImageClassification.from_pretrained(run_dir / "model")
    config = tmp_path / "config.json"
    reference.config.to_json_file(config)
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, weights)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ExportError, match="not a readable safetensors file"):
        export(truncated, tmp_path / "out-truncated", config_spec=str(config))
    folder = tmp_path / "damaged-folder"
    shutil.copytree(run_dir / "model", folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ExportError, match="could not load the saved model"):
        export(folder, tmp_path / "out-folder")
    state = {k: v.clone().contiguous() for k, v in reference.state_dict().items()}
    state["classifier.bias"][0] = float("nan")
    diverged = tmp_path / "diverged.safetensors"
    save_file(state, diverged)
    with pytest.raises(ExportError, match="NaN/Inf .*classifier.bias"):
        export(diverged, tmp_path / "out-diverged", config_spec=str(config))
    assert not (tmp_path / "out-diverged").exists()


def test_verify_loads_the_export_both_ways_and_catches_a_mismatch(run_dir, tmp_path):
    from polar_vit_hf.conversion.verify import MARKER, folder_digest, verify

    out = export(run_dir, tmp_path / "verified")
    assert verify(out, source=run_dir)
    marker = json.loads((out / MARKER).read_text())
    assert marker["files"] == folder_digest(out)
    # a folder whose weights differ from the source checkpoint fails, and gets no marker
    tampered = export(run_dir, tmp_path / "tampered")
    model = P.PolarViTForImageClassification.from_pretrained(tampered)
    with torch.no_grad():
        model.classifier.bias.add_(0.5)
    model.save_pretrained(tampered)
    assert not verify(tampered, source=run_dir)
    assert not (tampered / MARKER).exists()


def test_push_refuses_unverified_or_changed_folders_and_dry_runs(run_dir, tmp_path, capsys):
    from polar_vit_hf.conversion.push import PushError, push
    from polar_vit_hf.conversion.verify import MARKER, folder_digest

    out = export(run_dir, tmp_path / "to-push")
    with pytest.raises(PushError, match="has not passed verification"):
        push(out, "user/polar-vit-demo", dry_run=True)
    (out / MARKER).write_text(json.dumps({"tolerance": 1e-5, "files": folder_digest(out)}))
    push(out, "user/polar-vit-demo", private=True, revision="v1", dry_run=True)
    printed = capsys.readouterr().out
    assert "would upload" in printed and "model.safetensors" in printed and "README.md" in printed
    (out / "README.md").write_text("edited after verification")
    with pytest.raises(PushError, match="changed since it was verified"):
        push(out, "user/polar-vit-demo", dry_run=True)
