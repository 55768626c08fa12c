"""Polar-ViT model code: the single source that ships as remote code inside every Hub folder.

Flat modules with relative imports only; installed as ``polar_vit_hf.modeling``.
"""

from . import ambient, attention, geometry, manifold_ops
from .configuration_polar_vit import PRESETS, PolarViTConfig
from .image_processing_polar_vit import PolarViTImageProcessor
from .modeling_polar_vit import (
    PolarViTForImageClassification,
    PolarViTModel,
    PolarViTModelOutput,
    PolarViTPreTrainedModel,
)

__all__ = [
    "PRESETS",
    "PolarViTConfig",
    "PolarViTForImageClassification",
    "PolarViTImageProcessor",
    "PolarViTModel",
    "PolarViTModelOutput",
    "PolarViTPreTrainedModel",
    "ambient",
    "attention",
    "geometry",
    "manifold_ops",
]
