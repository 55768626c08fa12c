"""Fine-tune a pretrained Polar-ViT (or the same-size Euclidean ViT) with the transformers ``Trainer``
(H-CAST recipe, paper D.4), on one process or many.

Examples:
    python training/finetune.py --recipe cub --model runs/imagenet/model --data_dir ~/data --output_dir runs/cub
    torchrun --nproc_per_node 8 training/finetune.py --recipe aircraft --model org/polar-vit-small \\
        --data_dir ~/data --output_dir runs/aircraft --bf16
    python training/finetune.py --recipe cub --arch euclidean --model runs/imagenet-vit/model ...

Recipes (``--recipe cub`` / ``aircraft``, YAML files in ``training/recipes/`` or a path) set the defaults of
the flags below; flags given on the command line override them.  Without a recipe the defaults are the same
H-CAST recipe: 100 epochs, 5 warm-up, cosine, lr 5e-4 * B / 512 with an effective batch B = 256, weight decay
0.05, label smoothing 0.1, Mixup 0.8, CutMix 1.0 (in the collator), RandAugment (m9, mstd 0.5), random
erasing 0.25, stochastic depth 0.1, no gradient clipping, at the pretrained model's resolution.

Datasets (:mod:`polar_vit_hf.training.official_data`): ``--dataset cub`` / ``aircraft`` / ``imagenet-1k`` with
``--data_dir ROOT`` holding the official layout, webdataset shards, a Hub name or alias, a local
``imagefolder`` or the shipped ``digits``.  FGVC-Aircraft trains on ``trainval`` and evaluates on ``test`` by
default, with the 20-pixel banner removed; the label column is chosen by name (``--label_column``).

Distributed: the number of processes comes from the launcher (``torchrun``, ``accelerate launch``); the
effective batch is ``per_device_batch_size x processes x grad_accum`` (``--effective_batch`` derives the
accumulation), every test image is scored exactly once, the logged loss is the mean over the accumulated
batch, only the main process writes ``--output_dir``.  Checkpoints every epoch (``--save_strategy``),
``--resume_from_checkpoint [DIR]`` continues a preempted run exactly; the same ``--seed`` gives the same weights.

Polar-ViT trains with Riemannian AdamW, the Euclidean ViT with AdamW (decay on weight matrices only).  Accuracy
(top-1 and top-5) comes from an ``evaluate`` metric kept in ``training/metrics/accuracy`` (works offline).  The
output dir is a ``save_pretrained`` folder plus ``eval_results.json`` and ``run_info.json``, which
``conversion/export.py`` turns into the model card; ``--push_to_hub`` runs export -> verify -> push on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from transformers import Trainer, TrainerCallback, TrainingArguments

from polar_vit_hf.cli import UserError, add_debug_flag, command
from polar_vit_hf.training.compilation import add_compile_flag, compile_wanted

METRICS = Path(__file__).resolve().parent / "metrics"
RECIPES = Path(__file__).resolve().parent / "recipes"
DEFAULT_TRAIN_SPLIT = {"aircraft": "trainval"}  # the paper's protocol for FGVC-Aircraft
RUN_ONLY_FLAGS = {
    "model",
    "output_dir",
    "recipe",
    "resume_from_checkpoint",
    "push_to_hub",
    "hub_model_id",
    "hub_private",
    "debug",
}  # flags a recipe may not set


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--recipe",
        help="name in training/recipes/ (cub, aircraft) or a YAML path: its entries "
        "become the defaults of the flags below",
    )
    parser.add_argument("--model", required=True, help="a save_pretrained folder or a Hub id")
    parser.add_argument(
        "--arch",
        choices=("polar", "euclidean"),
        default="polar",
        help="euclidean: a transformers ViTForImageClassification checkpoint, trained with AdamW",
    )
    parser.add_argument("--output_dir", required=True)
    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset",
        default=None,
        help="cub, aircraft, imagenet-1k (official layout with --data_dir), "
        "webdataset, a Hub name, 'imagefolder' or 'digits'",
    )
    data.add_argument("--data_dir")
    data.add_argument("--train_split", help="default: trainval for aircraft, else train")
    data.add_argument("--eval_split", default="test")
    from polar_vit_hf.training.official_data import add_dataset_arguments

    add_dataset_arguments(data)
    data.add_argument("--image_size", type=int, help="default: the pretrained model's resolution")
    data.add_argument(
        "--max_bad_fraction",
        type=float,
        default=0.01,
        help="stop when more than this fraction of the images read cannot be decoded",
    )
    data.add_argument("--dataloader_num_workers", type=int, default=min(8, os.cpu_count() or 1))
    optim = parser.add_argument_group("optimisation (H-CAST recipe, D.4)")
    optim.add_argument("--epochs", type=float, default=100)
    optim.add_argument("--max_steps", type=int, default=-1)
    optim.add_argument("--warmup_epochs", type=float, default=5)
    optim.add_argument("--per_device_batch_size", type=int, default=32)
    optim.add_argument("--grad_accum", type=int, default=8, help="effective batch = per-device x processes x accum")
    optim.add_argument("--effective_batch", type=int, help="derive --grad_accum from this effective batch")
    optim.add_argument("--base_lr", type=float, default=5e-4, help="lr = base_lr * effective_batch / 512")
    optim.add_argument("--weight_decay", type=float, default=0.05)
    optim.add_argument("--max_grad_norm", type=float, default=0.0, help="gradient clipping (0: none, as H-CAST)")
    optim.add_argument("--label_smoothing", type=float, default=0.1)
    optim.add_argument("--mixup", type=float, default=0.8)
    optim.add_argument("--cutmix", type=float, default=1.0)
    optim.add_argument("--rand_augment", default="rand-m9-mstd0.5-inc1", help="timm auto-augment string or 'none'")
    optim.add_argument("--random_erasing", type=float, default=0.25)
    optim.add_argument(
        "--color_jitter",
        type=float,
        default=0.4,
        help="timm's colour jitter, applied only without RandAugment (DeiT's default 0.4)",
    )
    optim.add_argument(
        "--crop_scale",
        type=float,
        default=0.08,
        help="smallest area fraction of the random resized crop (timm's scale=(MIN, 1)); 1: no random "
        "crop (the whole image, resized)",
    )
    optim.add_argument("--hflip", type=float, default=0.5, help="probability of a horizontal flip (0: none)")
    optim.add_argument("--drop_path", type=float, default=0.1)
    optim.add_argument("--seed", type=int, default=0)
    run = parser.add_argument_group("run")
    run.add_argument("--bf16", action="store_true", help="bf16 mixed precision (the model's precision policy)")
    run.add_argument("--tf32", action="store_true", help="TF32 matrix products on Ampere or newer GPUs")
    run.add_argument(
        "--report_to",
        default="tensorboard",
        help="tensorboard (default), wandb, trackio, all or none (as TrainingArguments)",
    )
    run.add_argument("--logging_steps", type=int, default=10)
    run.add_argument("--save_strategy", choices=("epoch", "steps", "no"), default="epoch")
    run.add_argument("--save_steps", type=int, default=500)
    run.add_argument("--save_total_limit", type=int, default=2)
    run.add_argument("--stop_after_steps", type=int, help="stop right after the checkpoint at this step (preemption)")
    run.add_argument(
        "--resume_from_checkpoint",
        nargs="?",
        const="latest",
        help="continue from the newest (or the given) checkpoint of --output_dir",
    )
    run.add_argument(
        "--push_to_hub",
        action="store_true",
        help="export, verify and push the result (conversion/push.py publish) after training",
    )
    run.add_argument("--hub_model_id", help="repo id to push to (default: <your user>/<output_dir name>)")
    run.add_argument("--hub_private", action="store_true")
    run.add_argument("--trust_remote_code", action="store_true")
    add_compile_flag(parser)
    add_debug_flag(parser)
    return parser


def load_recipe(name: str, parser: argparse.ArgumentParser) -> dict:
    """The entries of a fine-tuning recipe, checked against the flags they set."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES.glob("*.yaml") if "dataset" in (yaml.safe_load(p.read_text()) or {}))
        raise UserError(f"--recipe {name}: not found (fine-tuning recipes: {known}, or a path to a .yaml file)")
    try:
        recipe = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise UserError(f"--recipe {path}: not valid YAML ({error})") from None
    settable = {action.dest for action in parser._actions} - RUN_ONLY_FLAGS - {"help"}
    unknown = sorted(set(recipe) - settable - {"effective_batch"} | (set(recipe) & RUN_ONLY_FLAGS))
    if not isinstance(recipe, dict) or unknown:
        raise UserError(
            f"--recipe {path}: unknown entries {unknown} (a fine-tuning recipe sets flags of "
            f"finetune.py, e.g. dataset, epochs, base_lr)"
        )
    return recipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.recipe:
        parser.set_defaults(**load_recipe(known.recipe, parser))
    args = parser.parse_args(argv)
    if args.dataset is None:
        parser.error("--dataset is required (or a --recipe that names one)")
    if args.train_split is None:
        from polar_vit_hf.training.official_data import canonical_name

        args.train_split = DEFAULT_TRAIN_SPLIT.get(canonical_name(args.dataset), "train")
    return args


def looks_like_a_path(name: str) -> bool:
    """A local path rather than a Hub id (``namespace/name``): absolute, relative (``./``, ``~``) or deeper."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def load_config(name: str, arch: str, trust_remote_code: bool):
    """The config of ``--model``: a local folder, or a Hub repo id; the user's mistakes as :class:`UserError`."""
    from transformers import ViTConfig

    import polar_vit_hf as P

    folder = Path(name).expanduser()
    if folder.exists() or looks_like_a_path(name):
        if not folder.is_dir():
            raise UserError(f"--model {name}: no such folder (a save_pretrained folder or a Hub id namespace/name)")
        if not (folder / "config.json").exists():
            raise UserError(f"--model {name}: the folder has no config.json (not a save_pretrained folder)")
    cls = ViTConfig if arch == "euclidean" else P.PolarViTConfig
    try:
        return cls.from_pretrained(str(folder) if folder.exists() else name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise UserError(
            f"--model {name}: could not load it as a {cls.__name__} ({str(error).splitlines()[0]}); give "
            f"a local save_pretrained folder, or a Hub id that is cached or reachable"
        ) from None


def build_transforms(image_size: int, args: argparse.Namespace, train: bool):
    """timm's DeiT/H-CAST pipeline (RandAugment, random erasing) for training, resize for evaluation."""
    from timm.data import create_transform

    auto = None if args.rand_augment == "none" else args.rand_augment
    whole = args.crop_scale >= 1.0  # no random crop: area and aspect ratio fixed
    return create_transform(
        input_size=image_size,
        is_training=train,
        auto_augment=auto if train else None,
        re_prob=args.random_erasing if train else 0.0,
        interpolation="bicubic",
        scale=(min(args.crop_scale, 1.0), 1.0),
        ratio=(1.0, 1.0) if whole else (3 / 4, 4 / 3),
        hflip=args.hflip,
        color_jitter=args.color_jitter,
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        crop_pct=1.0,
    )


class MixupCollator:
    """Stacks ``(pixels, label)`` pairs and applies timm's Mixup/CutMix with label smoothing (training batches;
    ``mixup=None`` for evaluation).  ``interpolate`` asks the model to resize its position table."""

    def __init__(self, mixup, interpolate: bool = False):
        self.mixup, self.interpolate = mixup, interpolate

    def __call__(self, batch):
        pixels = torch.stack([item[0] for item in batch])
        labels = torch.tensor([item[1] for item in batch])
        if self.mixup is not None and len(batch) % 2 == 0:
            pixels, labels = self.mixup(pixels, labels)  # soft targets (B, C)
        inputs = {"pixel_values": pixels, "labels": labels}
        if self.interpolate:
            inputs["interpolate_pos_encoding"] = True
        return inputs


class SoftTargetTrainer(Trainer):
    """``Trainer`` whose loss accepts soft targets (Mixup/CutMix) and hard labels with smoothing.

    The loss is the mean over the micro-batch; the Trainer divides it by the accumulation steps (the model is
    told not to take ``num_items_in_batch``, which counts soft targets per class), so the logged loss is the mean
    over the accumulated batch.  Evaluation batches are never mixed nor dropped: every held-out image is scored
    exactly once, also on several processes (the Trainer's ``gather_for_metrics``).
    """

    def __init__(self, *args, label_smoothing: float = 0.0, eval_collator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.label_smoothing, self.eval_collator = label_smoothing, eval_collator
        self.model_accepts_loss_kwargs = False

    def get_eval_dataloader(self, eval_dataset=None):
        mixing, drop_last = self.data_collator, self.args.dataloader_drop_last
        self.data_collator, self.args.dataloader_drop_last = self.eval_collator or mixing, False
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator, self.args.dataloader_drop_last = mixing, drop_last

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.float()
        if labels.dim() == 2:
            loss = torch.sum(-labels * torch.log_softmax(logits, dim=-1), dim=-1).mean()
        else:
            loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        return (loss, outputs) if return_outputs else loss


class StopAfterSteps(TrainerCallback):
    """Stops training right after the checkpoint at ``step`` (what a scheduler's preemption leaves behind)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


def top_k_metrics(accuracy):
    """``compute_metrics`` for the Trainer: top-1 (the ``evaluate`` metric) and top-5 accuracy."""

    def compute(prediction) -> dict[str, float]:
        logits, labels = prediction.predictions, prediction.label_ids
        metrics = accuracy.compute(predictions=np.argmax(logits, axis=-1), references=labels)
        top5 = np.argsort(-logits, axis=-1)[:, :5]
        metrics["top_5_accuracy"] = float(np.mean(np.any(top5 == labels[:, None], axis=-1)))
        metrics["count"] = int(len(labels))
        return metrics

    return compute


def load_model(args: argparse.Namespace, config, id2label: dict[int, str]):
    """The pretrained model with a freshly initialised head when the labels differ (paper D.4: every weight but
    the classifier)."""
    labels = dict(id2label=id2label, label2id={v: k for k, v in id2label.items()})
    if args.arch == "euclidean":
        from transformers import ViTForImageClassification

        model = ViTForImageClassification.from_pretrained(
            args.model, ignore_mismatched_sizes=True, trust_remote_code=args.trust_remote_code, **labels
        )
    else:
        import polar_vit_hf as P

        model = P.PolarViTForImageClassification.from_pretrained(
            args.model,
            ignore_mismatched_sizes=True,
            drop_path_rate=args.drop_path,
            trust_remote_code=args.trust_remote_code,
            **labels,
        )
    if {int(k): v for k, v in config.id2label.items()} != id2label:
        if args.arch == "euclidean":  # transformers' ViT: a new linear head, initialised by the model's own rule
            model.classifier = torch.nn.Linear(model.config.hidden_size, len(id2label))
            model._init_weights(model.classifier)
        else:
            model.reset_classifier(id2label)
        print(f"new label set ({len(id2label)} classes): a new classifier head")
    return model


def build_optimizer(model, arch: str, weight_decay: float, lr: float) -> torch.optim.Optimizer:
    """Riemannian AdamW with the paper's parameter groups (Polar-ViT) or AdamW decaying weight matrices only."""
    from polar_vit_hf.optim import RiemannianAdamW, euclidean_param_groups, param_groups

    if arch == "polar":
        return RiemannianAdamW(param_groups(model, weight_decay), lr=lr)
    return torch.optim.AdamW(euclidean_param_groups(model, weight_decay), lr=lr)


def batch_plan(args: argparse.Namespace, world: int, train_size: int) -> dict[str, int | float]:
    """Effective batch, accumulation, learning rate, steps and warm-up for ``world`` processes."""
    per_step = args.per_device_batch_size * world
    accum = args.grad_accum
    if args.effective_batch:
        if args.effective_batch % per_step:
            raise UserError(
                f"--effective_batch {args.effective_batch} is not a multiple of --per_device_batch_size "
                f"{args.per_device_batch_size} x {world} processes"
            )
        accum = args.effective_batch // per_step
    effective = per_step * accum
    steps_per_epoch = max(1, train_size // per_step // accum)
    total = args.max_steps if args.max_steps > 0 else int(math.ceil(args.epochs * steps_per_epoch))
    return dict(
        world=world,
        grad_accum=accum,
        effective_batch=effective,
        lr=args.base_lr * effective / 512,
        steps_per_epoch=steps_per_epoch,
        steps=total,
        warmup_steps=min(total, int(args.warmup_epochs * steps_per_epoch)),
    )


def latest_checkpoint(output_dir: Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None


@command("polar-vit-finetune")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import evaluate
    from accelerate import PartialState
    from timm.data import Mixup
    from transformers import set_seed

    from polar_vit_hf.training.data import build_data
    from polar_vit_hf.training.official_data import DataOptions
    from polar_vit_hf.training.pretrain import prepare_output_dir

    # the launcher's processes (torchrun, accelerate launch), or one
    state = PartialState(cpu=not torch.cuda.is_available())
    set_seed(args.seed)  # before the head is built: the same seed, the same run
    config = load_config(args.model, args.arch, args.trust_remote_code)
    image_size = args.image_size or config.image_size
    output_dir = Path(args.output_dir)
    resume = None
    if args.resume_from_checkpoint:
        resume = (
            latest_checkpoint(output_dir) if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint
        )
        if resume is None or not Path(resume).is_dir():
            raise UserError(f"--resume_from_checkpoint: no checkpoint in {output_dir} ({args.resume_from_checkpoint})")
    elif latest_checkpoint(output_dir) is not None:
        raise UserError(
            f"{output_dir} already holds checkpoints ({latest_checkpoint(output_dir)}); pass "
            f"--resume_from_checkpoint to continue or choose another --output_dir"
        )
    if state.is_main_process:
        prepare_output_dir(output_dir)
    state.wait_for_everyone()
    options = DataOptions.from_arguments(args.dataset, args)
    with state.main_process_first():  # the main process fills the datasets cache first
        raw = build_data(
            args.dataset,
            image_size,
            {},
            args.data_dir,
            args.train_split,
            args.eval_split,
            args.max_bad_fraction,
            output_dir / "bad_samples.txt",
            options=options,
            label_column=args.label_column,
            seed=args.seed,
        )
    train = raw.train.with_transform(build_transforms(image_size, args, True))
    held_out = raw.eval.with_transform(build_transforms(image_size, args, False))
    model = load_model(args, config, raw.id2label)
    plan = batch_plan(args, state.num_processes, len(train))
    mixup = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup = Mixup(
            mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix,
            label_smoothing=args.label_smoothing,
            num_classes=len(raw.id2label),
        )
    interpolate = args.arch == "polar" and image_size != config.image_size
    by_steps = args.max_steps > 0
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        max_steps=plan["steps"],
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=plan["grad_accum"],
        learning_rate=plan["lr"],
        lr_scheduler_type="cosine",
        warmup_steps=plan["warmup_steps"],
        max_grad_norm=args.max_grad_norm,
        eval_strategy="steps" if by_steps else "epoch",
        eval_steps=plan["steps"] if by_steps else None,
        save_strategy=args.save_strategy if not (by_steps and args.save_strategy == "epoch") else "steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        logging_steps=args.logging_steps,
        seed=args.seed,
        data_seed=args.seed,
        report_to=[] if args.report_to == "none" else [args.report_to],
        remove_unused_columns=False,
        dataloader_drop_last=True,
        dataloader_num_workers=args.dataloader_num_workers,
        dataloader_persistent_workers=args.dataloader_num_workers > 0,
        dataloader_pin_memory=torch.cuda.is_available(),
        bf16=args.bf16,
        tf32=True if args.tf32 else None,
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,
        torch_compile=compile_wanted(args.compile, torch.device("cuda" if torch.cuda.is_available() else "cpu")),
    )
    accuracy = evaluate.load(str(METRICS / "accuracy"))
    trainer = SoftTargetTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=MixupCollator(mixup, interpolate),
        eval_collator=MixupCollator(None, interpolate),
        compute_metrics=top_k_metrics(accuracy),
        label_smoothing=args.label_smoothing,
        optimizers=(build_optimizer(model, args.arch, args.weight_decay, plan["lr"]), None),
        callbacks=[StopAfterSteps(args.stop_after_steps)] if args.stop_after_steps else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    if (
        args.stop_after_steps
        and trainer.state.global_step == args.stop_after_steps
        and trainer.state.global_step < plan["steps"]
    ):
        print(f"stopping after the checkpoint at step {args.stop_after_steps} (--stop_after_steps)")
        return 0
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)  # the main process writes; the others wait below
    if trainer.is_world_process_zero():
        trainer.save_metrics("eval", metrics)  # eval_results.json: the model card's evaluation table
        trainer.save_state()  # trainer_state.json: the per-step log (loss, learning rate, gradient norm)
        save_processor(Path(args.output_dir), image_size, args.arch)
        write_run_info(Path(args.output_dir), args, config, raw, image_size, plan)
        print(
            f"held-out accuracy ({args.eval_split}, {metrics.get('eval_count')} images) at the last step: "
            f"top-1 {metrics.get('eval_accuracy')}, top-5 {metrics.get('eval_top_5_accuracy')}"
        )
    trainer.accelerator.wait_for_everyone()
    if args.push_to_hub and trainer.is_world_process_zero():
        from polar_vit_hf.conversion.push import publish

        return 0 if publish(Path(args.output_dir), args.hub_model_id, private=args.hub_private) else 1
    return 0


def save_processor(folder: Path, image_size: int, arch: str) -> None:
    """The image processor that loads with the fine-tuned model (ViT's own for ``--arch euclidean``)."""
    from polar_vit_hf.training.pretrain import save_processor as save

    save(folder, image_size, arch)


def write_run_info(folder: Path, args: argparse.Namespace, config, raw, image_size: int, plan: dict) -> None:
    """``run_info.json``: what ``conversion/export.py`` writes into the model card."""
    revision = getattr(config, "_commit_hash", None)
    info = {
        "script": "training/finetune.py",
        "arch": args.arch,
        "init_from": args.model,
        "base_model": None if Path(args.model).expanduser().exists() else args.model,
        "base_model_revision": revision,
        "dataset": args.dataset,
        "train_split": args.train_split,
        "eval_split": args.eval_split,
        "num_labels": len(raw.id2label),
        "image_size": image_size,
        "lr": plan["lr"],
        "effective_batch": plan["effective_batch"],
        "processes": plan["world"],
        "grad_accum": plan["grad_accum"],
        "steps": plan["steps"],
        "warmup_steps": plan["warmup_steps"],
        "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm,
        "label_smoothing": args.label_smoothing,
        "mixup": args.mixup,
        "cutmix": args.cutmix,
        "rand_augment": args.rand_augment,
        "random_erasing": args.random_erasing,
        "crop_scale": args.crop_scale,
        "hflip": args.hflip,
        "drop_path": args.drop_path,
        "bf16": args.bf16,
        "seed": args.seed,
        "recipe": args.recipe,
    }
    (folder / "run_info.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    sys.exit(main())
