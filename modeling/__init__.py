"""Polar-ViT model code: the single source that ships as remote code inside every Hub folder.

Flat modules with relative imports only; installed as ``polar_vit_hf.modeling``.
"""

from . import ambient, attention, geometry, manifold_ops, spherical
from .configuration_polar_vit import PRESETS, SPHERICAL_PRESETS, PolarViTConfig, PolarViTSphericalConfig
from .image_processing_polar_vit import PolarViTImageProcessor, PolarViTSphericalImageProcessor
from .modeling_polar_vit import (
    PolarViTForImageClassification,
    PolarViTModel,
    PolarViTModelOutput,
    PolarViTPreTrainedModel,
    PolarViTSphericalForDensePrediction,
    PolarViTSphericalForImageClassification,
    PolarViTSphericalModel,
    SphericalFieldsOutput,
)

__all__ = [
    "PRESETS",
    "SPHERICAL_PRESETS",
    "PolarViTConfig",
    "PolarViTForImageClassification",
    "PolarViTImageProcessor",
    "PolarViTModel",
    "PolarViTModelOutput",
    "PolarViTPreTrainedModel",
    "PolarViTSphericalConfig",
    "PolarViTSphericalForDensePrediction",
    "PolarViTSphericalForImageClassification",
    "PolarViTSphericalImageProcessor",
    "PolarViTSphericalModel",
    "SphericalFieldsOutput",
    "ambient",
    "attention",
    "geometry",
    "manifold_ops",
    "spherical",
]
