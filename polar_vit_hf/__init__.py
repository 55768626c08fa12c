"""polar-vit-hf: Polar-ViT, a fully hyperbolic Vision Transformer in polar form, for transformers."""

from . import geometry
from .modeling import ambient

__version__ = "0.1.0"

__all__ = ["__version__", "ambient", "geometry"]
