"""Model cards for exported Polar-ViT folders, rendered from ``model_card_template.md`` (package data).

The YAML metadata is a ``huggingface_hub.ModelCardData`` (``library_name: transformers``,
``pipeline_tag: image-classification``, license, tags, datasets and a ``model-index`` built from
``EvalResult`` entries); the body is filled from the model config and the training run.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import as_file, files
from typing import TYPE_CHECKING

from huggingface_hub import EvalResult, ModelCard, ModelCardData

if TYPE_CHECKING:
    from .modeling import PolarViTConfig, PolarViTForImageClassification

TEMPLATE = files("polar_vit_hf") / "model_card_template.md"  # shipped inside the wheel

# The paper's reference numbers per preset (Tables 1-3), quoted in every card.
PAPER_REFERENCE = {
    "tiny-cifar": "Polar-ViT-Tiny 80.15 ± 0.26 % on CIFAR-100 and 67.23 ± 0.32 % on Tiny-ImageNet (Table 1).",
    "base-cifar": "see Table 1 of the paper (ViT-Base sizes on CIFAR-100).",
    "tiny": "Polar-ViT-Tiny 71.68 % top-1 on ImageNet-1k (Table 2).",
    "small": "Polar-ViT-Small 77.79 % top-1 on ImageNet-1k; fine-tuned 81.61 % on CUB-200-2011 and "
    "80.03 % on FGVC-Aircraft (Tables 2, 3).",
}


@dataclass
class Result:
    """One evaluation row of the card."""

    dataset: str
    split: str
    top1: float
    top5: float | None = None


def detect_preset(config: PolarViTConfig) -> str:
    """The preset whose sizes match ``config`` (or ``custom``)."""
    from .modeling.configuration_polar_vit import PRESETS

    keys = ("image_size", "patch_size", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    for name, values in PRESETS.items():
        if all(getattr(config, key) == values[key] for key in keys):
            return name
    return "custom"


def render_model_card(
    model: PolarViTForImageClassification,
    repo_id: str,
    results: list[Result],
    training_summary: str,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    base_model: str | None = None,
    base_model_revision: str | None = None,
) -> ModelCard:
    """The card of ``model`` (a ``PolarViTForImageClassification``) for the Hub repository ``repo_id``;
    ``base_model`` (a Hub id, with its ``revision``) names the checkpoint a fine-tuned model started from."""
    config = model.config
    preset = detect_preset(config)
    num_parameters = sum(p.numel() for p in model.parameters())
    head = getattr(model, "classifier", None)
    without_head = num_parameters - (sum(p.numel() for p in head.parameters()) if head is not None else 0)
    eval_results = []
    for r in results:
        for metric, value in (("accuracy", r.top1), ("top_5_accuracy", r.top5)):
            if value is not None:
                eval_results.append(
                    EvalResult(
                        task_type="image-classification",
                        dataset_type=r.dataset,
                        dataset_name=r.dataset,
                        dataset_split=r.split,
                        metric_type=metric,
                        metric_value=round(float(value), 6),
                    )
                )
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="image-classification",
        license=license,
        tags=["hyperbolic", "vision-transformer", "polar-vit", "lorentz-model", "image-classification"],
        datasets=datasets or sorted({r.dataset for r in results}) or None,
        metrics=["accuracy"],
        model_name=repo_id.split("/")[-1],
        eval_results=eval_results or None,
        base_model=base_model,
        base_model_relation="finetune" if base_model else None,
    )
    with as_file(TEMPLATE) as template_path:
        return ModelCard.from_template(
            card_data,
            template_path=str(template_path),
            model_name=repo_id.split("/")[-1],
            repo_id=repo_id,
            preset=preset,
            config=config,
            num_parameters=num_parameters,
            num_parameters_without_head=without_head,
            results=results,
            training_summary=training_summary,
            base_model=base_model,
            base_model_revision=base_model_revision,
            paper_reference=PAPER_REFERENCE.get(preset, "see Tables 1-3 of the paper for the nearest size."),
        )
