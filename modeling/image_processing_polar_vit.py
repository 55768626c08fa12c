"""Image processor of Polar-ViT: the ViT processor (resize, rescale, normalise) with Polar-ViT defaults.

Uses transformers' torchvision backend when torchvision is installed and the PIL backend
otherwise (the two differ by at most one uint8 step).
"""

from __future__ import annotations

from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
from transformers.utils import is_torchvision_available

if is_torchvision_available():
    from transformers.models.vit.image_processing_vit import ViTImageProcessor as _ViTImageProcessor
else:  # pragma: no cover - exercised only where torchvision is missing
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil as _ViTImageProcessor


class PolarViTImageProcessor(_ViTImageProcessor):
    """Resize to ``size`` (default 224 x 224), rescale to [0, 1], normalise with ``image_mean`` / ``image_std``.

    Accepts the usual ``size``, ``image_mean``, ``image_std``, ``do_resize``, ``do_normalize``
    keyword arguments; images of any size and mode are converted to RGB first.
    """

    model_input_names = ["pixel_values"]
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    size = {"height": 224, "width": 224}
    do_convert_rgb = True


__all__ = ["PolarViTImageProcessor"]
