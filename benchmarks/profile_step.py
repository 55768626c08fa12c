"""Where a training step goes: ``torch.profiler`` tables per operator and per layer kind.

Run:  python benchmarks/profile_step.py [--preset tiny-cifar] [--batch 64] [--image_size 56]
          [--model polar|ambient|euclidean|hypercore|hexformer] [--hypercore DIR] [--hexformer DIR] [--threads N]
          [--top 25] [--device cpu|cuda] [--out outputs/profile_step]

One model (Polar-ViT polar or ambient, transformers' same-shape ViT, or with its checkout one of the public
Lorentz ViTs, ``benchmarks/peers.py``) in train mode; two warm-up steps (the compiled CPU kernels compile in the
first), then one profiled forward + backward.  Prints

* the operators by self CPU time (``key_averages``), the top ``--top``;
* the forward time per layer kind (Polar-FC, attention, gyro norm, residual, position encoding, embeddings,
  head), from ``record_function`` ranges around each module's forward (outermost module of a kind only), and
  the backward in all (the operators whose names mark them as backward nodes);
* the compiled CPU kernels' time per fused layer Function, forward and backward nodes apart;
* without the profiler (whose per-call overhead makes many small eager calls look dear), the wall clock of every
  fused layer Function over ``--wall_steps`` steps, split into its compiled kernels, the Polar-FC's matrix
  products and the rest (eager operations and Python), and the time outside the Functions (:func:`wall_table`);
* with ``--device cuda`` instead of that wall-clock table: the GPU's kernels by self device time, how many
  kernels a step launches and how much of the step's wall clock the GPU is busy (:func:`gpu_table`): a step
  whose GPU is busy for a small share of it is bound by launches and Python, not by arithmetic; and the step's
  host synchronisations by source line (:func:`host_syncs`: each stalls the launches until the GPU is idle, and
  none is allowed while a CUDA graph is captured).

Writes ``operators.csv``, ``layers.csv``, ``kernels.csv``, ``wall.csv``, a Chrome trace (``trace.json``) and
``layers.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import importlib
import os
import pkgutil
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

LAYER_KINDS = {  # module class name -> layer kind
    "PolarFC": "Polar-FC",
    "PolarSelfAttention": "attention (scores, softmax, centroid, projections)",
    "GyroLayerNorm": "gyro layer norm",
    "BoostResidual": "residual",
    "SpaceResidual": "residual",
    "LorentzMidpointResidual": "residual",
    "HoroshiftEncoding": "position encoding",
    "BoostEncoding": "position encoding",
    "RotationEncoding": "position encoding",
    "PolarViTEmbeddings": "embeddings",
    "LorentzMLRHead": "head",
    "PoincareMLRHead": "head",
    "TangentLinearHead": "head",
    "ViTSelfAttention": "attention (scores, softmax, centroid, projections)",
    "ViTSdpaSelfAttention": "attention (scores, softmax, centroid, projections)",
    "Linear": "linear",
    "LayerNorm": "layer norm",
    "ViTEmbeddings": "embeddings",
}


def build(name: str, preset: str, image_size: int | None = None, checkout: str | None = None):
    """The model ``name`` at ``preset``'s shape and its configuration; a peer (``hypercore``, ``hexformer``) from
    its ``checkout``."""
    import polar_vit_hf as P
    from polar_vit_hf.baselines import euclidean_vit
    from polar_vit_hf.benchmarks.peers import PEERS, peer_classifier

    config = P.PolarViTConfig.from_preset(preset, num_labels=100)
    config.image_size = image_size or config.image_size  # the patch grid, so the tokens: long sequences
    if name == "euclidean":
        return euclidean_vit(config), config
    if name in PEERS:
        return peer_classifier(name, Path(str(checkout)), config), config
    config.arithmetic = name
    return P.PolarViTForImageClassification(config), config


def label_modules(model: torch.nn.Module) -> list[Callable[[], None]]:
    """Run every module of a known kind inside a ``record_function`` range named after its kind (its ``forward``
    wrapped on the instance); returns the callables that undo it.  Nested modules of the same kind are counted
    once (the outermost).  Wrapping ``forward`` rather than adding forward hooks leaves what runs unchanged: the
    attention runs its three projections as one stacked Polar-FC only where no hook watches them."""
    undo: list[Callable[[], None]] = []
    depth: dict[str, int] = defaultdict(int)
    for module in model.modules():
        kind = LAYER_KINDS.get(type(module).__name__)
        if kind is None:
            continue

        def labelled(*args: object, kind: str = kind, forward: Callable = module.forward, **kwargs: object) -> object:
            depth[kind] += 1
            try:
                if depth[kind] > 1:
                    return forward(*args, **kwargs)
                with torch.profiler.record_function(f"layer::{kind}"):
                    return forward(*args, **kwargs)
            finally:
                depth[kind] -= 1

        module.forward = labelled
        undo.append(functools.partial(delattr, module, "forward"))
    return undo


def layer_table(events) -> dict[str, float]:
    """Forward milliseconds per layer kind (the ``layer::`` ranges' CPU time, outermost ranges only)."""
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.name.startswith("layer::"):
            totals[event.name[len("layer::") :]] += event.cpu_time_total / 1e3
    return dict(totals)


def kernel_table(events) -> dict[str, tuple[float, int]]:
    """Milliseconds and calls of the compiled kernels (``CompiledFxGraph`` calls) per fused layer Function
    (``FusedPolarAttention``, ``FusedGyroLayerNormBackward``, ...): the innermost enclosing Function node."""
    totals: dict[str, tuple[float, int]] = {}
    for event in events:
        if "CompiledFxGraph" not in event.name:
            continue
        owner = event.cpu_parent
        while owner is not None and not owner.name.startswith(("Fused", "LeadingColumns")):
            owner = owner.cpu_parent
        name = owner.name if owner is not None else "(outside a fused layer)"
        ms, calls = totals.get(name, (0.0, 0))
        totals[name] = (ms + event.cpu_time_total / 1e3, calls + 1)
    return totals


class WallRow(NamedTuple):
    """Wall milliseconds of one fused layer Function per step (``forward`` or its ``Backward``): in all, in its
    compiled kernels, in the Polar-FC's matrix products (``fused_layers.policy_matmul``)."""

    wall: float
    kernels: float
    products: float


def fused_functions(package: ModuleType | None = None) -> list[type[torch.autograd.Function]]:
    """The fused layers' autograd Functions, as the modules of ``package`` (a loaded copy of ``modeling/``; by
    default ``polar_vit_hf.modeling``) define them: in its ``fused_*`` modules and ``cpu_kernels`` (whichever a
    base revision has)."""
    folder = (package or importlib.import_module("polar_vit_hf.modeling")).__path__
    names = sorted(
        info.name for info in pkgutil.iter_modules(folder) if info.name.startswith(("fused_", "cpu_kernels"))
    )
    return [
        value
        for module in (modeling_module(package, name) for name in names)
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, torch.autograd.Function)
        and value.__module__ == module.__name__
        and value is not torch.autograd.Function
    ]


def modeling_module(package: ModuleType | None, name: str) -> ModuleType:
    """The module ``name`` of ``package`` (by default ``polar_vit_hf.modeling``)."""
    return importlib.import_module(f"{package.__name__ if package else 'polar_vit_hf.modeling'}.{name}")


def function_label(name: str, generic: bool, backward: bool, args: tuple) -> str:
    """A row's name: the Function's (``...Backward`` for its backward), and for the generic Functions of
    ``cpu_kernels`` (``LeadingColumnsFunction``: the ambient position encodings) the function they run
    in brackets, read from the call's arguments (``fn`` after ``ctx`` forward, ``ctx.fn`` backward)."""
    if not generic:
        return name
    fn = getattr(args[0], "fn", None) if backward else args[1]
    return f"{name}[{getattr(fn, '__name__', '?')}]"


@contextlib.contextmanager
def timed_functions(totals: dict[str, list[float]], package: ModuleType | None = None) -> Iterator[None]:
    """Inside: every fused Function's ``forward`` and ``backward`` adds its wall seconds to ``totals[name][0]``
    (``name`` the Function, ``name + "Backward"`` its backward), the compiled kernel calls and the Polar-FC products
    it makes to ``[1]`` and ``[2]``.  Perf-counter wrappers only: a few hundred calls per step, no profiler.
    ``package``: the copy of ``modeling/`` whose Functions are timed (:func:`fused_functions`)."""
    cpu_kernels, fused_layers = (modeling_module(package, name) for name in ("cpu_kernels", "fused_layers"))

    running: list[str] = []

    def charge(slot: int, call: Callable, naming: Callable[[tuple], str] | None = None) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            name = naming(args) if naming else None
            owner = name or (running[-1] if running else None)
            if name:
                running.append(name)
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if name:
                    running.pop()
                if owner is not None:
                    totals.setdefault(owner, [0.0, 0.0, 0.0])[slot] += time.perf_counter() - start

        return timed

    patched: list[tuple[object, str, object]] = []

    def patch(owner: object, attribute: str, value: object) -> None:
        patched.append(
            (owner, attribute, vars(owner)[attribute] if isinstance(owner, type) else getattr(owner, attribute))
        )
        setattr(owner, attribute, value)

    for function in fused_functions(package):
        for kind, suffix in (("forward", ""), ("backward", "Backward")):
            method = vars(function)[kind]
            generic = function.__module__ == cpu_kernels.__name__
            naming = functools.partial(function_label, function.__name__ + suffix, generic, bool(suffix))
            patch(function, kind, staticmethod(charge(0, method.__func__, naming)))
    patch(cpu_kernels.PersistentKernel, "__call__", charge(1, cpu_kernels.PersistentKernel.__call__))
    patch(fused_layers, "policy_matmul", charge(2, fused_layers.policy_matmul))
    try:
        yield
    finally:
        for owner, attribute, value in reversed(patched):
            setattr(owner, attribute, value)


def wall_table(step: Callable[[], None], steps: int) -> tuple[float, dict[str, WallRow]]:
    """``(step ms, {Function: WallRow})``, each the median over ``steps`` timed steps."""
    per_step: list[tuple[float, dict[str, list[float]]]] = []
    for _ in range(steps):
        totals: dict[str, list[float]] = {}
        with timed_functions(totals):
            start = time.perf_counter()
            step()
            per_step.append((time.perf_counter() - start, totals))
    names = {name for _, totals in per_step for name in totals}
    median = lambda values: 1e3 * statistics.median(values)  # noqa: E731 - seconds -> ms
    rows = {
        name: WallRow(*(median([totals.get(name, [0.0] * 3)[slot] for _, totals in per_step]) for slot in range(3)))
        for name in names
    }
    return median([seconds for seconds, _ in per_step]), rows


def print_wall_table(step_ms: float, rows: dict[str, WallRow], steps: int) -> None:
    """The :func:`wall_table` as text: Functions by wall time, then what lies outside them."""
    print(f"\nwall clock without the profiler, median of {steps} steps: {step_ms:.0f} ms per step")
    width = max([36, *(len(name) for name in rows)])
    print(f"{'fused layer Function':<{width}} {'wall ms':>9} {'kernels':>9} {'products':>9} {'rest':>9}")
    for name, row in sorted(rows.items(), key=lambda item: -item[1].wall):
        rest = row.wall - row.kernels - row.products
        print(f"{name:<{width}} {row.wall:>9.1f} {row.kernels:>9.1f} {row.products:>9.1f} {rest:>9.1f}")
    inside = sum(row.wall for row in rows.values())
    print(f"{'outside the fused Functions':<{width}} {step_ms - inside:>9.1f}")


def gpu_table(averages, step_ms: float, top: int) -> None:
    """The GPU side of a profiled step (``key_averages`` with CUDA activity): kernels by self device time, the
    kernels launched, and the device's busy time against the step's unprofiled wall clock ``step_ms``."""
    from torch.autograd import DeviceType

    kernels = [e for e in averages if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    launched = sum(e.count for e in kernels)
    print(
        f"\nGPU: {launched} kernels launched, busy {busy_ms:.1f} ms of a {step_ms:.1f} ms step "
        f"({busy_ms / step_ms:.0%}; the rest is launches, Python and waiting)"
    )
    print(f"{'GPU kernel':<72} {'device ms':>9} {'calls':>7}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.key[:72]:<72} {e.self_device_time_total / 1e3:>9.2f} {e.count:>7}")


def host_syncs(step: Callable[[], None]) -> Counter[str]:
    """Where one ``step`` makes the host wait for the GPU: ``torch.cuda.set_sync_debug_mode("warn")`` warns at
    each synchronising operation (``.item()``, ``bool`` of a tensor, ``nonzero``, copies to the host), counted
    by the warning's source line."""
    import warnings

    sources: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            sources[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return sources


def main(argv: list[str] | None = None) -> int:
    from polar_vit_hf.benchmarks.peers import PEERS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-cifar")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--image_size", type=int, help="images of this size instead of the preset's (more patches: longer sequences)"
    )
    parser.add_argument("--model", choices=("polar", "ambient", "euclidean", *PEERS), default="polar")
    parser.add_argument("--hypercore", help="a checkout of github.com/Graph-and-Geometric-Learning/HyperCore")
    parser.add_argument("--hexformer", help="a checkout of github.com/HayaAlyoussef/HexFormer")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--wall_steps", type=int, default=5, help="steps of the wall-clock table (0: none)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path("outputs/profile_step"))
    args = parser.parse_args(argv)
    if args.model in PEERS and not getattr(args, args.model):
        print(f"--model {args.model} needs --{args.model} DIR (a checkout of the peer's repository)", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, config = build(args.model, args.preset, args.image_size, getattr(args, args.model, None))
    model.to(device).train()
    pixels = torch.randn(args.batch, config.num_channels, config.image_size, config.image_size, device=device)
    labels = torch.randint(0, 100, (args.batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        model(pixel_values=pixels, labels=labels).loss.backward()
        model.zero_grad(set_to_none=True)
        sync()

    for _ in range(2):
        step()
    start = time.perf_counter()
    step()
    plain_s = time.perf_counter() - start
    undo = label_modules(model)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    with profile(activities=activities) as prof:
        step()
    for restore in undo:
        restore()
    args.out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.out / "trace.json"))
    averages = prof.key_averages()
    total_ms = sum(e.self_cpu_time_total for e in averages) / 1e3
    rows = sorted(
        ((e.key, e.self_cpu_time_total / 1e3, e.count) for e in averages if not e.key.startswith("layer::")),
        key=lambda row: -row[1],
    )
    where = torch.backends.cpu.get_cpu_capability()
    on = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(
        f"\n{args.model}, {args.preset}, batch {args.batch}, forward + backward, {args.threads} CPU threads "
        f"({where}{on}): "
        f"{plain_s * 1e3:.0f} ms unprofiled, {total_ms:.0f} ms of operator self time profiled"
    )
    print(f"{'operator':<48} {'self ms':>9} {'share':>7} {'calls':>7}")
    for key, ms, count in rows[: args.top]:
        print(f"{key[:48]:<48} {ms:>9.1f} {ms / total_ms:>6.1%} {count:>7}")
    layers = layer_table(prof.events())
    print(f"\n{'layer kind (forward only)':<52} {'ms':>9} {'share of step':>14}")
    for kind, ms in sorted(layers.items(), key=lambda item: -item[1]):
        print(f"{kind:<52} {ms:>9.1f} {ms / total_ms:>13.1%}")
    backward_ms = sum(e.self_cpu_time_total for e in averages if "Backward" in e.key or "backward" in e.key) / 1e3
    print(f"{'backward nodes (operators named *Backward*)':<52} {backward_ms:>9.1f} {backward_ms / total_ms:>13.1%}")
    kernels = kernel_table(prof.events())
    if kernels:
        print(f"\n{'compiled kernels, by fused layer (forward and backward)':<52} {'ms':>9} {'calls':>7}")
        for name, (ms, calls) in sorted(kernels.items(), key=lambda item: -item[1][0]):
            print(f"{name[:52]:<52} {ms:>9.1f} {calls:>7}")
    with open(args.out / "operators.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["operator", "self_ms", "calls"])
        writer.writerows(rows)
    with open(args.out / "layers.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["layer_kind", "forward_ms"])
        writer.writerows(sorted(layers.items(), key=lambda item: -item[1]))
    with open(args.out / "kernels.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["fused_layer", "kernel_ms", "calls"])
        writer.writerows((name, ms, calls) for name, (ms, calls) in kernels.items())
    if device.type == "cuda":
        gpu_table(averages, plain_s * 1e3, args.top)
        syncs = host_syncs(step)
        print(f"\nhost synchronisations per step: {sum(syncs.values())}")
        for source, count in syncs.most_common(args.top):
            print(f"{source:<60} {count:>7}")
    wall_csv = ""
    if args.wall_steps > 0 and args.model in ("polar", "ambient") and device.type == "cpu":
        wall_csv = " wall.csv,"
        step_ms, wall = wall_table(step, args.wall_steps)
        print_wall_table(step_ms, wall, args.wall_steps)
        with open(args.out / "wall.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["function", "wall_ms", "kernel_ms", "product_ms"])
            writer.writerows((name, *row) for name, row in sorted(wall.items()))
    plot(layers, args.out / "layers.png", f"{args.model} forward, batch {args.batch}")
    print(f"wrote {args.out}/operators.csv, layers.csv, kernels.csv,{wall_csv} trace.json, layers.png")
    return 0


def plot(layers: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = sorted(layers.items(), key=lambda item: item[1])
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(items) + 1.2))
    ax.barh([kind for kind, _ in items], [ms for _, ms in items])
    ax.set_xlabel("ms")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
