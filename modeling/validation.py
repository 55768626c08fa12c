"""Validation at the edge: the input checks of the public geometry functions and of the model.

The public functions of :mod:`geometry` and :mod:`subgroups` check shapes, the curvature ``k > 0`` and (for CPU
tensors, where it is cheap) NaN/Inf inputs; the model checks ``pixel_values`` once (:func:`check_pixel_values`)
and runs its layers without the per-operation scans (``runtime.RuntimeOptions.input_checks``, per context).

This module is part of the remote code of exported checkpoints: it imports only ``torch`` and sibling modules.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .runtime import runtime_options, set_runtime_options, use_runtime_options
from .spherical import patch_index
from .torch_internals import assert_on_device, functorch_transforms_active

if TYPE_CHECKING:
    from .configuration_polar_vit import PolarViTConfig

Curvature = Union[float, Tensor]

__all__ = ["PATCH_RADIUS_LIMIT", "Curvature", "check_pixel_values", "input_checks", "set_input_checks"]


# --------------------------------------------------------------------------------------------
# the geometry's input checks
# --------------------------------------------------------------------------------------------
def set_input_checks(enabled: bool) -> bool:
    """Turn the (CPU-only) non-finite input checks on or off for this context (thread); returns the previous
    setting (``runtime.RuntimeOptions.input_checks``)."""
    return set_runtime_options(input_checks=bool(enabled)).input_checks


@contextmanager
def input_checks(enabled: bool) -> Iterator[None]:
    """Context manager form of :func:`set_input_checks` (this context only, restored on exit)."""
    with use_runtime_options(input_checks=bool(enabled)):
        yield


def _sqrt_k(k: Curvature) -> Curvature:
    """Validate the curvature parameter ``k > 0`` and return ``sqrt(k)``."""
    if isinstance(k, Tensor):
        if k.numel() != 1:
            raise ValueError(f"k must be a scalar, got a tensor of shape {tuple(k.shape)}")
        if _values_checkable(k) and not (torch.isfinite(k).all() and (k > 0).all()):
            raise ValueError(f"k must be a finite positive number (curvature -1/k), got {k.item()}")
        return k.sqrt()
    k = float(k)
    if torch.compiler.is_compiling():  # traced inside a compiled kernel: validated where the value came from
        return math.sqrt(k)
    if not (math.isfinite(k) and k > 0):
        raise ValueError(f"k must be a finite positive number (curvature -1/k), got {k}")
    return math.sqrt(k)


def _values_checkable(t: Tensor) -> bool:
    """Value checks are cheap only for CPU tensors outside of compilation and tracing, and possible only outside
    ``torch.func`` transforms (a check is data-dependent control flow, which ``vmap`` refuses)."""
    return (
        runtime_options().input_checks
        and t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not functorch_transforms_active()
    )


def _check_finite(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if isinstance(t, Tensor) and _values_checkable(t) and not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or Inf values")


def _check_point(r: Tensor, u: Tensor, name: str) -> None:
    """A polar point needs ``u.dim() >= 1`` and ``r.shape`` broadcastable with ``u.shape[:-1]``."""
    if u.dim() < 1:
        raise ValueError(f"direction u{name} must have a trailing feature axis, got a scalar")
    try:
        torch.broadcast_shapes(tuple(r.shape), tuple(u.shape[:-1]))
    except RuntimeError:
        raise ValueError(
            f"shape mismatch: radius r{name} has shape {tuple(r.shape)} but direction u{name} has "
            f"shape {tuple(u.shape)}; r must broadcast with u.shape[:-1]"
        ) from None
    _check_finite(**{f"r{name}": r, f"u{name}": u})


def _check_same_dim(u1: Tensor, u2: Tensor, what: str = "directions") -> None:
    if u1.shape[-1] != u2.shape[-1]:
        raise ValueError(f"{what} live in different dimensions: {u1.shape[-1]} vs {u2.shape[-1]}")


def _check_axis(axis: int, n: int, name: str) -> None:
    if not (0 <= int(axis) < n):
        raise ValueError(f"{name}={axis} is not a space axis of a point with n={n} space coordinates")


# --------------------------------------------------------------------------------------------
# the model's input
# --------------------------------------------------------------------------------------------
# Largest patch radius (RMS pixel value of a patch) the model accepts: deeper layers grow radii by a few units and
# the polar arithmetic holds to r ~ 88 in float32 (measured: fused tiny-cifar finite at RMS 30, not at 40).
PATCH_RADIUS_LIMIT = 32.0


def check_pixel_values(pixel_values: Tensor | None, config: PolarViTConfig) -> None:
    """Validate the model input once, at the edge: layout, channels, finiteness and the pixel scale (patch RMS).

    The values are checked by one read of the largest patch RMS (NaN or infinite where a value is) on the CPU,
    and by a device-side assertion on a GPU and inside ``torch.compile``: the host never waits for the device."""
    if pixel_values is None:
        raise ValueError("You have to specify pixel_values")
    spherical_input = config.is_spherical
    layout = "(batch, channels, vertices)" if spherical_input else "(batch, channels, height, width)"
    if pixel_values.dim() != (3 if spherical_input else 4):
        raise ValueError(
            f"pixel_values must have shape {layout}, got {tuple(pixel_values.shape)}"
            + ("; resample images with PolarViTSphericalImageProcessor" if spherical_input else "")
        )
    if pixel_values.shape[0] == 0:
        raise ValueError(f"pixel_values is an empty batch (shape {tuple(pixel_values.shape)}): pass one image or more")
    if pixel_values.shape[1] != config.num_channels:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[1]} channels but the model expects "
            f"num_channels={config.num_channels}; check the image mode (e.g. convert to RGB)"
        )
    if spherical_input and pixel_values.shape[2] != config.num_vertices:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[2]} values per channel but icosphere_level="
            f"{config.icosphere_level} has {config.num_vertices} vertices; resample with "
            f"PolarViTSphericalImageProcessor(icosphere_level={config.icosphere_level})"
        )
    if not spherical_input:
        height, width = pixel_values.shape[-2:]
        if height % config.patch_size or width % config.patch_size:
            raise ValueError(f"image size {height}x{width} is not a multiple of patch_size={config.patch_size}")
    if functorch_transforms_active():  # value checks are data-dependent control flow: vmap refuses them
        return
    # the radius of a patch token is the RMS of its values (PolarViTEmbeddings): keep it where float32 holds
    power = pixel_values.detach().float().square().mean(1)
    if spherical_input:
        index = patch_index(config.icosphere_level, config.patch_level)
        patch_rms = power[:, index.to(power.device)].mean(-1).sqrt()
        patch = "patch"
    else:
        patch_rms = F.avg_pool2d(power.unsqueeze(1), config.patch_size).sqrt()
        patch = f"{config.patch_size}x{config.patch_size} patch"
    processor = "PolarViTSphericalImageProcessor" if spherical_input else "PolarViTImageProcessor"
    advice = (
        f"(Polar-ViT supports patch radii up to {PATCH_RADIUS_LIMIT:g}; float32 overflows near 88). Rescale and "
        f"normalise the images first, e.g. with {processor} (do_rescale=True, do_normalize=True), so pixel values "
        "are of order 1"
    )
    largest = patch_rms.flatten().amax(0)  # NaN where a value is NaN, inf where one is infinite (ONNX: one axis)
    if pixel_values.device.type != "cpu" or torch.compiler.is_compiling():
        # a device-side assertion: the host never waits for the device's answer (no sync, CUDA graphs capture it)
        message = f"pixel_values contain NaN or Inf values, or a {patch} RMS above {PATCH_RADIUS_LIMIT:g} "
        assert_on_device(largest <= PATCH_RADIUS_LIMIT, message + advice)
        return
    value = float(largest)  # on the CPU: one read of host memory
    if not math.isfinite(value):
        raise ValueError("pixel_values contains NaN or Inf values")
    if value > PATCH_RADIUS_LIMIT:
        raise ValueError(
            f"pixel_values look unnormalised: a {patch} has RMS {value:.1f}, and that RMS is the radius of its "
            f"token on the hyperboloid {advice}"
        )
