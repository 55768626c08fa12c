"""Euclidean baselines of the same size as a Polar-ViT configuration (transformers' ViT)."""

from __future__ import annotations

from transformers import ViTConfig, ViTForImageClassification

from .modeling.configuration_polar_vit import PolarViTConfig


def euclidean_vit_config(config: PolarViTConfig) -> ViTConfig:
    """A ``ViTConfig`` with the same image/patch size, depth, width, MLP width, heads and labels."""
    return ViTConfig(
        image_size=config.image_size,
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
