"""Pretrain Polar-ViT (or the same-size Euclidean ViT) with Accelerate, from one CPU to many GPUs.

Examples:
    python training/pretrain.py --output_dir runs/digits                      # digits demo on CPU
    python training/pretrain.py --recipe cifar100 --output_dir runs/c100      # HexFormer recipe
    accelerate launch --multi_gpu --num_processes 8 training/pretrain.py --recipe imagenet1k ...
    python training/pretrain.py --recipe digits-demo --arch euclidean ...     # transformers' ViT

Recipes are YAML files in ``training/recipes/`` (or a path); command-line flags override them.
Every ``--save_steps`` optimizer steps the complete state (model, optimizer, scheduler, RNG of
every process, data position) is written atomically to ``OUTPUT_DIR/checkpoints/step_N``;
``--resume`` continues from the newest one exactly as if never interrupted; a corrupt or
mismatched checkpoint is an error, never a silent restart.  ``--stop_after_steps N`` exits
cleanly right after the checkpoint at step N (as a scheduler's preemption would).  Metrics go to
``metrics.csv``, TensorBoard (``tensorboard/``) and ``curves.png``; the final and the best model
are exported with ``save_pretrained`` to ``model/`` and ``best_model/``.

When something goes wrong: a mistake in the input (path, dataset, ``--set``, output folder) ends
with exit status 2 and a short message (``--debug`` shows the traceback); an unreadable image is
skipped and listed in ``bad_samples.txt`` (the run stops past ``--max_bad_fraction``); an optimizer
step with a non-finite loss, gradient or update is skipped and logged (the run stops after
``--max_nonfinite_steps`` in a row, weights untouched); a checkpoint that cannot be written leaves
the previous one intact and stops the run.
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import itertools
import json
import math
import os
import shutil
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

from polar_vit_hf.cli import UserError, add_debug_flag, command
from polar_vit_hf.training.compilation import CompileProgress, add_compile_flag, compile_regions, compile_wanted

RECIPES = Path(__file__).resolve().parent / "recipes"
CSV_FIELDS = ["step", "epoch", "loss", "lr", "grad_norm", "eval_accuracy", "eval_top5_accuracy", "skipped"]
# keys a recipe section may hold besides those of the shipped recipes (read with defaults)
OPTIONAL_RECIPE_KEYS = {
    "model": {"calibrate_radius", "calibrate_images"},
    "data": {"train_split", "eval_split", "label_column"},
    "augment": {
        "crop_min_scale",
        "eval_resize",
        "randaugment_ops",
        "randaugment_magnitude",
        "random_crop_padding",
        "autoaugment_policy",
        "random_erasing_max_area",
    },
    "optim": {
        "epochs",
        "warmup_epochs",
        "warmup_steps",
        "max_steps",
        "eval_steps",
        "save_steps",
        "decoupled_wd",
        "max_grad_norm",
    },
}


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed from (corrupt, incomplete, from another run) or written."""


class DivergedError(UserError):
    """Too many optimizer steps in a row with a non-finite loss, gradient or update."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="digits-demo", help="name in training/recipes/ or a YAML path")
    parser.add_argument("--arch", choices=("polar", "euclidean"), default="polar")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, help="optimizer steps (overrides the recipe's epochs)")
    parser.add_argument("--save_steps", type=int)
    parser.add_argument("--eval_steps", type=int)
    parser.add_argument("--stop_after_steps", type=int, help="exit cleanly right after the checkpoint at this step")
    parser.add_argument(
        "--resume", nargs="?", const="latest", help="continue from the newest (or the given) checkpoint"
    )
    parser.add_argument(
        "--dataset",
        help="imagenet-1k / cub / aircraft (official layout with --data_dir), "
        "webdataset, a Hub name, 'imagefolder' or 'digits'",
    )
    parser.add_argument("--data_dir", help="the dataset's folder (official layout), or the webdataset shard pattern")
    from polar_vit_hf.training.official_data import add_dataset_arguments

    add_dataset_arguments(parser)
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="stream the dataset (Hub or webdataset) instead of preparing it on disk first",
    )
    parser.add_argument("--batch_size", type=int, help="global batch size (split across processes)")
    parser.add_argument("--grad_accum", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument(
        "--mixed_precision",
        choices=("no", "fp16", "bf16"),
        help="overrides `accelerate launch --mixed_precision`, which overrides the recipe",
    )
    parser.add_argument("--max_grad_norm", type=float, help="clip the global gradient norm (overrides the recipe)")
    parser.add_argument("--tf32", action="store_true", help="TF32 matrix products on Ampere or newer GPUs")
    parser.add_argument(
        "--num_workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="data loader worker processes (default: min(8, CPUs))",
    )
    parser.add_argument(
        "--init_from",
        help="start from pretrained weights: a Polar-ViT folder, or for --arch "
        "euclidean a transformers ViTForImageClassification folder / Hub id (the head is "
        "re-initialised when the labels differ)",
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU exists")
    add_compile_flag(parser)
    parser.add_argument("--no_progress", action="store_true")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any recipe entry, e.g. --set augment.mixup=0 --set model.k=0.5",
    )
    parser.add_argument(
        "--max_bad_fraction",
        type=float,
        default=0.01,
        help="stop when more than this fraction of the images read cannot be decoded",
    )
    parser.add_argument(
        "--max_nonfinite_steps",
        type=int,
        default=5,
        help="stop after this many steps in a row with a non-finite loss, gradient or update",
    )
    add_debug_flag(parser)
    return parser.parse_args(argv)


def load_recipe(name: str) -> dict:
    path = Path(name) if name.endswith((".yaml", ".yml")) else RECIPES / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise UserError(f"--recipe {name}: not found (known: {known}, or a path to a .yaml file)")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"--recipe {path}: not valid YAML ({error})") from None


def allowed_recipe_keys(section: str) -> set[str]:
    """Keys ``--set`` accepts in ``section``: those of the shipped recipes, the optional ones and, for ``model``,
    every ``PolarViTConfig`` field."""
    keys = set(OPTIONAL_RECIPE_KEYS.get(section, ()))
    for path in RECIPES.glob("*.yaml"):
        keys |= set((yaml.safe_load(path.read_text()) or {}).get(section) or {})
    if section == "model":
        import polar_vit_hf as P

        keys |= set(P.PolarViTConfig.__annotations__)
    return keys


def apply_overrides(recipe: dict, args: argparse.Namespace) -> dict:
    for key, section, value in (
        ("max_steps", "optim", args.max_steps),
        ("save_steps", "optim", args.save_steps),
        ("eval_steps", "optim", args.eval_steps),
        ("batch_size", "optim", args.batch_size),
        ("grad_accum", "optim", args.grad_accum),
        ("lr", "optim", args.lr),
        ("max_grad_norm", "optim", args.max_grad_norm),
        ("dataset", "data", args.dataset),
        ("label_column", "data", args.label_column),
    ):
        if value is not None:
            recipe[section][key] = value
    recipe["mixed_precision"] = mixed_precision(args.mixed_precision, recipe.get("mixed_precision", "no"))
    for item in args.set:
        dotted, equals, raw = item.partition("=")
        section, _, key = dotted.partition(".")
        if not equals or not key or not isinstance(recipe.get(section), dict):
            sections = sorted(k for k, v in recipe.items() if isinstance(v, dict))
            raise UserError(f"--set {item!r}: expected SECTION.KEY=VALUE with SECTION in {sections}")
        if key not in allowed_recipe_keys(section):
            raise UserError(
                f"--set {item!r}: {section} has no setting {key!r} "
                f"(known: {', '.join(sorted(allowed_recipe_keys(section)))})"
            )
        try:
            recipe[section][key] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise UserError(f"--set {item!r}: the value is not valid YAML ({error})") from None
    return recipe


def mixed_precision(flag: str | None, recipe: str) -> str:
    """``--mixed_precision``, else ``accelerate launch --mixed_precision`` (``ACCELERATE_MIXED_PRECISION``), else
    the recipe's: the command line wins."""
    return flag or os.environ.get("ACCELERATE_MIXED_PRECISION") or recipe or "no"


def build_model(recipe: dict, arch: str, id2label: dict[int, str], init_from: str | None = None):
    """The model to train and its Polar-ViT config; ``init_from`` loads pretrained weights."""
    import polar_vit_hf as P
    from polar_vit_hf.baselines import euclidean_vit

    not_config = ("preset", "calibrate_radius", "calibrate_images")
    overrides = {k: v for k, v in recipe["model"].items() if k not in not_config}
    try:
        config = P.PolarViTConfig.from_preset(
            recipe["model"]["preset"],
            image_size=recipe["data"]["image_size"],
            id2label=id2label,
            label2id={v: k for k, v in id2label.items()},
            **overrides,
        )
    except (ValueError, TypeError) as error:
        raise UserError(f"invalid model settings (recipe / --set model.*): {error}") from None
    if init_from is None:
        return (euclidean_vit(config) if arch == "euclidean" else P.PolarViTForImageClassification(config)), config
    from transformers import ViTForImageClassification

    cls = ViTForImageClassification if arch == "euclidean" else P.PolarViTForImageClassification
    labels = dict(id2label=id2label, label2id={v: k for k, v in id2label.items()})
    return cls.from_pretrained(init_from, ignore_mismatched_sizes=True, **labels), config


def calibrate(model, recipe: dict, arch: str, train, accelerator: Accelerator) -> None:
    """D.2 first-batch radius calibration when the recipe sets ``model.calibrate_radius``: the
    first ``model.calibrate_images`` (default 32) training images, the same on every process (same
    seed), so every rank ends with the same weights.  A resumed run then loads its checkpoint."""
    radius = recipe["model"].get("calibrate_radius")
    if radius is None or arch != "polar":
        return
    from polar_vit_hf.training.calibration import calibrate_radii

    wanted = int(recipe["model"].get("calibrate_images", 32))
    items = (
        [train[i] for i in range(min(wanted, len(train)))]
        if hasattr(train, "__len__")
        else list(itertools.islice(iter(train), wanted))
    )  # a streamed split: its first images
    count = len(items)
    pixels = torch.stack([item[0] for item in items])
    before = calibrate_radii(model, pixels, float(radius))
    spread = [r for radii in before.values() for r in radii]
    accelerator.print(
        f"calibrated {len(before)} Polar-FC layers on {count} images: median output radius "
        f"{min(spread):.2f}..{max(spread):.2f} -> {float(radius):g}"
    )


def build_optimizer(model, arch: str, optim: dict) -> torch.optim.Optimizer:
    """Riemannian AdamW (Polar-ViT) or AdamW on weight matrices (the Euclidean ViT), with the recipe's decay
    convention: ``decoupled_wd`` is big_vision's ``p -= wd s(t) p``; PyTorch's AdamW gets it as
    ``weight_decay = wd / lr`` (:mod:`polar_vit_hf.optim`)."""
    from polar_vit_hf.optim import RiemannianAdamW, euclidean_param_groups, param_groups

    betas = tuple(optim.get("betas", (0.9, 0.999)))
    decoupled = bool(optim.get("decoupled_wd", False))
    if arch == "polar":
        return RiemannianAdamW(
            param_groups(model, optim["weight_decay"]), lr=optim["lr"], betas=betas, decoupled_wd=decoupled
        )
    weight_decay = optim["weight_decay"] / optim["lr"] if decoupled and optim["lr"] > 0 else optim["weight_decay"]
    return torch.optim.AdamW(euclidean_param_groups(model, weight_decay), lr=optim["lr"], betas=betas)


def total_steps(optim: dict, steps_per_epoch: int) -> tuple[int, int]:
    """``(max_steps, warmup_steps)`` in optimizer steps."""
    max_steps = optim.get("max_steps") or int(optim["epochs"] * steps_per_epoch)
    warmup = optim.get("warmup_steps")
    if warmup is None:
        warmup = int(optim.get("warmup_epochs", 0) * steps_per_epoch)
    return max_steps, min(warmup, max_steps)


def cosine_with_warmup(optimizer, warmup: int, max_steps: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, max_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fingerprint(recipe: dict, arch: str, seed: int, world: int) -> str:
    """What a checkpoint must agree on to be resumed (everything but the run length and output)."""
    essentials = json.loads(json.dumps(recipe, sort_keys=True))
    for key in ("max_steps", "save_steps", "eval_steps"):
        essentials["optim"].pop(key, None)
    payload = json.dumps(dict(recipe=essentials, arch=arch, seed=seed, world=world), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def checkpoints(output_dir: Path) -> list[Path]:
    folder = output_dir / "checkpoints"
    found = [p for p in folder.glob("step_*") if p.is_dir() and p.name.split("_")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("_")[-1]))


def load_checkpoint(accelerator: Accelerator, path: Path, expected: str) -> dict:
    state_file = path / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or incomplete: cannot read {state_file.name} "
            f"({error}); delete it or resume from another checkpoint"
        ) from error
    if state.get("fingerprint") != expected:
        raise CheckpointError(
            f"checkpoint {path} was written by a different run (recipe/arch/seed/process-count fingerprint "
            f"{state.get('fingerprint')} != {expected}); resume it with the same settings or use another --output_dir"
        )
    try:
        accelerator.load_state(str(path))
    except Exception as error:  # noqa: BLE001 - any failure to deserialise is reported as such
        raise CheckpointError(
            f"checkpoint {path} is corrupt or incomplete: {type(error).__name__}: {error}"
        ) from error
    return state


def check_finite_weights(model, where: str) -> None:
    """Refuse to write weights that hold NaN/Inf (an internal error: non-finite steps are never applied)."""
    bad = [name for name, param in model.named_parameters() if not bool(torch.isfinite(param).all())]
    if bad:
        raise RuntimeError(f"refusing to write {where}: {len(bad)} parameters hold NaN/Inf ({bad[:3]})")


def save_checkpoint(accelerator: Accelerator, output_dir: Path, state: dict, model) -> Path:
    """Write the full training state atomically (temporary folder, then rename).

    A write that fails (disk full, permissions) removes the partial folder, keeps the previous
    checkpoint as it was and raises :class:`CheckpointError`.
    """
    final = output_dir / "checkpoints" / f"step_{state['step']}"
    partial = final.with_name(final.name + ".partial")
    check_finite_weights(model, f"checkpoint {final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()

    def write() -> None:
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (partial / "trainer_state.json").write_text(json.dumps(state, indent=2))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)

    write_or_stop(f"checkpoint {final.name} to {final.parent}", output_dir, write, cleanup=partial)
    accelerator.wait_for_everyone()
    return final


def write_or_stop(what: str, output_dir: Path, write, cleanup: Path | None = None) -> None:
    """Run ``write()``; if it fails (disk full, permissions) remove ``cleanup`` and raise :class:`CheckpointError`
    saying which checkpoint is still intact."""
    try:
        write()
    except Exception as error:  # noqa: BLE001 - every failure to write is reported the same way
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        previous = [p.name for p in checkpoints(output_dir)]
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
        raise CheckpointError(
            f"could not write {what} ({type(error).__name__}: {error}); {kept} - free space or "
            f"fix permissions, then continue with --resume"
        ) from None


def guarded_step(optimizer, model) -> bool:
    """``optimizer.step()``, unless the update itself overflows (finite gradients, an absurd step): then the
    weights are put back as they were and ``False`` is returned, so no NaN/Inf ever reaches them."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    try:
        optimizer.step()
        finite = all(bool(torch.isfinite(p).all()) for p in params)
    except ValueError as error:  # the geometry's input checks meeting an overflowing manifold update
        if "NaN or Inf" not in str(error):
            raise
        finite = False
    if not finite:
        with torch.no_grad():
            for param, old in zip(params, before):
                param.copy_(old)
    return finite


def gradients_finite(model) -> bool:
    """Whether every gradient is finite (after DDP's all-reduce: the same answer on every process)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True


def prepare_output_dir(output_dir: Path) -> None:
    """Create ``output_dir`` or explain why it cannot be used."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir}: exists and is not a directory; choose another --output_dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UserError(f"--output_dir {output_dir}: cannot write there ({error.strerror or error})") from None


@torch.no_grad()
def evaluate(model, loader, accelerator: Accelerator) -> tuple[float, float]:
    """``(top-1, top-5)`` accuracy over the held-out split, every image counted once on any number of processes
    (``gather_for_metrics`` drops the samples the last batch repeats)."""
    model.eval()
    correct = torch.zeros(2, device=accelerator.device)
    total = torch.zeros((), device=accelerator.device)
    for pixel_values, labels in loader:
        logits = model(pixel_values=pixel_values).logits
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        top, labels = accelerator.gather_for_metrics((top, labels))
        hits = top == labels.unsqueeze(-1)
        correct += torch.stack([hits[:, 0].sum(), hits.any(-1).sum()]).to(correct.dtype)
        total += labels.numel()
    model.train()
    return float(correct[0] / total), float(correct[1] / total)


def write_metrics(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def plot_curves(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="training loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") not in (None, "")]
    if evals:
        twin = ax.twinx()
        twin.plot(*zip(*evals), "o-", color="tab:orange", label="held-out accuracy")
        twin.set_ylabel("held-out accuracy")
        twin.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@command("polar-vit-pretrain")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipe = apply_overrides(load_recipe(args.recipe), args)
    output_dir = Path(args.output_dir)
    prepare_output_dir(output_dir)
    optim = recipe["optim"]
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=recipe.get("mixed_precision", "no"),
        gradient_accumulation_steps=int(optim.get("grad_accum", 1)),
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "tensorboard")),
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True),
    )
    existing = checkpoints(output_dir)
    if existing and not args.resume:
        raise UserError(
            f"{output_dir} already holds checkpoints ({existing[-1].name}); pass --resume to continue "
            f"or choose another --output_dir"
        )
    set_seed(args.seed)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    from polar_vit_hf.training.data import build_data, build_mixup, unique_bad_samples
    from polar_vit_hf.training.official_data import DataOptions

    bad_log = output_dir / "bad_samples.txt"
    options = DataOptions.from_arguments(recipe["data"]["dataset"], args)
    with accelerator.main_process_first():  # the main process prepares the datasets cache first
        data = build_data(
            recipe["data"]["dataset"],
            recipe["data"]["image_size"],
            recipe["augment"],
            args.data_dir,
            recipe["data"].get("train_split", "train"),
            recipe["data"].get("eval_split", "test"),
            args.max_bad_fraction,
            bad_log,
            options=options,
            label_column=recipe["data"].get("label_column"),
            seed=args.seed,
        )
    model, config = build_model(recipe, args.arch, data.id2label, args.init_from)
    calibrate(model, recipe, args.arch, data.train, accelerator)
    optimizer = build_optimizer(model, args.arch, optim)
    batch = int(optim["batch_size"])
    if batch % accelerator.num_processes:
        raise UserError(f"batch_size={batch} must be divisible by the {accelerator.num_processes} processes")
    streamed = isinstance(data.train, torch.utils.data.IterableDataset)
    loading = loader_options(args.num_workers, accelerator.device)
    train_loader = DataLoader(data.train, batch_size=batch, shuffle=not streamed, drop_last=True, **loading)
    eval_loader = DataLoader(data.eval, batch_size=batch, shuffle=False, **loading)
    if streamed and not optim.get("max_steps"):
        raise UserError("a streamed training split has no known length: give --max_steps (or optim.max_steps)")
    steps_per_epoch = 0 if streamed else len(train_loader) // accelerator.gradient_accumulation_steps
    max_steps, warmup = total_steps(optim, steps_per_epoch)
    scheduler = cosine_with_warmup(optimizer, warmup, max_steps)
    compiling = None
    if compile_wanted(args.compile, accelerator.device):
        compile_regions(model, output_dir, accelerator.print)
        compiling = CompileProgress(output_dir, accelerator.print, save=accelerator.is_main_process)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    mixup = build_mixup(recipe["augment"], len(data.id2label))
    smoothing = float(recipe["augment"].get("label_smoothing", 0.0))
    expected = fingerprint(recipe, args.arch, args.seed, accelerator.num_processes)

    state = dict(step=0, epoch=0, batch_in_epoch=0, best_accuracy=None, fingerprint=expected, nonfinite_in_a_row=0)
    metrics_path = output_dir / "metrics.csv"
    rows: list[dict] = []
    if args.resume:
        path = Path(args.resume) if args.resume != "latest" else (existing[-1] if existing else None)
        if path is None:
            accelerator.print(f"--resume: no checkpoint in {output_dir / 'checkpoints'}; starting at step 0")
        else:
            if not path.is_dir():
                raise CheckpointError(f"--resume {path}: no such checkpoint directory")
            state = load_checkpoint(accelerator, path, expected)
            accelerator.print(f"resumed from {path} at step {state['step']}")
            if metrics_path.exists():
                with open(metrics_path) as handle:
                    rows = [r for r in csv.DictReader(handle) if int(r["step"]) <= state["step"]]
    output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.init_trackers(
        "pretrain",
        config={
            "arch": args.arch,
            "recipe": args.recipe,
            "seed": args.seed,
            "max_steps": max_steps,
            "lr": optim["lr"],
            "batch_size": batch,
        },
    )
    if accelerator.is_main_process:
        (output_dir / "recipe.json").write_text(json.dumps(recipe, indent=2))
        (output_dir / "labels.json").write_text(json.dumps(data.id2label, indent=2))
    from tqdm.auto import tqdm

    progress = tqdm(
        total=max_steps,
        initial=state["step"],
        desc=f"pretrain {args.arch}",
        unit="step",
        disable=args.no_progress or not accelerator.is_main_process,
    )
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)
    model.train()
    stop = False
    while state["step"] < max_steps and not stop:
        train_loader.set_epoch(state["epoch"])
        skip = state["batch_in_epoch"]
        loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for pixel_values, labels in loader:
            with accelerator.accumulate(model):
                if mixup is not None:  # soft targets with label smoothing folded in
                    pixel_values, soft = mixup(pixel_values, labels)
                    logits = model(pixel_values=pixel_values).logits
                    loss = torch.sum(-soft * torch.log_softmax(logits, dim=-1), dim=-1).mean()
                else:
                    loss = criterion(model(pixel_values=pixel_values).logits, labels)
                accelerator.backward(loss)
                skipped, grad_norm = False, ""
                if accelerator.sync_gradients:
                    # a non-finite loss, gradient or update never reaches the weights (the same decision on every
                    # process: gradients are all-reduced, the loss is gathered)
                    loss_finite = bool(torch.isfinite(accelerator.gather(loss.detach().reshape(1))).all())
                    finite = loss_finite and gradients_finite(model)
                    if finite and optim.get("max_grad_norm"):  # the global norm, clipped (big_vision's 1.0)
                        limit = float(optim["max_grad_norm"])
                        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), limit))
                    skipped = not (finite and guarded_step(optimizer, model))
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            state["batch_in_epoch"] += 1
            if not accelerator.sync_gradients:
                continue
            state["step"] += 1
            step = state["step"]
            if compiling is not None:
                compiling.step_done()
            mean_loss = float(accelerator.gather(loss.detach().reshape(1)).mean())
            row = dict(
                step=step,
                epoch=state["epoch"],
                loss=mean_loss,
                lr=scheduler.get_last_lr()[0],
                grad_norm=grad_norm,
                eval_accuracy="",
                eval_top5_accuracy="",
                skipped=int(skipped),
            )
            state["nonfinite_in_a_row"] = state.get("nonfinite_in_a_row", 0) + 1 if skipped else 0
            if skipped:
                accelerator.print(f"step {step}: non-finite loss, gradient or update (loss {mean_loss}); skipped")
                if state["nonfinite_in_a_row"] >= args.max_nonfinite_steps:
                    if accelerator.is_main_process:
                        write_metrics(metrics_path, [*rows, row])
                    raise DivergedError(
                        f"{state['nonfinite_in_a_row']} optimizer steps in a row (up to step {step}) had a non-finite "
                        f"loss, gradient or update, so training stopped; the weights are those before the first of "
                        f"them. Lower the learning rate (--lr) or check the data, then --resume from the last "
                        f"checkpoint"
                    )
            if step % int(optim.get("eval_steps", max_steps)) == 0 or step == max_steps:
                accuracy, top5 = evaluate(model, eval_loader, accelerator)
                row["eval_accuracy"], row["eval_top5_accuracy"] = accuracy, top5
                if state["best_accuracy"] is None or accuracy > state["best_accuracy"]:
                    state["best_accuracy"] = accuracy
                    if accelerator.is_main_process:
                        scores = eval_results(accuracy, top5, recipe, step)
                        write_or_stop(
                            "the best model",
                            output_dir,
                            functools.partial(
                                save_model, accelerator.unwrap_model(model), output_dir / "best_model", scores
                            ),
                        )
                state["last_eval"] = eval_results(accuracy, top5, recipe, step)
            rows.append(row)
            accelerator.log({k: v for k, v in row.items() if v != "" and k != "step"}, step=step)
            progress.update(1)
            progress.set_postfix(loss=f"{mean_loss:.3f}")
            save_now = step % int(optim.get("save_steps", max_steps)) == 0 or step == args.stop_after_steps
            if save_now:
                if accelerator.is_main_process:
                    write_metrics(metrics_path, rows)
                save_checkpoint(accelerator, output_dir, dict(state), accelerator.unwrap_model(model))
            if step == args.stop_after_steps:
                accelerator.print(f"stopping after the checkpoint at step {step} (--stop_after_steps)")
                stop = True
                break
            if step >= max_steps:
                break
        else:
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
    progress.close()
    bad = unique_bad_samples(bad_log)
    if bad:
        accelerator.print(f"skipped {len(bad)} unreadable image(s), listed in {bad_log}")
    if accelerator.is_main_process:
        write_metrics(metrics_path, rows)
        plot_curves(
            [
                dict(
                    r,
                    step=int(r["step"]),
                    loss=float(r["loss"]),
                    eval_accuracy=float(r["eval_accuracy"]) if r["eval_accuracy"] not in ("", None) else None,
                )
                for r in rows
            ],
            output_dir / "curves.png",
            f"{args.arch} on {recipe['data']['dataset']}",
        )
        if not stop:
            final = accelerator.unwrap_model(model)
            check_finite_weights(final, "the final model")
            write_or_stop(
                "the final model", output_dir, lambda: save_model(final, output_dir / "model", state.get("last_eval"))
            )
            for folder in (output_dir / "model", output_dir / "best_model"):
                if folder.exists():
                    save_processor(folder, recipe["data"]["image_size"], args.arch)
            accelerator.print(
                f"final held-out accuracy top-1 {rows[-1]['eval_accuracy']}, top-5 "
                f"{rows[-1]['eval_top5_accuracy']}; model in {output_dir / 'model'}"
            )
    accelerator.wait_for_everyone()
    accelerator.end_training()  # also tears down the process group
    return 0


def loader_options(num_workers: int, device: torch.device) -> dict:
    """DataLoader settings that keep a GPU fed: worker processes kept alive across epochs, four batches prefetched
    per worker, pinned memory for CUDA copies."""
    workers = max(0, int(num_workers))
    return dict(
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )


def eval_results(top1: float, top5: float, recipe: dict, step: int) -> dict:
    """The held-out scores saved beside a model (``eval_results.json``: what its model card reports)."""
    return {
        "eval_accuracy": top1,
        "eval_top_5_accuracy": top5,
        "eval_split": recipe["data"].get("eval_split", "test"),
        "dataset": recipe["data"]["dataset"],
        "step": step,
    }


def save_model(model, folder: Path, scores: dict | None) -> None:
    """``save_pretrained`` and, when the model was evaluated, its scores as ``eval_results.json``."""
    model.save_pretrained(folder)
    if scores is not None:
        (folder / "eval_results.json").write_text(json.dumps(scores, indent=2))


def save_processor(folder: Path, image_size: int, arch: str) -> None:
    """The image processor that loads with the exported model (ViT's own for ``--arch euclidean``)."""
    from transformers import ViTImageProcessor

    from polar_vit_hf import PolarViTImageProcessor

    processor = ViTImageProcessor if arch == "euclidean" else PolarViTImageProcessor
    processor(size={"height": image_size, "width": image_size}).save_pretrained(folder)


if __name__ == "__main__":
    raise SystemExit(main())
