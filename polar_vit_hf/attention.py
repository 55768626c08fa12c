"""Polar attention (re-export of ``polar_vit_hf.modeling.attention``): ``polar_attention`` and friends."""

from polar_vit_hf.modeling.attention import *  # noqa: F401,F403
from polar_vit_hf.modeling.attention import __all__  # noqa: F401
