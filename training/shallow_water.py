"""Shallow-water dynamics on a rotating sphere: next-step prediction on the icosphere (SO(3)-RoPE Sec. 4).

Run:  python training/shallow_water.py --model polar --output_dir outputs/shallow-water [--max_steps 600]

The task of SO(3)-RoPE's experiment and of Bonev et al.'s spherical neural operators: given the state of the
shallow-water equations on a rotating sphere at time ``t``, predict it at ``t + dt``.  Data come from
torch-harmonics' spectral solver (``torch_harmonics.examples.ShallowWaterSolver``), as in its own examples:

* a random initial condition (``random_initial_condition(mach=0.2)``: white spherical-harmonic coefficients of
  geopotential, vorticity and divergence) is the input; ``dt / solver_dt`` steps of the solver (third-order
  Adams-Bashforth, implicit hyperdiffusion) give the target.  Seed ``s`` gives the same simulations everywhere.
* Both states leave the solver on its equiangular grid (``nlat x 2 nlat``, rows at the colatitudes
  ``pi j / (nlat - 1)``, both poles included, columns at longitudes ``2 pi k / nlon``) and are resampled at the
  icosphere's vertices by bilinear interpolation in colatitude and longitude (:func:`grid_to_icosphere`; longitude
  wraps around; ``nlat = 2^(level + 3)``, four grid rows per icosphere edge).  The three channels are the
  geopotential ``phi``, the vorticity and the divergence.
* Simulations are cached on disk (``$POLAR_VIT_DATA/shallow-water``, safetensors, keyed by every setting), so a
  benchmark's models and seeds train on the same data; generating shows a progress bar.
* Inputs and targets are normalised by the training inputs' per-channel mean and standard deviation (as
  torch-harmonics' ``PdeDataset``); ``normalization.json`` in the output folder holds them.

Models (``--model``): ``polar`` (:class:`PolarViTSphericalForDensePrediction` with SO(3)-RoPE), ``so3vit`` (its
Euclidean twin, SO3ViT) and ``vit`` (the same Euclidean model with learned absolute positions and no relative
ones).  ``--longitude_encoding K`` adds the Legendre channels that break the symmetry down to rotations about the
z-axis, as the Coriolis force does (SO(3)-RoPE Sec. 3; off by default).  Training: transformers' ``Trainer``
(AdamW, or Riemannian AdamW with the paper's parameter groups for ``polar``; cosine schedule with warm-up), the
quadrature-weighted squared l2 loss; ``--resume_from_checkpoint [DIR]`` continues a run.  The output folder is a
``save_pretrained`` folder plus ``metrics.csv`` (the training log), ``eval_results.json`` (l1 and l2 errors on the
held-out simulations) and ``normalization.json``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import polar_vit_hf as P
from polar_vit_hf.cli import UserError, add_debug_flag, command
from polar_vit_hf.modeling.spherical import icosphere, sphere_errors

MODELS = ("polar", "so3vit", "vit")
CHANNELS = ("geopotential", "vorticity", "divergence")


@dataclass(frozen=True)
class Simulation:
    """What fixes a set of simulations: the icosphere they are sampled on and the solver's settings."""

    icosphere_level: int = 2
    dt: float = 3600.0  # seconds from input to target (torch-harmonics' examples: one hour)
    solver_dt: float = 150.0  # the solver's own step
    mach: float = 0.2

    @property
    def nlat(self) -> int:
        """Rows of the solver's equiangular grid: four per icosphere edge."""
        return 2 ** (self.icosphere_level + 3)

    def key(self, split: str, count: int, seed: int) -> str:
        """A file name that changes with every setting (and the solver's version)."""
        import torch_harmonics

        text = json.dumps([asdict(self), split, count, seed, torch_harmonics.__version__], sort_keys=True)
        return f"{split}-{count}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.safetensors"


def data_dir() -> Path:
    """Where simulations are cached: ``$POLAR_VIT_DATA/shallow-water`` or ``~/.cache/polar_vit_hf/shallow-water``."""
    root = os.environ.get("POLAR_VIT_DATA") or Path.home() / ".cache" / "polar_vit_hf"
    return Path(root) / "shallow-water"


def grid_to_icosphere(grid: Tensor, colatitude: Tensor, vertices: Tensor) -> Tensor:
    """Bilinear samples ``(..., V)`` of fields ``(..., nlat, nlon)`` at unit ``vertices (V, 3)``.

    Row ``j`` lies at ``colatitude[j]`` (increasing, poles allowed), column ``k`` at longitude ``2 pi k / nlon``;
    longitude wraps around.
    """
    nlat, nlon = grid.shape[-2:]
    x, y, z = vertices.to(torch.float64).unbind(-1)
    theta = torch.arccos(z.clamp(-1, 1))
    row = (torch.searchsorted(colatitude, theta, right=True) - 1).clamp(0, nlat - 2)
    fr = ((theta - colatitude[row]) / (colatitude[row + 1] - colatitude[row])).clamp(0, 1)
    col = torch.remainder(torch.atan2(y, x), 2 * math.pi) * nlon / (2 * math.pi)
    c0 = col.floor().long()
    fc = col - c0
    c0, c1 = c0 % nlon, (c0 + 1) % nlon
    fr, fc = fr.to(grid.dtype), fc.to(grid.dtype)
    top = (1 - fc) * grid[..., row, c0] + fc * grid[..., row, c1]
    bottom = (1 - fc) * grid[..., row + 1, c0] + fc * grid[..., row + 1, c1]
    return (1 - fr) * top + fr * bottom


def trajectories(simulation: Simulation, count: int, seed: int, length: int = 1, progress: bool = True) -> Tensor:
    """``count`` simulations ``(count, length + 1, 3, V)`` float32 on the icosphere: the random initial state and
    the states ``dt, 2 dt, ..., length dt`` later."""
    from torch_harmonics.examples import ShallowWaterSolver

    nlat = simulation.nlat
    lmax = math.ceil(nlat / 3)
    solver = ShallowWaterSolver(nlat, 2 * nlat, simulation.solver_dt, lmax=lmax, mmax=lmax).double()
    steps = round(simulation.dt / simulation.solver_dt)
    colatitude = math.pi / 2 - solver.lats.flatten()
    vertices = icosphere(simulation.icosphere_level)
    runs = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in tqdm(range(count), desc=f"simulating (seed {seed})", disable=not progress, leave=False):
            states = [solver.random_initial_condition(mach=simulation.mach)]
            for _ in range(length):
                states.append(solver.timestep(states[-1], steps))
            runs.append(torch.stack([grid_to_icosphere(solver.spec2grid(s), colatitude, vertices) for s in states]))
    return torch.stack(runs).float()


def simulate(simulation: Simulation, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` pairs ``(state at t, state at t + dt)``, each ``(count, 3, V)`` float32 on the icosphere."""
    runs = trajectories(simulation, count, seed)
    return runs[:, 0].contiguous(), runs[:, 1].contiguous()


def load_split(simulation: Simulation, split: str, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """The cached simulations of ``split`` (generated and written atomically the first time)."""
    from safetensors.torch import load_file, save_file

    path = data_dir() / simulation.key(split, count, seed)
    if path.is_file():
        tensors = load_file(path)
        return tensors["inputs"], tensors["targets"]
    inputs, targets = simulate(simulation, count, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    save_file({"inputs": inputs, "targets": targets}, partial, metadata={"simulation": json.dumps(asdict(simulation))})
    partial.replace(path)
    return inputs, targets


@dataclass(frozen=True)
class Normalization:
    """Per-channel statistics of the training inputs; inputs and targets are both mapped by them."""

    mean: list[float]
    std: list[float]

    @classmethod
    def of(cls, inputs: Tensor) -> Normalization:
        values = inputs.double().transpose(0, 1).flatten(1)
        return cls(values.mean(1).tolist(), values.std(1).tolist())

    def __call__(self, fields: Tensor) -> Tensor:
        mean, std = (torch.tensor(v, dtype=fields.dtype)[:, None] for v in (self.mean, self.std))
        return (fields - mean) / std


class FieldPairs(torch.utils.data.Dataset):
    """Normalised ``{"pixel_values": state at t, "labels": state at t + dt}`` pairs."""

    def __init__(self, inputs: Tensor, targets: Tensor, normalization: Normalization) -> None:
        self.inputs, self.targets = normalization(inputs), normalization(targets)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"pixel_values": self.inputs[index], "labels": self.targets[index]}


def model_config(args: argparse.Namespace) -> P.PolarViTSphericalConfig:
    """The spherical config of ``--model`` (the Euclidean models read the same one)."""
    return P.PolarViTSphericalConfig(
        icosphere_level=args.icosphere_level,
        patch_level=args.patch_level,
        num_channels=len(CHANNELS),
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=2 * args.width,
        longitude_encoding=args.longitude_encoding,
        relative_position="none" if args.model == "vit" else "so3",
        position_embedding="learned" if args.model == "vit" else "none",
    )


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A freshly initialised model of ``--model`` (seeded by ``--seed``)."""
    from polar_vit_hf.baselines import euclidean_spherical_dense_vit

    torch.manual_seed(args.seed)
    config = model_config(args)
    if args.model == "polar":
        return P.PolarViTSphericalForDensePrediction(config)
    return euclidean_spherical_dense_vit(config)


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Riemannian AdamW with the paper's parameter groups (Polar-ViT) or AdamW decaying weight matrices only."""
    from polar_vit_hf.optim import RiemannianAdamW, euclidean_param_groups, param_groups

    if args.model == "polar":
        return RiemannianAdamW(param_groups(model, args.weight_decay), lr=args.learning_rate)
    return torch.optim.AdamW(euclidean_param_groups(model, args.weight_decay), lr=args.learning_rate)


def sphere_metrics(level: int):
    """``compute_metrics`` for the Trainer: the l1 and l2 errors (:func:`spherical.sphere_errors`)."""

    def compute(prediction) -> dict[str, float]:
        predicted, target = (torch.as_tensor(v, dtype=torch.float64) for v in prediction)
        l1, l2 = sphere_errors(predicted, target, level)
        return {"l1": float(l1), "l2": float(l2)}

    return compute


class CsvLog(TrainerCallback):
    """Every log line of the Trainer (step, loss, learning rate, evaluation metrics) appended to ``metrics.csv``."""

    FIELDS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "eval_loss", "eval_l1", "eval_l2")

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not any(name in logs for name in self.FIELDS[2:]):
            return  # (the run's summary line holds none of them)
        new = not self.path.is_file()
        with open(self.path, "a", newline="") as handle:
            writer = csv.DictWriter(handle, self.FIELDS, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({"step": state.global_step, **logs})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="polar")
    parser.add_argument("--output_dir", required=True)
    data = parser.add_argument_group("data")
    data.add_argument("--icosphere_level", type=int, default=2, help="icosphere of the fields (2: 162 vertices)")
    data.add_argument("--num_train", type=int, default=512, help="training simulations")
    data.add_argument("--num_eval", type=int, default=64, help="held-out simulations")
    data.add_argument("--data_seed", type=int, default=0, help="seed of the simulations (the same for every model)")
    data.add_argument("--dt", type=float, default=3600.0, help="seconds from input to target")
    model = parser.add_argument_group("model")
    model.add_argument("--patch_level", type=int, default=0, help="patches: faces of this level (0: 60 tokens)")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--width", type=int, default=64)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--longitude_encoding", type=int, default=0, help="Legendre channels of cos(polar angle)")
    train = parser.add_argument_group("training")
    train.add_argument("--max_steps", type=int, default=600)
    train.add_argument("--batch_size", type=int, default=16)
    train.add_argument("--learning_rate", type=float, default=2e-3)
    train.add_argument("--weight_decay", type=float, default=0.01)
    train.add_argument("--warmup_ratio", type=float, default=0.05)
    train.add_argument("--save_steps", type=int, default=200)
    train.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    train.add_argument("--resume_from_checkpoint", nargs="?", const="latest", help="continue from the newest or DIR")
    train.add_argument("--no_progress", action="store_true")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse settings that cannot run, naming the flag."""
    for name in ("num_train", "num_eval", "max_steps", "batch_size", "layers", "width", "heads"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.patch_level <= args.icosphere_level <= 6:
        raise UserError(
            f"need 0 <= --patch_level <= --icosphere_level <= 6, got {args.patch_level} and {args.icosphere_level}"
        )
    if args.width % args.heads or args.width // args.heads < 4:
        raise UserError(f"--width {args.width} must be a multiple of --heads {args.heads}, at least 4 per head")
    if args.dt <= 0 or args.dt % Simulation.solver_dt:
        raise UserError(f"--dt must be a positive multiple of the solver's step {Simulation.solver_dt:g} s")


def resume_point(args: argparse.Namespace, output_dir: Path) -> str | None:
    """The checkpoint to continue from, or ``None`` for a new run (which refuses to overwrite one)."""
    last = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
    if args.resume_from_checkpoint is None:
        if last is not None:
            raise UserError(
                f"{output_dir} holds a run ({Path(last).name}): pass --resume_from_checkpoint to continue it or "
                f"choose another --output_dir"
            )
        return None
    resume = last if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint
    if resume is None or not Path(resume).is_dir():
        raise UserError(f"--resume_from_checkpoint: no checkpoint in {output_dir} ({args.resume_from_checkpoint})")
    return resume


def build(args: argparse.Namespace) -> tuple[Trainer, FieldPairs, Normalization]:
    """The data, the model and the Trainer of a run."""
    simulation = Simulation(icosphere_level=args.icosphere_level, dt=args.dt)
    train_x, train_y = load_split(simulation, "train", args.num_train, 2 * args.data_seed)
    eval_x, eval_y = load_split(simulation, "eval", args.num_eval, 2 * args.data_seed + 1)
    normalization = Normalization.of(train_x)
    model = build_model(args)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=math.ceil(args.warmup_ratio * args.max_steps),
        logging_steps=max(1, min(50, args.max_steps // 20)),
        save_steps=args.save_steps,
        save_total_limit=2,
        eval_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=args.no_progress,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=FieldPairs(train_x, train_y, normalization),
        compute_metrics=sphere_metrics(args.icosphere_level),
        optimizers=(build_optimizer(model, args), None),
        callbacks=[CsvLog(Path(args.output_dir) / "metrics.csv")],
    )
    return trainer, FieldPairs(eval_x, eval_y, normalization), normalization


@dataclass
class Run:
    """A finished run: the trained model, the held-out pairs, the normalisation and the evaluation metrics."""

    model: torch.nn.Module
    held_out: FieldPairs
    normalization: Normalization
    metrics: dict[str, float]


def run(args: argparse.Namespace) -> Run:
    """Train, evaluate on the held-out simulations, save."""
    output_dir = Path(args.output_dir)
    resume = resume_point(args, output_dir)
    trainer, held_out, normalization = build(args)
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate(held_out)
    trainer.save_model()
    trainer.save_metrics("eval", metrics)  # eval_results.json
    (output_dir / "normalization.json").write_text(json.dumps(asdict(normalization), indent=2) + "\n")
    return Run(trainer.model, held_out, normalization, metrics)


@command("shallow_water")
def main(argv: list[str] | None = None) -> int:
    metrics = run(parse_args(argv)).metrics
    print(f"held-out l1 {metrics['eval_l1']:.4f}, l2 {metrics['eval_l2']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
