"""Auto classes, save/load, the image-classification pipeline and remote code, all offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageClassification,
    pipeline,
)

import polar_vit_hf as P

MODELING_FILES = {
    "ambient.py",
    "attention.py",
    "configuration_polar_vit.py",
    "geometry.py",
    "image_processing_polar_vit.py",
    "manifold_ops.py",
    "modeling_polar_vit.py",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    config = P.PolarViTConfig.from_preset("demo", id2label={i: f"digit {i}" for i in range(10)})
    model = P.PolarViTForImageClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0, 1.0)
    folder = tmp_path_factory.mktemp("polar-vit-demo")
    model.save_pretrained(folder)
    P.PolarViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    pixels = torch.randn(3, 3, 32, 32)
    torch.save({"pixels": pixels, "logits": model(pixels).logits.detach()}, folder / "expected.pt")
    return folder, model


def test_save_pretrained_writes_a_complete_folder(saved):
    folder, _ = saved
    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= files
    assert MODELING_FILES <= files
    assert not any(name.endswith((".bin", ".pt")) and name != "expected.pt" for name in files)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "polar_vit"
    assert config["architectures"] == ["PolarViTForImageClassification"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_polar_vit.PolarViTConfig",
        "AutoModel": "modeling_polar_vit.PolarViTModel",
        "AutoModelForImageClassification": "modeling_polar_vit.PolarViTForImageClassification",
    }
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    assert processor["auto_map"] == {"AutoImageProcessor": "image_processing_polar_vit.PolarViTImageProcessor"}
    # the shipped files are the repository's modeling/ files, byte for byte
    import polar_vit_hf.modeling as modeling

    source = os.path.dirname(modeling.__file__)
    for name in MODELING_FILES:
        assert (folder / name).read_bytes() == open(os.path.join(source, name), "rb").read(), name


def test_round_trip_gives_identical_logits(saved):
    folder, model = saved
    expected = torch.load(folder / "expected.pt")
    loaded = P.PolarViTForImageClassification.from_pretrained(folder).eval()
    assert torch.equal(loaded(expected["pixels"]).logits, expected["logits"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_auto_classes(saved):
    folder, _ = saved
    expected = torch.load(folder / "expected.pt")
    assert isinstance(AutoConfig.from_pretrained(folder), P.PolarViTConfig)
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    assert isinstance(model, P.PolarViTForImageClassification)
    assert torch.equal(model(expected["pixels"]).logits, expected["logits"])
    base = AutoModel.from_pretrained(folder)
    assert isinstance(base, P.PolarViTModel)
    processor = AutoImageProcessor.from_pretrained(folder)
    assert isinstance(processor, P.PolarViTImageProcessor)
    batch = processor(images=[Image.new("RGB", (50, 70))], return_tensors="pt")
    assert batch["pixel_values"].shape == (1, 3, 32, 32)
    # a fresh model from a config through the Auto class
    assert isinstance(AutoModel.from_config(P.PolarViTConfig.from_preset("demo")), P.PolarViTModel)


def test_pipeline_classifies_pil_images_of_any_size(saved):
    folder, _ = saved
    classify = pipeline("image-classification", model=str(folder))
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((32, 32), (17, 91), (300, 200))
    ] + [Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8))]  # greyscale
    for image in images:
        result = classify(image, top_k=3)
        assert len(result) == 3
        assert all(item["label"].startswith("digit ") for item in result)
        assert abs(sum(item["score"] for item in classify(image, top_k=10)) - 1.0) < 1e-4


def test_remote_code_loads_where_the_package_is_not_importable(saved, tmp_path):
    folder, _ = saved
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["polar_vit_hf"] = None  # make the package unimportable in this process
        import torch
        from PIL import Image
        from transformers import AutoConfig, AutoModel, AutoModelForImageClassification, pipeline
        folder = {str(folder)!r}
        try:
            AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=False)
        except Exception as error:
            print("REFUSED", type(error).__name__)
        model = AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=True).eval()
        assert "polar_vit_hf" not in type(model).__module__, type(model).__module__
        expected = torch.load(folder + "/expected.pt")
        print("MAXDIFF", (model(expected["pixels"]).logits - expected["logits"]).abs().max().item())
        print("CONFIG", type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__name__)
        print("BASE", type(AutoModel.from_pretrained(folder, trust_remote_code=True)).__name__)
        classify = pipeline("image-classification", model=folder, trust_remote_code=True)
        print("PIPELINE", classify(Image.new("RGB", (45, 23)))[0]["label"])
        """
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert "REFUSED" in lines
    assert float(lines["MAXDIFF"]) == 0.0
    assert lines["CONFIG"] == "PolarViTConfig" and lines["BASE"] == "PolarViTModel"
    assert lines["PIPELINE"].startswith("digit ")


def test_mismatched_checkpoint_gives_a_clear_report(saved, tmp_path):
    folder, _ = saved
    labels = {0: "a", 1: "b", 2: "c"}
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        P.PolarViTForImageClassification.from_pretrained(folder, id2label=labels)
    model = P.PolarViTForImageClassification.from_pretrained(folder, id2label=labels, ignore_mismatched_sizes=True)
    assert model.classifier.weight.shape == (3, model.config.hidden_size)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in os.listdir(folder):
        (corrupt / name).write_bytes((folder / name).read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="deserializing header"):
        P.PolarViTForImageClassification.from_pretrained(corrupt)
