"""Euclidean baselines of the same size as a Polar-ViT configuration (transformers' ViT), planar and spherical."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, ViTConfig, ViTForImageClassification
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_outputs import ImageClassifierOutput
from transformers.models.vit.modeling_vit import ViTLayer, ViTPreTrainedModel

from .modeling.configuration_polar_vit import PolarViTConfig, PolarViTSphericalConfig
from .modeling.modeling_polar_vit import SphericalFieldsOutput
from .modeling.spherical import (
    apply_so3_rope,
    field_loss,
    lift_patches,
    patch_features,
    project_patches,
    token_rope,
)


def euclidean_vit_config(config: PolarViTConfig) -> ViTConfig:
    """A ``ViTConfig`` with the same image/patch size, depth, width, MLP width, heads and labels."""
    return ViTConfig(
        image_size=config.image_size,  # (unused by the spherical baseline)
        patch_size=config.patch_size,
        num_channels=config.num_channels,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        id2label=dict(config.id2label),
        label2id=dict(config.label2id or {v: k for k, v in config.id2label.items()}),
    )


def euclidean_vit(config: PolarViTConfig) -> ViTForImageClassification:
    """transformers' ``ViTForImageClassification`` of the same size (the Tables 1-3 comparison rows)."""
    return ViTForImageClassification(euclidean_vit_config(config))


def so3_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    so3_rope: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """SO(3)-RoPE (Eq. 2) then transformers' SDPA attention: queries and keys ``(B, H, N, d)`` multiplied by
    ``so3_rope (N, m, m)`` on their first ``m`` axes, so ``q^T pi(U)^T pi(V) k = q^T pi(U^{-1} V) k`` (Eq. 3)."""
    if so3_rope is not None:
        query, key = (apply_so3_rope(t.transpose(1, 2), so3_rope).transpose(1, 2) for t in (query, key))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("so3_sdpa", so3_sdpa_attention)


class SphericalViTForImageClassification(ViTPreTrainedModel):
    """The Euclidean baseline on icosphere signals: the same lifting as Polar-ViT's spherical embedding (a linear
    kernel), transformers' ``ViTLayer`` blocks with SO(3)-RoPE inside attention (``attn_implementation="so3_sdpa"``),
    a final layer norm, mean pooling over tokens and a linear classifier.

    Config: a ``ViTConfig`` with the spherical fields of ``PolarViTSphericalConfig`` (``icosphere_level``,
    ``patch_level``, ``relative_position`` ``"so3"``/``"none"``, ``position_embedding`` ``"none"``/``"learned"``,
    ``longitude_encoding``); build one with :func:`euclidean_spherical_vit`.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config)
        features = patch_features(
            config.num_channels, config.icosphere_level, config.patch_level, config.longitude_encoding
        )
        self.patch_embeddings = nn.Linear(features, config.hidden_size)
        tokens = 60 * 4**config.patch_level
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, tokens, config.hidden_size))
            if config.position_embedding == "learned"
            else None
        )
        self.layers = nn.ModuleList([ViTLayer(config) for _ in range(config.num_hidden_layers)])
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.classifier = nn.Linear(config.hidden_size, cast(int, config.num_labels))
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``from_pretrained`` with the SO(3)-RoPE attention (a saved config does not keep the
        attention implementation: without it, the blocks would run plain SDPA and ignore the poses)."""
        kwargs.setdefault("attn_implementation", "so3_sdpa")
        return super().from_pretrained(*args, **kwargs)

    def rope(self, dtype: torch.dtype) -> Tensor | None:
        """``pi(R_t) (N, m, m)`` of every token, or ``None`` without SO(3)-RoPE."""
        if self.config.relative_position != "so3":
            return None
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        rope = token_rope(self.config.icosphere_level, self.config.patch_level, head_dim)
        return rope.to(device=self.patch_embeddings.weight.device, dtype=dtype)

    def encode(self, pixel_values: Tensor) -> Tensor:
        """The lifted tokens after the blocks and the final layer norm ``(B, N, D)``."""
        config = self.config
        weight = self.patch_embeddings.weight
        patches = lift_patches(
            pixel_values.to(weight.dtype), config.icosphere_level, config.patch_level, config.longitude_encoding
        )
        hidden = self.patch_embeddings(patches)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings
        rope = self.rope(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, None, so3_rope=rope)
        return self.layernorm(hidden)

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None, **kwargs: Any) -> ImageClassifierOutput:
        logits = self.classifier(self.encode(pixel_values).mean(1))
        loss = None if labels is None else self.loss_function(labels, logits, self.config)
        return ImageClassifierOutput(loss=loss, logits=logits)


class SphericalViTForDensePrediction(SphericalViTForImageClassification):
    """The Euclidean twin of ``PolarViTSphericalForDensePrediction`` (SO3ViT, SO(3)-RoPE Fig. 1): the encoder of
    :class:`SphericalViTForImageClassification`, then the projection convolution (Def. 5): a linear kernel gives
    each token ``C_out S`` values that :func:`spherical.project_patches` averages onto the vertices.  Config: as the
    classifier's, with ``num_output_channels``; build one with :func:`euclidean_spherical_dense_vit`."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config)
        del self.classifier
        slots = patch_features(1, config.icosphere_level, config.patch_level)
        self.projection = nn.Linear(config.hidden_size, config.num_output_channels * slots)
        self.post_init()

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None, **kwargs: Any) -> SphericalFieldsOutput:
        level, patch_level = self.config.icosphere_level, self.config.patch_level
        fields = project_patches(self.projection(self.encode(pixel_values)), level, patch_level)
        loss = None if labels is None else field_loss(fields, labels, level)
        return SphericalFieldsOutput(loss=loss, logits=fields)


def spherical_vit_config(config: PolarViTSphericalConfig) -> ViTConfig:
    """The ``ViTConfig`` of the Euclidean spherical baselines: :func:`euclidean_vit_config` with the icosphere, the
    relative / absolute position settings, the longitude encoding and the output channels of ``config``."""
    vit = euclidean_vit_config(config)
    for name in ("icosphere_level", "patch_level", "relative_position", "position_embedding", "longitude_encoding"):
        setattr(vit, name, getattr(config, name))
    vit.num_output_channels = config.output_channels
    vit._attn_implementation = "so3_sdpa"
    return vit


def euclidean_spherical_vit(config: PolarViTSphericalConfig) -> SphericalViTForImageClassification:
    """The Euclidean spherical ViT with the same icosphere, lifting, depth, width, MLP width, heads, labels and
    relative / absolute position settings as a ``PolarViTSphericalConfig``."""
    return SphericalViTForImageClassification(spherical_vit_config(config))


def euclidean_spherical_dense_vit(config: PolarViTSphericalConfig) -> SphericalViTForDensePrediction:
    """The Euclidean twin of ``PolarViTSphericalForDensePrediction`` for a ``PolarViTSphericalConfig``."""
    return SphericalViTForDensePrediction(spherical_vit_config(config))
