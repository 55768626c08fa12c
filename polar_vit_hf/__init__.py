"""polar-vit-hf: Polar-ViT, a fully hyperbolic Vision Transformer in polar form, for transformers.

``import polar_vit_hf`` registers the model with transformers' Auto classes
(``AutoConfig``, ``AutoModel``, ``AutoModelForImageClassification``, ``AutoImageProcessor``; the spherical dense
model with ``AutoModelForImageToImage``) and
marks the classes for remote code, so ``save_pretrained`` writes a folder that also loads with
``trust_remote_code=True`` where this package is not installed.
"""

import importlib

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageClassification,
    AutoModelForImageToImage,
)
from transformers.utils import is_torchvision_available

from .modeling import *  # noqa: F403 - the model classes, presets and the functional modules
from .modeling import (
    PolarViTConfig,
    PolarViTForImageClassification,
    PolarViTImageProcessor,
    PolarViTModel,
    PolarViTSphericalConfig,
    PolarViTSphericalForDensePrediction,
    PolarViTSphericalForImageClassification,
    PolarViTSphericalImageProcessor,
    PolarViTSphericalModel,
    __all__ as _modeling_all,
)
from .version import __version__

# the re-export modules replace the star-imported ``modeling.geometry`` / ``modeling.attention``
geometry = importlib.import_module(f"{__name__}.geometry")
attention = importlib.import_module(f"{__name__}.attention")


def _register() -> None:
    # the planar processor subclasses transformers' torchvision-backed ViT processor when torchvision is
    # installed and the PIL-backed one otherwise: register it under the backend it really uses (the spherical
    # processor works on tensors either way)
    backend = "torchvision" if is_torchvision_available() else "pil"
    for config, model, classifier, processor in (
        (PolarViTConfig, PolarViTModel, PolarViTForImageClassification, PolarViTImageProcessor),
        (
            PolarViTSphericalConfig,
            PolarViTSphericalModel,
            PolarViTSphericalForImageClassification,
            PolarViTSphericalImageProcessor,
        ),
    ):
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForImageClassification.register(config, classifier, exist_ok=True)
        AutoImageProcessor.register(config, image_processor_classes={backend: processor}, exist_ok=True)
        config.register_for_auto_class()
        model.register_for_auto_class("AutoModel")
        classifier.register_for_auto_class("AutoModelForImageClassification")
        processor.register_for_auto_class("AutoImageProcessor")
    # fields on the icosphere in, fields out: transformers' image-to-image class (no pipeline: the output is no image)
    AutoModelForImageToImage.register(PolarViTSphericalConfig, PolarViTSphericalForDensePrediction, exist_ok=True)
    PolarViTSphericalForDensePrediction.register_for_auto_class("AutoModelForImageToImage")


_register()

__all__ = [*_modeling_all, "__version__"]
