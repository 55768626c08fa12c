"""Polar-ViT model code: the single source that ships as remote code inside every Hub folder.

Flat modules with relative imports only; installed as ``polar_vit_hf.modeling``.
"""

from . import ambient, geometry

__all__ = ["ambient", "geometry"]
