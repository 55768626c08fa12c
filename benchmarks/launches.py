"""What a training step launches, counted where no GPU is: operator calls, host synchronisations, graph breaks.

Run:  python benchmarks/launches.py [--preset tiny-cifar] [--batch 64] [--models euclidean polar ambient]
          [--compiled] [--out outputs/launches]

On a GPU every eager ATen operator call is a kernel launch (plus the Python around it), every
``aten::_local_scalar_dense`` (``.item()``, ``bool`` of a tensor, ``nonzero``) makes the host wait until the GPU
is idle, and every graph break splits a ``torch.compile`` region.  All three are properties of the code, not of
the device, so they are counted here on the CPU, for Polar-ViT and transformers' same-shape ViT:

* **eager operator calls** of one forward + backward (``TorchDispatchMode``; views and allocations, which launch
  nothing, not counted), with the fused layers' compiled CPU kernels off (what a CUDA device runs eagerly) and,
  for Polar-ViT, on (the CPU's default: a compiled kernel's own loops are not operator calls, the matrix products
  it calls are);
* **per layer and outside the layers**: the step at ``L`` and at ``L + 1`` encoder layers, their difference;
* **host synchronisations** of the step (the same dispatch mode counts ``_local_scalar_dense``);
* **graph breaks** of ``torch._dynamo.explain`` over the step (tracing only, no compile), with the kernels on;
* with ``--compiled``: the **kernels of the compiled step** (``torch.compile`` of the model, inductor's C++ kernels
  and the external matrix products they call, counted in the generated code; minutes per model on 2 cores).

Prints a table of the counts with the ViT's ratio and writes ``launches.csv`` and ``launches.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_LAUNCHES = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh"}
SYNC = torch.ops.aten._local_scalar_dense.default
KERNEL_SETTINGS = {False: "eager, CPU kernels off", True: "eager, CPU kernels on"}
KERNEL_CALL = re.compile(r"^\s+(cpp_fused_\w+|extern_kernels\.\w+|triton_\w+\.run)\(", re.MULTILINE)


class Counts(NamedTuple):
    """One step's eager operator calls (views and allocations excepted) and host synchronisations."""

    operators: int
    syncs: int


class OperatorCounter(TorchDispatchMode):
    """Counts the ATen calls that would launch a kernel on a GPU, and the host synchronisations among them."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func is SYNC:
            self.syncs += 1
        elif not func.is_view and func.overloadpacket.__name__ not in NOT_LAUNCHES:
            self.operators += 1
        return func(*args, **(kwargs or {}))


def training_step(name: str, preset: str, layers: int, batch: int) -> Callable[[], torch.Tensor]:
    """One forward + backward of model ``name`` (``euclidean``: transformers' ViT of the same shape) with
    ``layers`` encoder layers on a fixed random batch."""
    import polar_vit_hf as P
    from polar_vit_hf.baselines import euclidean_vit

    arithmetic = {} if name == "euclidean" else {"arithmetic": name}
    config = P.PolarViTConfig.from_preset(preset, num_labels=100, num_hidden_layers=layers, **arithmetic)
    model = (euclidean_vit(config) if name == "euclidean" else P.PolarViTForImageClassification(config)).train()
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, config.num_channels, config.image_size, config.image_size, generator=generator)
    labels = torch.randint(0, config.num_labels, (batch,), generator=generator)

    def forward() -> torch.Tensor:
        return model(pixel_values=pixels, labels=labels).loss

    def step() -> torch.Tensor:
        loss = forward()
        loss.backward()
        return loss.detach()

    step.model, step.forward = model, forward  # type: ignore[attr-defined]
    return step


def eager_counts(step: Callable[[], torch.Tensor]) -> Counts:
    """The operator calls and host synchronisations of one ``step`` after two warm-up steps (compiled kernels
    compile or load in the first ones, and a compile's tracing would be counted)."""
    step()
    step()
    with OperatorCounter() as counter:
        step()
    return Counts(counter.operators, counter.syncs)


def graph_breaks(step: Callable[[], torch.Tensor]) -> int:
    """``torch._dynamo.explain``'s graph breaks over one step's forward and loss (tracing only; the backward is
    traced with the forward graph when compiled, so ``loss.backward()`` itself is left out)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step.forward)()  # type: ignore[attr-defined]
    torch._dynamo.reset()
    return explanation.graph_break_count


def compiled_kernels(step: Callable[[], torch.Tensor]) -> Counts:
    """The kernel calls in the code inductor generates for one step of the compiled model (forward and backward
    graphs): its fused C++ (or Triton) kernels and the external matrix products."""
    from torch._inductor.utils import run_and_get_code

    model = step.model  # type: ignore[attr-defined]
    model.compile()  # in place: the step's calls of the model run the compiled forward
    try:
        _, sources = run_and_get_code(step)
    finally:
        torch._dynamo.reset()
    return Counts(sum(len(KERNEL_CALL.findall(source)) for source in sources), 0)


class Row(NamedTuple):
    """One model and setting: per layer, outside the layers, the whole step."""

    model: str
    setting: str
    per_layer: int
    outside: int
    step: int
    syncs: int


def count_in_process(what: str, name: str, kernels: bool, preset: str, layers: int, batch: int) -> Counts:
    """``what`` (``eager``, ``compiled``, ``breaks``) of one step, in a fresh process whose kernels are on or off
    from its start (``POLAR_VIT_CPU_KERNELS``, which ``torch.compile`` traces with), so that no compiled variant,
    dynamo cache or recompile limit of another model changes the count."""
    env = {**os.environ, "POLAR_VIT_CPU_KERNELS": "1" if kernels else "0"}
    command = [sys.executable, "-m", "polar_vit_hf.benchmarks.launches", "--child", what, name, preset]
    result = subprocess.run([*command, str(layers), str(batch)], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"counting {what} of {name} failed:\n{result.stderr[-3000:]}")
    return Counts(*json.loads(result.stdout.strip().splitlines()[-1]))


def measure(what: str, name: str, setting: str, kernels: bool, preset: str, layers: int, batch: int) -> Row:
    """``what`` of the step at ``layers`` and ``layers + 1`` encoder layers, split into per layer and outside."""
    first, second = (count_in_process(what, name, kernels, preset, n, batch) for n in (layers, layers + 1))
    per_layer = second.operators - first.operators
    return Row(name, setting, per_layer, first.operators - layers * per_layer, first.operators, first.syncs)


def child(what: str, name: str, preset: str, layers: int, batch: int) -> int:
    """The child process of :func:`count_in_process`: prints its counts as one JSON line."""
    torch.set_num_threads(2)
    step = training_step(name, preset, layers, batch)
    counts = (
        Counts(graph_breaks(step), 0)
        if what == "breaks"
        else {"eager": eager_counts, "compiled": compiled_kernels}[what](step)
    )
    print(json.dumps(list(counts)))
    return 0


def print_table(rows: list[Row]) -> None:
    """The counts, and each per-layer count over the ViT's in the same kind of step (eager or compiled)."""
    references = {row.setting.startswith("compiled"): row for row in rows if row.model == "euclidean"}
    print(f"\n{'model':<10} {'setting':<34} {'per layer':>10} {'x ViT':>7} {'outside':>8} {'step':>7} {'syncs':>6}")
    for row in rows:
        reference = references.get(row.setting.startswith("compiled"))
        ratio = f"{row.per_layer / reference.per_layer:.1f}" if reference and reference.per_layer else "-"
        print(
            f"{row.model:<10} {row.setting:<34} {row.per_layer:>10} {ratio:>7} {row.outside:>8} {row.step:>7} "
            f"{row.syncs:>6}"
        )


def plot(rows: list[Row], path: Path) -> None:
    """Per-layer counts as horizontal bars, log scale."""
    import matplotlib.pyplot as plt

    labels = [f"{row.model}: {row.setting}" for row in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    ax.barh(labels, [max(row.per_layer, 1) for row in rows], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("operator calls or kernels per encoder layer (forward + backward)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-cifar")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1, help="encoder layers of the smaller model (default 1)")
    parser.add_argument(
        "--models", nargs="+", default=["euclidean", "polar"], choices=["euclidean", "polar", "ambient"]
    )
    parser.add_argument(
        "--kernels",
        choices=["off", "on", "both"],
        default="both",
        help="Polar-ViT's compiled CPU kernels (default both)",
    )
    parser.add_argument("--compiled", action="store_true", help="also count the compiled step's kernels (slow)")
    parser.add_argument("--out", type=Path, default=Path("outputs/launches"))
    parser.add_argument(
        "--child", nargs=5, metavar=("WHAT", "MODEL", "PRESET", "LAYERS", "BATCH"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        what, name, preset, layers, batch = args.child
        return child(what, name, preset, int(layers), int(batch))
    if args.batch < 1 or args.layers < 1:
        parser.error("--batch and --layers must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, {args.preset}, "
        f"batch {args.batch}, {args.layers} and {args.layers + 1} layers",
        flush=True,
    )
    rows: list[Row] = []
    breaks: dict[str, int] = {}
    states = {"off": [False], "on": [True], "both": [False, True]}[args.kernels]
    for name in args.models:
        settings = [("eager", False)] if name == "euclidean" else [(KERNEL_SETTINGS[on], on) for on in states]
        for setting, kernels in settings:
            print(f"  {name}: {setting} ...", flush=True)
            rows.append(measure("eager", name, setting, kernels, args.preset, args.layers, args.batch))
        kernels = name != "euclidean" and states[-1]
        breaks[name] = count_in_process("breaks", name, kernels, args.preset, args.layers, args.batch).operators
        if args.compiled:
            print(f"  {name}: compiled (torch.compile of the model) ...", flush=True)
            setting = "compiled: inductor kernels"
            rows.append(measure("compiled", name, setting, False, args.preset, args.layers, args.batch))
    print_table(rows)
    print(
        "\ngraph breaks of the forward and loss (torch._dynamo.explain; kernels as in the last setting):",
        ", ".join(f"{name} {count}" for name, count in breaks.items()),
    )
    with open(args.out / "launches.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*Row._fields, "graph_breaks"])
        writer.writerows([*row, breaks.get(row.model, "")] for row in rows)
    plot(rows, args.out / "launches.png")
    print(f"\nwrote {args.out / 'launches.csv'} and {args.out / 'launches.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
