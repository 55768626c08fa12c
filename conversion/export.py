"""Export a Polar-ViT training result to a Hub-ready folder.

Run:  python conversion/export.py SOURCE OUT_DIR [--repo_id ORG/NAME] [--config config.json]
                                  [--max_shard_size 2GB] [--allow-pickle] [--onnx]

SOURCE may be
* a ``save_pretrained`` folder or a ``Trainer`` output dir (``config.json`` + safetensors weights);
* an output dir of ``training/pretrain.py`` (its ``model/`` folder, or ``--which best`` for
  ``best_model/``; without them the newest ``checkpoints/step_N``, rebuilt from ``recipe.json``);
* a single weights file with ``--config CONFIG`` (a ``config.json`` or a preset name):
  ``.safetensors``, or a pickle (``.bin``/``.pt``/``.pth``) only with ``--allow-pickle``.

OUT_DIR receives safetensors weights (sharded above ``--max_shard_size``), ``config.json`` with
``architectures`` and an ``auto_map`` for ``AutoConfig``, ``AutoModel`` and
``AutoModelForImageClassification``, ``preprocessor_config.json`` with its ``AutoImageProcessor``
``auto_map``, the ``modeling/`` source files, and a ``README.md`` model card rendered from
the package's model-card template (metrics from the run's ``metrics.csv`` when present); with ``--onnx`` also
``model.onnx``, the classifier's logits with a dynamic batch axis (``polar_vit_hf.deploy.export_onnx``), which
``verify.py`` checks against PyTorch with ONNX Runtime.
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from polar_vit_hf.cli import UserError, add_debug_flag, command

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class ExportError(UserError):
    """The source cannot be exported (unknown layout, refused pickle, mismatched weights)."""


def _config(spec: str | None):
    import polar_vit_hf as P

    if spec is None:
        raise ExportError("a single weights file needs --config (a config.json path or a preset name)")
    if Path(spec).exists():
        return P.PolarViTConfig.from_json_file(spec)
    return P.PolarViTConfig.from_preset(spec)


def _load_weights(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError) as error:
            raise ExportError(f"{path}: not a readable safetensors file (truncated or corrupt?): {error}") from None
    if path.suffix in PICKLE_SUFFIXES:
        if not allow_pickle:
            raise ExportError(
                f"{path.name} is a pickle file: loading pickles can execute arbitrary code, so export refuses "
                f"them; re-save the weights with safetensors, or pass --allow-pickle if you trust the file"
            )
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # UnpicklingError, EOFError, RuntimeError from a damaged zip archive
            raise ExportError(f"{path}: not a readable PyTorch weights file: {error}") from None
        return state.get("state_dict", state) if isinstance(state, dict) else state
    raise ExportError(f"{path}: unknown weights format (expected .safetensors, or a pickle with --allow-pickle)")


def _from_folder(folder: Path):
    """``from_pretrained`` of a saved folder, with damaged weights or config reported as ExportError."""
    from safetensors import SafetensorError

    import polar_vit_hf as P

    try:
        return P.PolarViTForImageClassification.from_pretrained(folder)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ExportError(
            f"{folder}: could not load the saved model ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from None


def _from_state_dict(config, state: dict[str, torch.Tensor], origin: Path):
    import polar_vit_hf as P

    model = P.PolarViTForImageClassification(config)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # shape mismatches
        raise ExportError(f"{origin}: weights do not match the config: {str(error).splitlines()[1].strip()}") from None
    if missing or unexpected:
        raise ExportError(
            f"{origin}: weights do not match the config (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    return model


def check_finite(model, origin: Path) -> None:
    """Refuse weights with NaN/Inf entries (a diverged run) rather than publish them."""
    bad = [
        name
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        raise ExportError(f"{origin}: {len(bad)} weight tensors hold NaN/Inf (diverged training?): {bad[:5]}")


@dataclass(frozen=True)
class Source:
    """What is exported: the model, the run folder that made it (run records) and the folder its weights came
    from (whose ``eval_results.json`` scores exactly those weights)."""

    model: object
    run_dir: Path | None
    weights_dir: Path | None


def load_source(source: Path, config_spec: str | None, allow_pickle: bool, which: str = "last") -> Source:
    """The model of ``source`` and where it came from (see the module docstring for the layouts)."""
    import polar_vit_hf as P

    if source.is_file():
        return Source(_from_state_dict(_config(config_spec), _load_weights(source, allow_pickle), source), None, None)
    if not source.is_dir():
        raise ExportError(f"{source}: no such file or directory")
    exported = source / ("best_model" if which == "best" else "model")
    if (source / "config.json").exists():
        if any(source.glob("*.safetensors")):  # save_pretrained / Trainer output: may hold run records
            return Source(_from_folder(source), source, source)
        pickles = [p for p in source.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            config = P.PolarViTConfig.from_json_file(source / "config.json")
            return Source(_from_state_dict(config, _load_weights(pickles[0], allow_pickle), pickles[0]), None, None)
    if exported.is_dir():
        return Source(_from_folder(exported), source, exported)
    checkpoints = sorted((source / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[-1]))
    checkpoints = [p for p in checkpoints if p.name.split("_")[-1].isdigit()]
    if checkpoints and (source / "recipe.json").exists():
        from polar_vit_hf.training.pretrain import build_model

        recipe = json.loads((source / "recipe.json").read_text())
        weights = checkpoints[-1] / "model.safetensors"
        if not weights.exists():
            raise ExportError(f"{checkpoints[-1]} has no model.safetensors (incomplete checkpoint?)")
        from safetensors.torch import load_file

        labels = (
            {int(k): v for k, v in json.loads((source / "labels.json").read_text()).items()}
            if (source / "labels.json").exists()
            else {i: str(i) for i in range(10)}
        )
        _, config = build_model(recipe, "polar", labels)
        return Source(_from_state_dict(config, load_file(weights), weights), source, None)
    raise ExportError(f"{source}: not a save_pretrained/Trainer folder, a pretraining output dir or a weights file")


def run_results(source: Source, dataset: str | None, split: str):
    """The evaluation row of the exported weights: the ``eval_results.json`` saved beside them (a fine-tuning
    run's ``Trainer.save_metrics``; a pretraining run's ``model/`` or ``best_model/``, so ``--which best`` reports
    the best weights' score), else the last evaluation in a pretraining run's ``metrics.csv``."""
    from polar_vit_hf.model_card import Result

    scores = source.weights_dir / "eval_results.json" if source.weights_dir is not None else None
    if scores is not None and scores.exists():
        metrics = json.loads(scores.read_text())
        if "eval_accuracy" not in metrics:
            return []
        top5 = metrics.get("eval_top_5_accuracy")
        return [
            Result(
                dataset or "held-out", split, float(metrics["eval_accuracy"]), None if top5 is None else float(top5)
            )
        ]
    if source.run_dir is None or not (source.run_dir / "metrics.csv").exists():
        return []
    with open(source.run_dir / "metrics.csv") as handle:
        evaluated = [row for row in csv.DictReader(handle) if row.get("eval_accuracy")]
    if not evaluated:
        return []
    top5 = evaluated[-1].get("eval_top5_accuracy")
    return [Result(dataset or "held-out", split, float(evaluated[-1]["eval_accuracy"]), float(top5) if top5 else None)]


def run_dataset(run_dir: Path | None) -> tuple[str | None, str | None]:
    """``(dataset, evaluated split)`` recorded by the pretraining (``recipe.json``) or fine-tuning
    (``run_info.json``) run."""
    if run_dir is not None and (run_dir / "recipe.json").exists():
        data = json.loads((run_dir / "recipe.json").read_text())["data"]
        return data["dataset"], data.get("eval_split", "test")
    if run_dir is not None and (run_dir / "run_info.json").exists():
        info = json.loads((run_dir / "run_info.json").read_text())
        return info["dataset"], info["eval_split"]
    return None, None


def base_model(run_dir: Path | None) -> tuple[str | None, str | None]:
    """``(Hub id, revision)`` a fine-tuning run started from (``run_info.json``), or ``(None, None)``."""
    if run_dir is None or not (run_dir / "run_info.json").exists():
        return None, None
    info = json.loads((run_dir / "run_info.json").read_text())
    return info.get("base_model"), info.get("base_model_revision")


def training_summary(run_dir: Path | None) -> str:
    if run_dir is not None and (run_dir / "run_info.json").exists():
        info = json.loads((run_dir / "run_info.json").read_text())
        optimizer = "AdamW" if info.get("arch") == "euclidean" else "Riemannian AdamW"
        return (
            f"Fine-tuned from `{info['init_from']}` with `training/finetune.py` (transformers `Trainer`, "
            f"H-CAST recipe) on `{info['dataset']}` ({info.get('train_split', 'train')} split) at "
            f"{info['image_size']} px: {optimizer}, lr {info['lr']:.3g}, weight decay {info['weight_decay']}, "
            f"effective batch {info['effective_batch']} ({info.get('processes', 1)} processes), "
            f"{info['steps']} steps ({info['warmup_steps']} warm-up, cosine), label smoothing "
            f"{info['label_smoothing']}, Mixup {info['mixup']} / CutMix {info['cutmix']}, RandAugment "
            f"`{info['rand_augment']}`, random erasing {info['random_erasing']}, stochastic depth "
            f"{info['drop_path']}."
        )
    if run_dir is None or not (run_dir / "recipe.json").exists():
        return "Training details were not recorded with this export."
    recipe = json.loads((run_dir / "recipe.json").read_text())
    optim, data = recipe["optim"], recipe["data"]
    decay = "decoupled (big_vision)" if optim.get("decoupled_wd") else "coupled (PyTorch AdamW)"
    clipping = f", gradient clipping at {optim['max_grad_norm']}" if optim.get("max_grad_norm") else ""
    return (
        f"Trained with `training/pretrain.py` on `{data['dataset']}` at {data['image_size']} px: "
        f"Riemannian AdamW, "
        f"lr {optim['lr']}, weight decay {optim['weight_decay']} {decay}{clipping}, global batch "
        f"{optim['batch_size']} "
        f"x {optim.get('grad_accum', 1)} accumulation, cosine schedule with warm-up, "
        f"{optim.get('max_steps') or str(optim.get('epochs')) + ' epochs'} steps; augmentation "
        f"`{json.dumps(recipe['augment'], sort_keys=True)}`."
    )


def export(
    source: Path,
    out_dir: Path,
    repo_id: str | None = None,
    config_spec: str | None = None,
    allow_pickle: bool = False,
    max_shard_size: str = "2GB",
    which: str = "last",
    dataset: str | None = None,
    split: str | None = None,
    onnx: bool = False,
) -> Path:
    import polar_vit_hf as P
    from polar_vit_hf.model_card import render_model_card

    loaded = load_source(source, config_spec, allow_pickle, which)
    model, run_dir = loaded.model, loaded.run_dir
    check_finite(model, source)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    size = model.config.image_size
    P.PolarViTImageProcessor(size={"height": size, "width": size}).save_pretrained(out_dir)
    recorded_dataset, recorded_split = run_dataset(run_dir)
    dataset, split = dataset or recorded_dataset, split or recorded_split or "test"
    repo_id = repo_id or f"polar-vit/{out_dir.name}"
    base, revision = base_model(run_dir)
    card = render_model_card(
        model,
        repo_id,
        run_results(loaded, dataset, split),
        training_summary(run_dir),
        base_model=base,
        base_model_revision=revision,
    )
    card.save(out_dir / "README.md")
    if onnx:
        write_onnx(model, out_dir)
    return out_dir


def write_onnx(model, out_dir: Path) -> Path:
    """``out_dir/model.onnx`` (:func:`polar_vit_hf.deploy.export_onnx`); a missing exporter is a user error."""
    from polar_vit_hf.deploy import ONNX_FILE, export_onnx

    try:
        import onnxscript  # noqa: F401 - torch's ONNX exporter translates with it
    except ImportError as error:
        raise ExportError(f'--onnx needs the ONNX exporter: pip install "polar-vit-hf[onnx]" ({error})') from None
    print(f"writing {ONNX_FILE} (torch.export, then ONNX; a minute or more for a 12-layer model)", flush=True)
    return export_onnx(model.float(), out_dir / ONNX_FILE)


@command("polar-vit-export")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug_flag(parser)
    parser.add_argument("source", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--repo_id")
    parser.add_argument("--config", help="config.json or preset name, for a single weights file")
    parser.add_argument("--allow-pickle", action="store_true", dest="allow_pickle")
    parser.add_argument("--max_shard_size", default="2GB")
    parser.add_argument("--which", choices=("last", "best"), default="last")
    parser.add_argument("--dataset", help="dataset name for the card (default: the run's recipe)")
    parser.add_argument(
        "--split", help="split the recorded accuracy was measured on (default: the run's evaluated split)"
    )
    parser.add_argument("--onnx", action="store_true", help="also write model.onnx (dynamic batch axis)")
    args = parser.parse_args(argv)
    out = export(
        args.source,
        args.out_dir,
        args.repo_id,
        args.config,
        args.allow_pickle,
        args.max_shard_size,
        args.which,
        args.dataset,
        args.split,
        args.onnx,
    )
    print(f"exported to {out}: {sorted(p.name for p in out.iterdir())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
