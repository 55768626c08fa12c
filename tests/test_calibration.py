"""First-batch radius calibration (D.2): every Polar-FC's median output radius hits the target."""

from __future__ import annotations

import pytest
import torch

import polar_vit_hf as P
from polar_vit_hf.training.calibration import calibratable_layers, calibrate_radii, log_sinh
from polar_vit_hf.training.data import digits_images


def digits_batch(count: int = 16, dtype=torch.float32) -> torch.Tensor:
    images, _ = digits_images(32)
    processor = P.PolarViTImageProcessor(size={"height": 32, "width": 32})
    return processor(images=list(images[:count]), return_tensors="pt")["pixel_values"].to(dtype)


def median_radii(model, pixel_values) -> dict[str, torch.Tensor]:
    seen = {}
    handles = [
        layer.register_forward_hook(
            lambda module, args, output, name=name: seen.__setitem__(name, args[1].radius(output).double())
        )
        for name, layer in calibratable_layers(model)
    ]
    with torch.no_grad():
        model(pixel_values=pixel_values)
    for handle in handles:
        handle.remove()
    return {
        name: r.reshape(-1, layer.radius_bias.numel()).median(dim=0).values
        for (name, layer), r in zip(calibratable_layers(model), seen.values())
    }


@pytest.mark.parametrize(
    "arithmetic, dtype, target",
    [("polar", torch.float32, 2.0), ("polar", torch.float32, 6.0), ("ambient", torch.float64, 3.0)],
)
def test_every_layer_and_head_reaches_the_target_median_radius(arithmetic, dtype, target):
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", arithmetic=arithmetic)).to(dtype)
    model.train()
    pixels = digits_batch(dtype=dtype)
    others = {n: p.clone() for n, p in model.named_parameters() if not n.endswith("radius_bias")}
    before = calibrate_radii(model, pixels, target)
    assert model.training  # mode restored
    assert len(before) == len(calibratable_layers(model)) == 1 + 6 * model.config.num_hidden_layers
    assert any(abs(r - target) > 0.5 for radii in before.values() for r in radii)  # it did change something
    for name, median in median_radii(model, pixels).items():
        assert torch.allclose(median, torch.full_like(median, target), atol=1e-4 * target), name
    for name, parameter in model.named_parameters():
        if name in others:
            assert torch.equal(parameter, others[name]), name
    assert torch.isfinite(model(pixel_values=pixels).logits).all()


def test_calibration_errors():
    pixels = digits_batch(4)
    lorentz = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", linear="lorentz"))
    with pytest.raises(ValueError, match="no Polar-FC with a radius rule"):
        calibrate_radii(lorentz, pixels, 2.0)
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo"))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            calibrate_radii(model, pixels, bad)
    with torch.no_grad():  # a dead patch projection: h = 0 and beta = 10 underflow the radius to 0
        model.polar_vit.embeddings.patch_projection.weight.zero_()
        model.polar_vit.embeddings.patch_projection.norm_power.fill_(10.0)
    with pytest.raises(ValueError, match="median output radius"):
        calibrate_radii(model, pixels, 2.0)


def test_log_sinh_matches_float64_reference():
    a = torch.tensor([1e-6, 0.1, 1.0, 8.0, 30.0, 80.0], dtype=torch.float64)
    reference = torch.log(torch.sinh(a))
    assert torch.allclose(log_sinh(a), reference, rtol=1e-12)
    assert torch.isfinite(log_sinh(torch.tensor([500.0], dtype=torch.float64))).all()  # sinh would overflow
