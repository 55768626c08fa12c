"""Image processors of Polar-ViT: the ViT processor (resize, rescale, normalise) with Polar-ViT defaults, and the
spherical one (equirectangular images or icosphere signals onto the icosphere).

Uses transformers' torchvision backend when torchvision is installed and the PIL backend
otherwise (the two differ by at most one uint8 step).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import PIL.Image
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
from transformers.utils import is_torchvision_available

if is_torchvision_available():
    from transformers.models.vit.image_processing_vit import ViTImageProcessor as _ViTImageProcessor
else:  # pragma: no cover - exercised only where torchvision is missing
    from transformers.models.vit.image_processing_pil_vit import (  # type: ignore[assignment]
        ViTImageProcessorPil as _ViTImageProcessor,
    )

from .spherical import equirectangular_to_icosphere, icosphere

SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")


def to_eight_bit(image: PIL.Image.Image) -> PIL.Image.Image:
    """``image`` with 16-bit, 32-bit integer and float pixels scaled onto 8 bits (mode ``L``); other modes as given.

    The one pixel conversion of Polar-ViT, shared by :class:`PolarViTImageProcessor` and the training data path:
    ``value / top * 255`` rounded, with ``top = 65535`` for 16-bit images and for 32-bit integer images whose values
    exceed 255, ``1`` for float images within ``[0, 1]``, else ``max(255, largest value)``.
    """
    if image.mode not in (*SIXTEEN_BIT_MODES, "I", "F"):
        return image
    values = np.asarray(image, dtype=np.float64)
    if image.mode in SIXTEEN_BIT_MODES or (image.mode == "I" and values.max() > 255):
        top = 65535.0
    elif image.mode == "F" and values.max() <= 1.0:
        top = 1.0
    else:
        top = max(255.0, float(values.max()))
    return PIL.Image.fromarray(np.clip(np.rint(values / top * 255.0), 0, 255).astype(np.uint8))


def _eight_bit_images(images: Any) -> Any:
    """:func:`to_eight_bit` on every PIL image of a (nested) list; arrays and tensors as given."""
    if isinstance(images, PIL.Image.Image):
        return to_eight_bit(images)
    if isinstance(images, (list, tuple)):
        return type(images)(_eight_bit_images(image) for image in images)
    return images


def _per_channel(value: float | list[float] | None, default: list[float], channels: int) -> list[float]:
    """A per-channel mean / std: the given list, one value for every channel, or the default's first channels."""
    if value is None:
        return list(default[:channels])
    return [float(value)] * channels if isinstance(value, (int, float)) else list(value)


class PolarViTImageProcessor(_ViTImageProcessor):
    """Resize to ``size`` (default 224 x 224), rescale to [0, 1], normalise with ``image_mean`` / ``image_std``.

    Accepts the usual ``size``, ``image_mean``, ``image_std``, ``do_resize``, ``do_normalize``
    keyword arguments; images of any size and mode are converted to RGB first, 16-bit and float PIL images
    through :func:`to_eight_bit` (as in training).
    """

    model_input_names = ["pixel_values"]
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    size = {"height": 224, "width": 224}
    do_convert_rgb = True

    def preprocess(self, images: Any, *args: Any, **kwargs: Any) -> BatchFeature:
        """transformers' ViT preprocessing of ``images`` after :func:`to_eight_bit`."""
        return super().preprocess(_eight_bit_images(images), *args, **kwargs)


class PolarViTSphericalImageProcessor(BaseImageProcessor):
    r"""Signals on the icosphere of ``icosphere_level`` for :class:`PolarViTSphericalConfig` models.

    Accepts, one at a time or as a list:

    * equirectangular images ``H x W`` (``W = 2H``: a 360-degree panorama or a global field; PIL images, or
      arrays ``(H, W)``, ``(H, W, C)``, ``(C, H, W)``): converted to ``num_channels`` channels, bilinearly
      resampled at every vertex (:func:`spherical.equirectangular_to_icosphere`; row 0 is the north pole);
    * icosphere signals: arrays ``(V,)`` or ``(C, V)`` with ``V = 10 * 4^icosphere_level + 2``, in the vertex order
      of :func:`spherical.icosphere`.

    Then ``do_rescale`` (uint8 inputs, by ``rescale_factor``) and ``do_normalize`` (``image_mean``, ``image_std``
    per channel).  Returns ``pixel_values`` ``(batch, num_channels, V)``.
    """

    model_input_names = ["pixel_values"]

    def __init__(
        self,
        icosphere_level: int = 4,
        num_channels: int = 3,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: float | list[float] | None = None,
        image_std: float | list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_channels not in (1, 3):
            raise ValueError(f"num_channels must be 1 (greyscale) or 3 (RGB), got {num_channels!r}")
        self.icosphere_level = int(icosphere_level)
        self.num_channels = num_channels
        self.do_rescale, self.rescale_factor = do_rescale, rescale_factor
        self.do_normalize = do_normalize
        self.image_mean = _per_channel(image_mean, IMAGENET_STANDARD_MEAN, num_channels)
        self.image_std = _per_channel(image_std, IMAGENET_STANDARD_STD, num_channels)

    @property
    def num_vertices(self) -> int:
        return 10 * 4**self.icosphere_level + 2

    def to_signal(self, image: Any) -> torch.Tensor:
        """One input -> ``(C, V)`` float64 (rescaled, not yet normalised)."""
        if isinstance(image, PIL.Image.Image):
            image = np.asarray(image.convert("L" if self.num_channels == 1 else "RGB"))
        array = torch.as_tensor(np.array(image))
        integer = not array.is_floating_point()
        array = array.to(torch.float64)
        vertices = self.num_vertices
        if array.dim() == 1 and array.shape[0] == vertices:
            array = array[None]
        if array.dim() == 2 and array.shape[-1] == vertices:
            signal = array
        else:
            if array.dim() == 2:
                array = array[None]
            elif array.dim() == 3 and array.shape[-1] in (1, 3, 4) and array.shape[0] not in (1, 3, 4):
                array = array.permute(2, 0, 1)
            if array.dim() != 3:
                raise ValueError(
                    f"expected an equirectangular image (H, W[, C]) or an icosphere signal of {vertices} values per "
                    f"channel (icosphere_level={self.icosphere_level}), got shape {tuple(array.shape)}"
                )
            array = array[:3]
            if array.shape[0] != self.num_channels:
                array = array.mean(0, keepdim=True) if self.num_channels == 1 else array.expand(3, -1, -1)
            signal = equirectangular_to_icosphere(array, icosphere(self.icosphere_level))
        if signal.shape[0] != self.num_channels:
            raise ValueError(f"the signal has {signal.shape[0]} channels, the processor expects {self.num_channels}")
        return signal * self.rescale_factor if (self.do_rescale and integer) else signal

    def preprocess(self, images: Any, return_tensors: str | None = None, **kwargs: Any) -> BatchFeature:
        """``pixel_values (batch, num_channels, V)``; keyword arguments override the processor's settings."""
        unknown = set(kwargs) - {"do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std"}
        if unknown:
            raise ValueError(f"unknown arguments {sorted(unknown)}")
        processor = copy.copy(self)
        vars(processor).update(kwargs)
        if isinstance(images, (list, tuple)):
            batch = list(images)
        elif getattr(images, "ndim", 0) == 3 and images.shape[-1] == self.num_vertices:  # (batch, C, V) signals
            batch = list(images)
        else:
            batch = [images]
        signals = torch.stack([processor.to_signal(image) for image in batch])
        if processor.do_normalize:
            mean = torch.tensor(processor.image_mean, dtype=signals.dtype)[:, None]
            std = torch.tensor(processor.image_std, dtype=signals.dtype)[:, None]
            signals = (signals - mean) / std
        return BatchFeature(data={"pixel_values": signals.float()}, tensor_type=return_tensors)


__all__ = ["PolarViTImageProcessor", "PolarViTSphericalImageProcessor"]
