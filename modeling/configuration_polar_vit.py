"""Configuration of Polar-ViT (paper Section 4, Appendix D) with the ablation switches of Tables 5/6."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

from transformers import PreTrainedConfig

# Switch values: one per row of the paper's Tables 5 and 6 and the neighbouring systems.
RELATIVE_POSITIONS = ("horoshift", "boost", "rotation", "so3", "none")  # Polar-ViT / HoPE / HOPE, HELM / SO(3)-RoPE
RESIDUALS = ("boost", "space", "lorentz_midpoint")  # Eq. 12 / Chen et al. 2022 / LResNet
LINEARS = ("polar", "lorentz")  # Polar-FC Eq. 8 / Lorentz FC of Chen et al. 2022
READOUTS = ("centroid", "cls")
HEADS = ("lorentz_mlr", "poincare_mlr", "tangent_linear")  # Bdeir et al. 2024 / HNN++ / hybrid
ARITHMETICS = ("polar", "ambient")
POSITION_EMBEDDINGS = ("learned", "sincos", "hypformer", "none")  # ... / Hypformer's learnable encoding / none
HEAD_MERGES = ("direct_concat", "beta_concat")  # Lorentz direct concatenation (Sec. 4.2) / HNN++ beta-concat


def attention_implementations() -> tuple[str, ...]:
    """``"auto"`` and every key of ``attention.PolarAttentionInterface`` (built-in or registered)."""
    from .attention import POLAR_ATTENTION_FUNCTIONS  # imported when validating: the config module stays light

    return ("auto", *POLAR_ATTENTION_FUNCTIONS)


# Reserved space axes of every head for the 2-D relative positional encoding: one (ideal, shift)
# pair per grid axis (rows, columns), Eq. 10 and Appendix C.2.
POSITION_AXES = ((0, 1), (2, 3))

PRESETS: dict[str, dict[str, Any]] = {
    # Appendix D.3 (HexFormer sizes, CIFAR-100 / Tiny-ImageNet)
    "tiny-cifar": dict(
        image_size=32,
        patch_size=4,
        num_hidden_layers=9,
        hidden_size=192,
        intermediate_size=384,
        num_attention_heads=12,
        position_embedding="learned",
    ),
    "base-cifar": dict(
        image_size=32,
        patch_size=4,
        num_hidden_layers=12,
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        position_embedding="learned",
    ),
    # Appendix D.4 (ImageNet-1k)
    "tiny": dict(
        image_size=224,
        patch_size=16,
        num_hidden_layers=9,
        hidden_size=192,
        intermediate_size=384,
        num_attention_heads=12,
        position_embedding="learned",
    ),
    "small": dict(
        image_size=224,
        patch_size=16,
        num_hidden_layers=12,
        hidden_size=384,
        intermediate_size=1536,
        num_attention_heads=6,
        position_embedding="sincos",
    ),
    # Fashion-MNIST on a CPU budget (28 x 28, 16 patches; training/recipes/fashion-mnist.yaml)
    "fashion-cpu": dict(
        image_size=28,
        patch_size=7,
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        position_embedding="learned",
        num_labels=10,
    ),
    # CPU demo (scikit-learn digits upsampled to 32 x 32)
    "demo": dict(
        image_size=32,
        patch_size=8,
        num_hidden_layers=2,
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        position_embedding="learned",
        num_labels=10,
    ),
}


class PolarViTConfig(PreTrainedConfig):
    r"""Configuration of a Polar-ViT model.

    Every token is a point of the Lorentz model ``L^n_k`` (curvature ``-1/k``) stored in polar form.

    Args:
        image_size, patch_size, num_channels: input geometry (square images and patches).
        hidden_size: ``n``, the number of space coordinates of a token.
        num_hidden_layers, num_attention_heads, intermediate_size: transformer sizes; every head works
            on ``L^{n/H}_k`` (Sec. 4.2).
        hidden_act: activation of the first MLP Polar-FC (Eq. 8).
        k: curvature parameter, ``k > 0``.
        position_embedding: absolute positions added to the space coordinates: ``"learned"`` table,
            ``"sincos"`` (2-D sine-cosine, fixed), ``"hypformer"`` (Hypformer's learnable encoding: a
            Lorentz FC of each token mixed back in by the Lorentzian midpoint with the fixed weight
            ``hypformer_epsilon``; computed from the token, as in Hypformer) or ``"none"``.
        hypformer_epsilon: the fixed weight ``epsilon >= 0`` of ``position_embedding="hypformer"``.
        head_merge: how attention heads are split and merged: ``"direct_concat"`` (per-head Polar-FC
            projections, Lorentz direct concatenation; the paper) or ``"beta_concat"`` (HNN++: one
            Polar-FC per projection, beta-split into heads, beta-concatenation of the heads).
        relative_position: ``"horoshift"`` (Eq. 10, default), ``"boost"`` (HoPE), ``"rotation"``
            (HOPE, HELM) or ``"none"``; applied to queries and keys of every head on the reserved
            axis pairs ``(0, 1)`` (rows) and ``(2, 3)`` (columns).  ``"so3"`` (SO(3)-RoPE) needs token
            poses: spherical inputs, :class:`PolarViTSphericalConfig`.
        residual: ``"boost"`` (Eq. 12), ``"space"`` (add space coordinates, recompute time; Chen et
            al. 2022) or ``"lorentz_midpoint"`` (LResNet).
        linear: ``"polar"`` (Polar-FC, Eq. 8) or ``"lorentz"`` (the Lorentz FC of Chen et al. 2022:
            Polar-FC with the radius rule frozen at its anchor).
        readout: ``"centroid"`` of the output tokens or a ``"cls"`` token.
        head: ``"lorentz_mlr"`` (Bdeir et al. 2024), ``"poincare_mlr"`` (HNN++ unidirectional MLR) or
            ``"tangent_linear"`` (a Euclidean linear layer on ``log_o``; hybrid).
        arithmetic: ``"polar"`` or ``"ambient"``: the same model, with the same parameters, computed
            in polar form or in ambient Lorentz coordinates (the paper's baseline).
        residual_alpha_init: initial step ``alpha`` of the boost residual (Eq. 12).
        horoshift_rate_init: ``(low, high)``: the per-head rates ``rho_h`` start log-spaced in this range.
        attention_temperature_init: initial learned temperature ``tau`` (Eq. 9).
        layer_norm_eps: ``epsilon`` of the gyro layer norm (Sec. 4.4).
        drop_path_rate: stochastic depth (scales the block output of a dropped sample to zero).
        polar_attn_implementation: ``"auto"``, ``"eager"``, ``"fused"``, ``"chunked"`` or ``"triton"``
            (see ``attention.polar_attention``); ``"auto"`` picks Triton on CUDA, chunked on CPU for long
            sequences, the fused single-block function below that (eager with ``fused_ops=False``), and
            eager when attention probabilities are requested.
        fused_ops: run the layers as fused ``torch.autograd.Function``s that keep no autograd graph of their
            intermediates (default: polar, hand-derived backward passes; ambient, a hand-derived attention and
            recomputed layers) instead of the reference layers differentiated by autograd (``False``); the two
            agree to rounding (float64: ~1e-12 polar; ambient, to its own conditioning ``eps cosh^2 a``).
        initializer_range: std of the truncated-normal init of Euclidean tables (positions, heads).
    """

    model_type = "polar_vit"

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 192
    num_hidden_layers: int = 9
    num_attention_heads: int = 12
    intermediate_size: int = 384
    hidden_act: str = "gelu"
    k: float = 1.0
    position_embedding: str = "learned"
    hypformer_epsilon: float = 1.0
    head_merge: str = "direct_concat"
    relative_position: str = "horoshift"
    residual: str = "boost"
    linear: str = "polar"
    readout: str = "centroid"
    head: str = "lorentz_mlr"
    arithmetic: str = "polar"
    residual_alpha_init: float = 0.1
    horoshift_rate_init: list | tuple = (0.5, 4.0)
    attention_temperature_init: float = 1.0
    layer_norm_eps: float = 1e-6
    drop_path_rate: float = 0.0
    polar_attn_implementation: str = "auto"
    fused_ops: bool = True
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs: Any) -> None:
        self.horoshift_rate_init = list(self.horoshift_rate_init)
        self.validate_polar_vit()
        super().__post_init__(**kwargs)
        if self.id2label and not self.label2id:
            self.label2id = {str(label): int(index) for index, label in self.id2label.items()}

    # ---------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Space dimension ``n / H`` of every attention head."""
        return self.hidden_size // self.num_attention_heads

    is_spherical = False  # planar images; PolarViTSphericalConfig: signals on an icosphere

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def validate_domain(self) -> None:
        """Settings that need a planar patch grid."""
        if self.relative_position == "so3":
            raise ValueError(
                "relative_position='so3' (SO(3)-RoPE) rotates every token by its pose on the sphere: it needs "
                "spherical inputs, use PolarViTSphericalConfig"
            )

    def validate_polar_vit(self) -> None:
        """Raise a ``ValueError`` naming the field for every invalid setting."""

        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "image_size",
            "patch_size",
            "num_channels",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        ):
            positive_int(name)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be divisible by patch_size={self.patch_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        reserved = 2 * len(POSITION_AXES)
        if self.relative_position != "none" and self.head_dim < reserved:
            why = (
                "the Wigner blocks D^0 and D^1 of SO(3)-RoPE"
                if self.relative_position == "so3"
                else "two axis pairs for the 2-D patch grid"
            )
            raise ValueError(
                f"hidden_size / num_attention_heads = {self.head_dim} is too small for "
                f"relative_position={self.relative_position!r}: every head reserves {reserved} space axes "
                f"({why}); use a larger hidden_size, fewer heads or relative_position='none'"
            )
        if not (isinstance(self.k, (int, float)) and math.isfinite(self.k) and self.k > 0):
            raise ValueError(f"k must be a finite positive number (curvature -1/k), got {self.k!r}")
        for name, allowed in (
            ("position_embedding", POSITION_EMBEDDINGS),
            ("head_merge", HEAD_MERGES),
            ("relative_position", RELATIVE_POSITIONS),
            ("residual", RESIDUALS),
            ("linear", LINEARS),
            ("readout", READOUTS),
            ("head", HEADS),
            ("arithmetic", ARITHMETICS),
            ("polar_attn_implementation", attention_implementations()),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        epsilon = self.hypformer_epsilon
        if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
            raise ValueError(
                f"hypformer_epsilon must be a finite number >= 0, got {epsilon!r}: a negative weight can push "
                f"the Lorentzian midpoint of position_embedding='hypformer' off the upper sheet"
            )
        if not isinstance(self.fused_ops, bool):
            raise ValueError(f"fused_ops must be True or False, got {self.fused_ops!r}")
        if not (0.0 <= float(self.drop_path_rate) < 1.0):
            raise ValueError(f"drop_path_rate must be in [0, 1), got {self.drop_path_rate}")
        if not (float(self.layer_norm_eps) > 0):
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")
        if not (float(self.attention_temperature_init) > 0):
            raise ValueError(f"attention_temperature_init must be positive, got {self.attention_temperature_init}")
        rates = self.horoshift_rate_init
        if len(rates) != 2 or not (0 < float(rates[0]) <= float(rates[1])):
            raise ValueError(f"horoshift_rate_init must be (low, high) with 0 < low <= high, got {rates!r}")
        self.validate_domain()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """``PreTrainedConfig.from_dict``, validated after its ``kwargs`` are applied (the path of
        ``from_pretrained(folder, residual=...)`` for configs and models): a ``ValueError`` naming the field."""
        result = super().from_dict(config_dict, **kwargs)
        (result[0] if isinstance(result, tuple) else result).validate_polar_vit()
        return result

    def update(self, config_dict: dict[str, Any]) -> None:
        """``PreTrainedConfig.update``, validated once every field is set."""
        super().update(config_dict)
        self.validate_polar_vit()

    def update_from_string(self, update_str: str) -> None:
        """``PreTrainedConfig.update_from_string``, validated once every field is set."""
        super().update_from_string(update_str)
        self.validate_polar_vit()

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> PolarViTConfig:
        """A preset of the paper (Appendix D) (``tiny-cifar``, ``base-cifar``, ``tiny``, ``small``) or a CPU one
        (``demo``, ``fashion-cpu``)."""
        return cls(**preset_kwargs(PRESETS, name, overrides))


SPHERICAL_PRESETS: dict[str, dict[str, Any]] = {
    # spherical digits / Fashion-MNIST on a CPU budget (benchmarks/spherical_accuracy.py): 2562 vertices, 60 tokens
    "sphere-cpu": dict(
        icosphere_level=4,
        patch_level=0,
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_channels=1,
        num_labels=10,
    ),
    # SO(3)-RoPE's own tokenisation: level-2 patches (320 faces, 960 tokens) of a level-5 icosphere
    "sphere-small": dict(
        icosphere_level=5,
        patch_level=2,
        num_hidden_layers=12,
        hidden_size=384,
        intermediate_size=1536,
        num_attention_heads=6,
    ),
}


class PolarViTSphericalConfig(PolarViTConfig):
    r"""Configuration of Polar-ViT on spherical signals (SO(3)-RoPE, Libner et al.).

    Inputs are signals ``(batch, num_channels, V)`` on the ``V = 10 * 4^icosphere_level + 2`` vertices of an
    icosphere (:func:`spherical.icosphere`; :class:`PolarViTSphericalImageProcessor` resamples equirectangular
    images onto it).  The faces of ``patch_level`` are the patches, each read in its three orientations:
    ``3 * 20 * 4^patch_level`` tokens with SO(3) poses (the lifting of SO(3)-RoPE Sec. 3).  Every field of
    :class:`PolarViTConfig` applies except the planar ones (``image_size``, ``patch_size``, sine-cosine positions,
    the grid encodings).

    Args:
        icosphere_level: subdivisions ``s`` of the icosahedron carrying the input signal.
        patch_level: ``p <= s``: the patches are the faces of level ``p`` (``(n+1)(n+2)/2`` vertices each,
            ``n = 2^(s-p)``).
        relative_position: ``"so3"`` (SO(3)-RoPE on each head's direction, default) or ``"none"``.
        position_embedding: ``"none"`` (default: keeps the model equivariant), ``"learned"`` (a table over the
            tokens) or ``"hypformer"``.
        longitude_encoding: ``K >= 0`` Legendre polynomials ``P_1 ... P_K`` of ``cos(beta)`` (the vertex's polar
            angle) appended to the input channels (the seed's symmetry breaking for problems that are only
            symmetric under rotations about the z-axis); 0 = off.
        num_output_channels: ``C_out`` fields per vertex predicted by
            :class:`PolarViTSphericalForDensePrediction`; ``None``: as many as the input has (``num_channels``).
    """

    model_type = "polar_vit_spherical"
    is_spherical = True

    icosphere_level: int = 4
    patch_level: int = 1
    longitude_encoding: int = 0
    num_output_channels: int | None = None
    relative_position: str = "so3"
    position_embedding: str = "none"

    @property
    def num_patches(self) -> int:
        """Tokens: three orientations of each of the ``20 * 4^patch_level`` patches."""
        return 3 * 20 * 4**self.patch_level

    @property
    def num_vertices(self) -> int:
        return 10 * 4**self.icosphere_level + 2

    @property
    def output_channels(self) -> int:
        """``C_out``: fields per vertex of the dense prediction."""
        return self.num_channels if self.num_output_channels is None else self.num_output_channels

    def validate_domain(self) -> None:
        for name in ("icosphere_level", "patch_level", "longitude_encoding"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.num_output_channels is not None and (
            not isinstance(self.num_output_channels, int) or self.num_output_channels < 1
        ):
            raise ValueError(f"num_output_channels must be an integer >= 1 or None, got {self.num_output_channels!r}")
        if self.patch_level > self.icosphere_level:
            raise ValueError(f"patch_level={self.patch_level} must be <= icosphere_level={self.icosphere_level}")
        if self.icosphere_level > 8:
            raise ValueError(f"icosphere_level={self.icosphere_level} is too fine (at most 8: 655,362 vertices)")
        if self.relative_position not in ("so3", "none"):
            raise ValueError(
                f"relative_position={self.relative_position!r} moves tokens along a planar patch grid; spherical "
                f"inputs use 'so3' (SO(3)-RoPE) or 'none'"
            )
        if self.position_embedding == "sincos":
            raise ValueError("position_embedding='sincos' needs a planar patch grid; use 'none' or 'learned'")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> PolarViTSphericalConfig:
        """A spherical preset (``sphere-cpu``, ``sphere-small``)."""
        return cls(**preset_kwargs(SPHERICAL_PRESETS, name, overrides))


def preset_kwargs(presets: dict[str, dict[str, Any]], name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The preset ``name`` updated by ``overrides``; a label map (``id2label`` / ``label2id``) replaces the preset's
    ``num_labels`` rather than contradicting it."""
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
    kwargs = copy.deepcopy(presets[name])
    if "id2label" in overrides or "label2id" in overrides:
        kwargs.pop("num_labels", None)
    kwargs.update(overrides)
    return kwargs


AUTO_MAP = {
    "AutoConfig": "configuration_polar_vit.PolarViTConfig",
    "AutoModel": "modeling_polar_vit.PolarViTModel",
    "AutoModelForImageClassification": "modeling_polar_vit.PolarViTForImageClassification",
}


SPHERICAL_AUTO_MAP = {
    "AutoConfig": "configuration_polar_vit.PolarViTSphericalConfig",
    "AutoModel": "modeling_polar_vit.PolarViTSphericalModel",
    "AutoModelForImageClassification": "modeling_polar_vit.PolarViTSphericalForImageClassification",
    "AutoModelForImageToImage": "modeling_polar_vit.PolarViTSphericalForDensePrediction",
}


def complete_auto_map(save_directory: str | os.PathLike, entries: dict[str, str]) -> None:
    """Write every Polar-ViT Auto class into ``config.json``'s ``auto_map`` (keeps other entries)."""
    import json
    import os

    path = os.path.join(save_directory, "config.json")
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["auto_map"] = {**config.get("auto_map", {}), **entries}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")


__all__ = [
    "AUTO_MAP",
    "PRESETS",
    "SPHERICAL_AUTO_MAP",
    "SPHERICAL_PRESETS",
    "PolarViTConfig",
    "PolarViTSphericalConfig",
    "complete_auto_map",
]
