"""Functional polar-form Lorentz geometry (re-export of ``polar_vit_hf.modeling.geometry``).

``polar_vit_hf.geometry.ambient`` holds the ambient-coordinate twins of every operation.
"""

from polar_vit_hf.modeling.geometry import *  # noqa: F401,F403
from polar_vit_hf.modeling.geometry import __all__ as _polar_all

from . import ambient

__all__ = [*_polar_all, "ambient"]
