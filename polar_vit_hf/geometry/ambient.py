"""Ambient Lorentz twins of the polar operations (re-export of ``polar_vit_hf.modeling.ambient``)."""

from polar_vit_hf.modeling.ambient import *  # noqa: F401,F403
from polar_vit_hf.modeling.ambient import __all__  # noqa: F401
