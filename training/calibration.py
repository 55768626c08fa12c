"""First-batch radius calibration (paper Appendix D.2).

"The scale of every layer and the radius gain of each attention head are calibrated on the first
training batch, so that all models compared start at the same radius."  Our reading: every
Polar-FC (Eq. 8) with a radius rule - the patch projection, the MLP layers and the output
projection (one "scale" per layer) and the per-head query/key/value projections (one "radius
gain" per head) - gets its radius bias ``varphi_0`` shifted so that the **median output radius on
the batch equals ``target_radius``**.  The log-radius ``l = beta ln||h|| + lambda a + varphi^T chi +
varphi_0`` moves one for one with ``varphi_0`` and ``a' = sqrt(k) arsinh(e^l)`` is monotone in
``l``, so one shift per head, ``varphi_0 += ln sinh(target / sqrt(k)) - median(l)``, is exact on
that batch.  Layers are calibrated in forward order, each on the outputs of the already
calibrated layers before it; the model runs in eval mode (no drop path) and is left as it was.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from polar_vit_hf.modeling.modeling_polar_vit import PolarFC


class _Captured(Exception):
    """Raised by the hook to stop the forward pass once the calibrated layer has run."""


def log_sinh(a: Tensor) -> Tensor:
    """``ln sinh a`` for ``a > 0``, without overflow: ``a + ln((1 - e^{-2a}) / 2)``."""
    return a + torch.log(-torch.expm1(-2.0 * a) / 2.0)


def calibratable_layers(model: nn.Module) -> list[tuple[str, PolarFC]]:
    """The Polar-FCs with a radius rule, in registration (= forward) order."""
    return [
        (name, module) for name, module in model.named_modules() if isinstance(module, PolarFC) and module.radius_rule
    ]


@torch.no_grad()
def calibrate_radii(model: nn.Module, pixel_values: Tensor, target_radius: float) -> dict[str, list[float]]:
    """Shift every Polar-FC's radius bias so its median output radius on ``pixel_values`` is
    ``target_radius`` (per head for split-head projections).  Returns, per layer, the median
    radii before calibration.  Raises ``ValueError`` for a model without radius rules
    (``linear="lorentz"``) or a non-positive / non-finite target."""
    if not (math.isfinite(target_radius) and target_radius > 0):
        raise ValueError(f"target_radius must be a positive finite radius, got {target_radius}")
    layers = calibratable_layers(model)
    if not layers:
        raise ValueError("the model has no Polar-FC with a radius rule to calibrate (linear='lorentz'?)")
    sqrt_k = layers[0][1].sqrt_k
    target = math.log(math.sinh(target_radius / sqrt_k))
    before: dict[str, list[float]] = {}
    was_training = model.training
    model.eval()
    try:
        for name, layer in layers:
            captured: list[Tensor] = []

            def hook(module, args, output, captured=captured):
                ops = args[1]
                captured.append(ops.radius(output).double())
                raise _Captured

            handle = layer.register_forward_hook(hook)
            try:
                model(pixel_values=pixel_values)
            except _Captured:
                pass
            finally:
                handle.remove()
            radius = captured[0]  # (..., H) for split heads, (...) otherwise
            heads = layer.radius_bias.numel()
            per_head = radius.reshape(-1, heads) if layer.num_heads else radius.reshape(-1, 1)
            median = per_head.median(dim=0).values  # (H,)
            if not bool((median > 0).all() and torch.isfinite(median).all()):
                raise ValueError(
                    f"{name}: median output radius {median.tolist()} on this batch; calibrate on "
                    f"real images, or check the layer (its radius underflowed to the origin)"
                )
            before[name] = median.tolist()
            shift = target - log_sinh(median / sqrt_k)
            layer.radius_bias.add_(shift.to(layer.radius_bias.dtype))
    finally:
        model.train(was_training)
    return before
