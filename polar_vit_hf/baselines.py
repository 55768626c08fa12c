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
from .modeling.spherical import apply_so3_rope, lift_patches, patch_features, token_rope


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

    def rope(self, dtype: torch.dtype) -> Tensor | None:
        """``pi(R_t) (N, m, m)`` of every token, or ``None`` without SO(3)-RoPE."""
        if self.config.relative_position != "so3":
            return None
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        rope = token_rope(self.config.icosphere_level, self.config.patch_level, head_dim)
        return rope.to(device=self.classifier.weight.device, dtype=dtype)

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None, **kwargs: Any) -> ImageClassifierOutput:
        config = self.config
        patches = lift_patches(
            pixel_values.to(self.classifier.weight.dtype),
            config.icosphere_level,
            config.patch_level,
            config.longitude_encoding,
        )
        hidden = self.patch_embeddings(patches)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings
        rope = self.rope(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, None, so3_rope=rope)
        logits = self.classifier(self.layernorm(hidden).mean(1))
        loss = None if labels is None else self.loss_function(labels, logits, config)
        return ImageClassifierOutput(loss=loss, logits=logits)


def euclidean_spherical_vit(config: PolarViTSphericalConfig) -> SphericalViTForImageClassification:
    """The Euclidean spherical ViT with the same icosphere, lifting, depth, width, MLP width, heads, labels and
    relative / absolute position settings as a ``PolarViTSphericalConfig``."""
    vit = euclidean_vit_config(config)
    for name in ("icosphere_level", "patch_level", "relative_position", "position_embedding", "longitude_encoding"):
        setattr(vit, name, getattr(config, name))
    vit._attn_implementation = "so3_sdpa"
    return SphericalViTForImageClassification(vit)
