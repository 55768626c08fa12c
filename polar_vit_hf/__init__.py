"""polar-vit-hf: Polar-ViT, a fully hyperbolic Vision Transformer in polar form, for transformers.

``import polar_vit_hf`` registers the model with transformers' Auto classes
(``AutoConfig``, ``AutoModel``, ``AutoModelForImageClassification``, ``AutoImageProcessor``) and
marks the classes for remote code, so ``save_pretrained`` writes a folder that also loads with
``trust_remote_code=True`` where this package is not installed.
"""

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageClassification,
)

from . import geometry
from .modeling import ambient, attention
from .modeling.configuration_polar_vit import PRESETS, PolarViTConfig
from .modeling.image_processing_polar_vit import PolarViTImageProcessor
from .modeling.modeling_polar_vit import (
    PolarViTForImageClassification,
    PolarViTModel,
    PolarViTModelOutput,
    PolarViTPreTrainedModel,
)

__version__ = "0.1.0"


def _register() -> None:
    AutoConfig.register(PolarViTConfig.model_type, PolarViTConfig, exist_ok=True)
    AutoModel.register(PolarViTConfig, PolarViTModel, exist_ok=True)
    AutoModelForImageClassification.register(PolarViTConfig, PolarViTForImageClassification, exist_ok=True)
    AutoImageProcessor.register(PolarViTConfig, slow_image_processor_class=PolarViTImageProcessor, exist_ok=True)
    PolarViTConfig.register_for_auto_class()
    PolarViTModel.register_for_auto_class("AutoModel")
    PolarViTForImageClassification.register_for_auto_class("AutoModelForImageClassification")
    PolarViTImageProcessor.register_for_auto_class("AutoImageProcessor")


_register()

__all__ = [
    "PRESETS",
    "PolarViTConfig",
    "PolarViTForImageClassification",
    "PolarViTImageProcessor",
    "PolarViTModel",
    "PolarViTModelOutput",
    "PolarViTPreTrainedModel",
    "__version__",
    "ambient",
    "attention",
    "geometry",
]
