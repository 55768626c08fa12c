"""Fine-tune a pretrained Polar-ViT with the transformers ``Trainer`` (H-CAST recipe, paper D.4).

Examples:
    python training/finetune.py --model runs/imagenet/model --dataset cub --output_dir runs/cub
    python training/finetune.py --model org/polar-vit-small --dataset imagefolder --data_dir ./aircraft ...

Datasets by Hub name (``cub`` = ``bentrevett/caltech-ucsd-birds-200-2011``, ``aircraft`` =
``HuggingFaceM4/FGVC-Aircraft``, or any image-classification dataset with an Image and a
ClassLabel column) or a local ``imagefolder``: ``DATA_DIR/train/<label>/<image>`` and
``DATA_DIR/test/<label>/<image>`` (pass ``--eval_split`` if the held-out split has another name).
Every pretrained weight is loaded except the classifier, which is re-initialised for the new
labels (``ignore_mismatched_sizes``).  Defaults are the H-CAST recipe: 100 epochs, 5 warm-up,
cosine, lr 5e-4 * B / 512 with B = 256, weight decay 0.05, label smoothing 0.1, Mixup 0.8,
CutMix 1.0 (in the collator), RandAugment (m9, mstd 0.5), random erasing 0.25, stochastic depth
0.1, no gradient clipping, at the pretrained model's resolution (224 x 224 for the ImageNet
models).  Polar-ViT trains with Riemannian AdamW; accuracy comes from an ``evaluate`` metric kept
in ``training/metrics/accuracy`` (works offline).  The output dir is a ``save_pretrained`` folder
plus ``eval_results.json`` and ``run_info.json``, which ``conversion/export.py`` turns into the
model card; ``--push_to_hub`` runs export -> verify -> push on it (``conversion/push.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import Trainer, TrainingArguments

from polar_vit_hf.cli import UserError, add_debug_flag, command

METRICS = Path(__file__).resolve().parent / "metrics"
DATASETS = {"cub": "bentrevett/caltech-ucsd-birds-200-2011", "aircraft": "HuggingFaceM4/FGVC-Aircraft"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a save_pretrained folder or a Hub id")
    parser.add_argument("--dataset", required=True, help="cub, aircraft, a Hub name, 'imagefolder' or 'digits'")
    parser.add_argument("--data_dir")
    parser.add_argument("--train_split", default="train")
    parser.add_argument("--eval_split", default="test")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--epochs", type=float, default=100)
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument("--warmup_epochs", type=float, default=5)
    parser.add_argument("--per_device_batch_size", type=int, default=32)
    parser.add_argument("--grad_accum", type=int, default=8, help="effective batch = per-device x devices x accum")
    parser.add_argument("--base_lr", type=float, default=5e-4, help="lr = base_lr * effective_batch / 512")
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--rand_augment", default="rand-m9-mstd0.5-inc1", help="timm auto-augment string or 'none'")
    parser.add_argument("--random_erasing", type=float, default=0.25)
    parser.add_argument("--crop_scale", type=float, default=0.08,
                        help="smallest area fraction of the random resized crop (timm's scale=(MIN, 1); 1 = no crop)")
    parser.add_argument("--hflip", type=float, default=0.5, help="probability of a horizontal flip (0: none)")
    parser.add_argument("--drop_path", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--push_to_hub", action="store_true",
                        help="export, verify and push the result (conversion/push.py publish) after training")
    parser.add_argument("--hub_model_id", help="repo id to push to (default: <your user>/<output_dir name>)")
    parser.add_argument("--hub_private", action="store_true")
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument("--max_bad_fraction", type=float, default=0.01,
                        help="stop when more than this fraction of the images read cannot be decoded")
    add_debug_flag(parser)
    return parser.parse_args(argv)


def looks_like_a_path(name: str) -> bool:
    """A local path rather than a Hub id (``namespace/name``): absolute, relative (``./``, ``~``) or deeper."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def load_config(name: str, trust_remote_code: bool):
    """The config of ``--model``: a local folder, or a Hub repo id; the user's mistakes as :class:`UserError`."""
    import polar_vit_hf as P

    folder = Path(name).expanduser()
    if folder.exists() or looks_like_a_path(name):
        if not folder.is_dir():
            raise UserError(f"--model {name}: no such folder (a save_pretrained folder or a Hub id namespace/name)")
        if not (folder / "config.json").exists():
            raise UserError(f"--model {name}: the folder has no config.json (not a save_pretrained folder)")
    try:
        return P.PolarViTConfig.from_pretrained(str(folder) if folder.exists() else name,
                                                trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise UserError(f"--model {name}: could not load it ({str(error).splitlines()[0]}); give a local "
                        f"save_pretrained folder, or a Hub id that is cached or reachable") from None


def build_transforms(image_size: int, args: argparse.Namespace, train: bool):
    """timm's DeiT/H-CAST pipeline (RandAugment, random erasing) for training, resize for evaluation."""
    from timm.data import create_transform

    auto = None if args.rand_augment == "none" else args.rand_augment
    return create_transform(input_size=image_size, is_training=train, auto_augment=auto if train else None,
                            re_prob=args.random_erasing if train else 0.0, interpolation="bicubic",
                            scale=(args.crop_scale, 1.0), hflip=args.hflip,
                            mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0)


class MixupCollator:
    """Stacks ``(pixels, label)`` pairs and applies timm's Mixup/CutMix with label smoothing."""

    def __init__(self, mixup):
        self.mixup = mixup

    def __call__(self, batch):
        pixels = torch.stack([item[0] for item in batch])
        labels = torch.tensor([item[1] for item in batch])
        if self.mixup is not None and len(batch) % 2 == 0:
            pixels, labels = self.mixup(pixels, labels)  # soft targets (B, C)
        return {"pixel_values": pixels, "labels": labels}


class SoftTargetTrainer(Trainer):
    """``Trainer`` whose loss accepts soft targets (Mixup/CutMix) and hard labels with smoothing."""

    def __init__(self, *args, label_smoothing: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.label_smoothing = label_smoothing

    def get_eval_dataloader(self, eval_dataset=None):
        """Evaluation batches are never mixed."""
        mixing, self.data_collator = self.data_collator, MixupCollator(None)
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = mixing

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits
        if labels.dim() == 2:
            loss = torch.sum(-labels * torch.log_softmax(logits, dim=-1), dim=-1).mean()
        else:
            loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        return (loss, outputs) if return_outputs else loss


@command("polar-vit-finetune")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import evaluate
    from timm.data import Mixup

    import polar_vit_hf as P
    from polar_vit_hf.optim import RiemannianAdamW, param_groups
    from polar_vit_hf.training.data import build_data
    from polar_vit_hf.training.pretrain import prepare_output_dir

    config = load_config(args.model, args.trust_remote_code)
    image_size = config.image_size  # fine-tune at the pretraining resolution (224 for the ImageNet models)
    dataset = DATASETS.get(args.dataset, args.dataset)
    output_dir = Path(args.output_dir)
    prepare_output_dir(output_dir)
    raw = build_data(dataset, image_size, {}, args.data_dir, args.train_split, args.eval_split,
                     args.max_bad_fraction, output_dir / "bad_samples.txt")
    train = raw.train.with_transform(build_transforms(image_size, args, True))
    held_out = raw.eval.with_transform(build_transforms(image_size, args, False))
    id2label = raw.id2label
    model = P.PolarViTForImageClassification.from_pretrained(
        args.model, id2label=id2label, label2id={v: k for k, v in id2label.items()},
        ignore_mismatched_sizes=True, drop_path_rate=args.drop_path, trust_remote_code=args.trust_remote_code,
    )
    if dict(config.id2label) != id2label:  # another label set: the pretrained classes mean nothing here
        for parameter in model.classifier.parameters():  # transformers' init functions skip loaded tensors
            parameter._is_hf_initialized = False
        model.classifier.init_parameters()
        print(f"new label set ({len(id2label)} classes): classifier head re-initialised")
    world = max(1, torch.cuda.device_count())
    effective = args.per_device_batch_size * world * args.grad_accum
    lr = args.base_lr * effective / 512
    steps_per_epoch = max(1, len(train) // (args.per_device_batch_size * world) // args.grad_accum)
    total = args.max_steps if args.max_steps > 0 else int(math.ceil(args.epochs * steps_per_epoch))
    warmup = min(total, int(args.warmup_epochs * steps_per_epoch))
    optimizer = RiemannianAdamW(param_groups(model, args.weight_decay), lr=lr)
    mixup = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.label_smoothing,
                      num_classes=len(id2label))
    accuracy = evaluate.load(str(METRICS / "accuracy"))

    def compute_metrics(prediction):
        logits, labels = prediction.predictions, prediction.label_ids
        metrics = accuracy.compute(predictions=np.argmax(logits, axis=-1), references=labels)
        if logits.shape[-1] > 5:
            top5 = np.argsort(-logits, axis=-1)[:, :5]
            metrics["top_5_accuracy"] = float(np.mean(np.any(top5 == labels[:, None], axis=-1)))
        return metrics

    training_args = TrainingArguments(
        output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=total,
        per_device_train_batch_size=args.per_device_batch_size, per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=lr, lr_scheduler_type="cosine",
        warmup_steps=warmup, max_grad_norm=0.0, eval_strategy="epoch" if args.max_steps <= 0 else "steps",
        eval_steps=None if args.max_steps <= 0 else total, save_strategy="no", logging_steps=10, seed=args.seed,
        report_to=["tensorboard"], remove_unused_columns=False, dataloader_drop_last=True,
    )
    trainer = SoftTargetTrainer(
        model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
        data_collator=MixupCollator(mixup), compute_metrics=compute_metrics,
        optimizers=(optimizer, None), label_smoothing=args.label_smoothing,
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)
    trainer.save_metrics("eval", metrics)  # eval_results.json: the model card's evaluation table
    P.PolarViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(args.output_dir)
    if trainer.is_world_process_zero():
        run_info = {"script": "training/finetune.py", "init_from": args.model, "dataset": dataset,
                    "image_size": image_size, "eval_split": args.eval_split, "lr": lr, "effective_batch": effective,
                    "steps": total, "warmup_steps": warmup, "weight_decay": args.weight_decay,
                    "label_smoothing": args.label_smoothing, "mixup": args.mixup, "cutmix": args.cutmix,
                    "rand_augment": args.rand_augment, "random_erasing": args.random_erasing,
                    "crop_scale": args.crop_scale, "hflip": args.hflip, "drop_path": args.drop_path}
        (Path(args.output_dir) / "run_info.json").write_text(json.dumps(run_info, indent=2))
    print(f"held-out accuracy ({args.eval_split}) at the last step: {metrics.get('eval_accuracy')}")
    if args.push_to_hub and trainer.is_world_process_zero():
        from polar_vit_hf.conversion.push import publish

        return 0 if publish(Path(args.output_dir), args.hub_model_id, private=args.hub_private) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
