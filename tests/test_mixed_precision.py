"""The mixed-precision policy: Polar-FC products in bf16 / fp16, the geometry in float32, half-precision weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageClassification, pipeline

import polar_vit_hf as P
from polar_vit_hf.modeling import fused_layers
from polar_vit_hf.training.calibration import calibrate_radii

BF16 = torch.bfloat16


def demo_model(**overrides) -> P.PolarViTForImageClassification:
    torch.manual_seed(0)
    return P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", **overrides))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


class ProductDtypes:
    """Records the dtypes the Polar-FC products ran in (``fused_layers.policy_matmul`` is their one entry)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[torch.dtype] = []
        original = fused_layers.policy_matmul

        def recording(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
            self.seen.append(dtype or a.dtype)
            return original(a, b, dtype)

        monkeypatch.setattr(fused_layers, "policy_matmul", recording)
        import polar_vit_hf.modeling.manifold_ops as manifold_ops

        monkeypatch.setattr(manifold_ops, "policy_matmul", recording)


@pytest.mark.parametrize("fused_ops", [True, False])
def test_autocast_bf16_runs_the_products_in_bf16_and_the_geometry_in_float32(monkeypatch, fused_ops):
    model = demo_model(fused_ops=fused_ops).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        reference = model.double()(x.double())
        reference_radii = model.polar_vit(x.double()).last_hidden_polar[..., 0]
        model.float()
        products = ProductDtypes(monkeypatch)
        with torch.autocast("cpu", dtype=BF16):
            out = model(x, output_hidden_states=True)
            radii = model.polar_vit(x).last_hidden_polar[..., 0]
    assert products.seen and set(products.seen) == {BF16}
    assert out.logits.dtype == torch.float32
    assert all(h.dtype == torch.float32 for h in out.hidden_states)
    assert radii.dtype == torch.float32
    # really in bf16 (not float32 in disguise), and within the policy's table (5.4e-3 at r = 0)
    error = relative_error(out.logits, reference.logits)
    assert 1e-5 < error < 3e-2
    assert torch.allclose(radii.double(), reference_radii, rtol=2e-2, atol=2e-2)


def test_policy_at_radius_4_stays_within_its_table():
    """The benchmark's 1.0e-2 at r = 4 (``benchmarks/precision_policy.py``), here on the demo model."""
    model = demo_model(num_labels=10).double().eval()
    pixels = torch.randn(16, 3, 32, 32)
    calibrate_radii(model, pixels.double(), 4.0)
    with torch.no_grad():
        exact = model(pixels.double()).logits
        model.float()
        with torch.autocast("cpu", dtype=BF16):
            policy = model(pixels).logits
    assert relative_error(policy, exact) < 3e-2


def test_autocast_training_step_gives_float32_gradients_close_to_float32():
    model = demo_model()
    x, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 2, (8,))
    model(pixel_values=x, labels=labels).loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=BF16):
        loss = model(pixel_values=x, labels=labels).loss
    assert loss.dtype == torch.float32
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    got = torch.cat([p.grad.flatten() for _, p in model.named_parameters()])
    flat = torch.cat([g.flatten() for g in want.values()])
    assert torch.nn.functional.cosine_similarity(got, flat, dim=0) > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_load_run_and_train(tmp_path, dtype):
    model = demo_model().eval()
    model.save_pretrained(tmp_path)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x).logits
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path, dtype=dtype)
    assert all(p.dtype == dtype for p in loaded.parameters())
    with torch.no_grad():
        got = loaded.eval()(x).logits
    assert got.dtype == torch.float32 and relative_error(got, want) < 5e-2
    # .half() / .to(bfloat16) on a live model, then a training step: gradients in the weights' dtype
    live = demo_model().to(dtype)
    live(pixel_values=x, labels=torch.tensor([0, 1, 0])).loss.backward()
    for p in live.parameters():
        assert p.grad is not None and p.grad.dtype == dtype and torch.isfinite(p.grad).all()


def test_pipeline_with_float16_weights(tmp_path):
    model = demo_model(id2label={0: "cat", 1: "dog"})
    model.save_pretrained(tmp_path)
    P.PolarViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    classify = pipeline("image-classification", model=str(tmp_path), dtype=torch.float16)
    assert classify.model.dtype == torch.float16
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8))
    result = classify(image, top_k=2)
    assert {item["label"] for item in result} == {"cat", "dog"}
    assert abs(sum(item["score"] for item in result) - 1.0) < 1e-3


@pytest.mark.slow
def test_the_policy_benchmark_prints_and_writes_its_table(tmp_path, capsys):
    from polar_vit_hf.benchmarks.precision_policy import main

    assert main(["--radii", "0", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "bf16 policy" in printed and "bf16 weights" in printed
    rows = (tmp_path / "precision_policy.csv").read_text().splitlines()
    assert len(rows) == 2 and (tmp_path / "precision_policy.png").stat().st_size > 0
    header, first = rows[0].split(","), [float(v) for v in rows[1].split(",")]
    row = dict(zip(header, first))
    assert row["float32"] < 1e-4 < row["bf16_policy"] < 3e-2  # the table's r = 0 row: 5.5e-06, 5.4e-03
