"""Forward + backward time and peak memory per training step: Euclidean ViT vs ambient vs polar Polar-ViT.

Run:  python benchmarks/step_time.py [--preset tiny-cifar] [--image_size 128] [--batch 128 ...] [--repeats 5]
          [--compile] [--device cuda] [--cuda-graph]
          [--models euclidean ambient ambient-reference polar-reference polar polar-chunked] [--interleave]
          [--autocast bf16] [--inference [--models ... polar-warm polar-onnx]]
          [--models ... hypercore hexformer --hypercore DIR --hexformer DIR] [--base REV]

Models: transformers' Euclidean ViT, Polar-ViT in ambient arithmetic (fused layers, ``FusedAmbientOps``; with
the reference layers, ``ambient-reference``), Polar-ViT in polar arithmetic
with the reference layers (``fused_ops=False``: geometry functions differentiated by autograd, eager
attention), with the fused layers (``fused_ops=True``, the default: ``FusedPolarOps``, with its
compiled CPU kernels), fused without the compiled kernels (``polar-eager``), fused with the chunked
attention core, and the default polar / ambient models under ``torch.compile(model)`` (``polar-compiled``,
``ambient-compiled``, ``euclidean-compiled``: side by side with eager in one run; ``--compile`` compiles every
model) or with each repeated block compiled in place as the training scripts' ``--compile`` does
(``polar-regional``, ``euclidean-regional``); with checkouts
of the public Lorentz ViTs, HyperCore's ``LViT`` and HexFormer at the same shape (``benchmarks/peers.py``).

Each model runs in its own subprocess (peak memory: the peak growth of the resident set over the first training
step, from the kernel's peak mark reset before it, which includes the code and compiled kernels that step loads; peak
tensors: the most bytes of tensors alive at once during a later step, from the profiler's allocation events, as
CUDA's ``max_memory_allocated`` counts them; saved bytes: the distinct non-parameter tensors
autograd keeps for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``); times are
the median of ``--repeats`` steps after ``--warmup`` steps; ratios are taken within this one run
(``--interleave``: all models stay alive and step in turns, and the time ratios are the medians of the
per-round ratios, robust to the machine's speed drifting during the run); several ``--batch`` sizes are timed one
after another, each in fresh processes, with a table each.  The
Euclidean model is
transformers' ``ViTForImageClassification`` with the same depth, width, MLP width, heads and patch
size.  ``--autocast bf16`` runs every model's step under ``torch.autocast`` (Polar-ViT: the mixed-precision policy,
Polar-FC products in bf16; the ViT: every linear layer in bf16).  ``--inference`` times eval-mode forward passes
under ``torch.no_grad`` (how pipelines and ``Trainer.evaluate`` run a model) instead of training steps, with two
more models: ``polar-warm``, the default model after its documented warm-up (``model.compile_cpu_kernels()``, done
before the first timed call: the "first call" column is then a server's first request), and ``polar-onnx``, the
model exported to ONNX (``polar_vit_hf.deploy.export_onnx``, kept in ``--out`` per source digest) run by ONNX
Runtime with ``--threads`` threads.
``--base REV`` (a git revision or a source tree) times every Polar-ViT model of ``--models`` a second time from that
source (a temporary ``git worktree``), in the same run: with ``--interleave`` each model and its ``REV`` twin step
in turns, and the change's effect is the median of the per-round ratios (run ``--base HEAD`` to see the
benchmark's own spread).  Writes ``step_time.csv`` and ``step_time.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from polar_vit_hf.benchmarks._memory import MemoryGrowth

MODELS = (
    "euclidean",
    "ambient",
    "ambient-reference",
    "polar-reference",
    "polar",
    "polar-eager",
    "polar-chunked",
    "polar-compiled",
    "ambient-compiled",
    "euclidean-compiled",
    "polar-regional",
    "euclidean-regional",
    "polar-warm",
    "polar-onnx",
    "hypercore",
    "hexformer",
)
LABELS = {
    "euclidean": "Euclidean ViT (transformers)",
    "ambient": "Polar-ViT, ambient arithmetic",
    "ambient-reference": "Polar-ViT, ambient, reference layers",
    "polar-reference": "Polar-ViT, polar, reference layers",
    "polar": "Polar-ViT, polar, fused (default)",
    "polar-eager": "Polar-ViT, fused, no compiled kernels",
    "polar-chunked": "Polar-ViT, polar, fused + chunked attn",
    "polar-compiled": "Polar-ViT, polar, torch.compile(model)",
    "ambient-compiled": "Polar-ViT, ambient, torch.compile(model)",
    "euclidean-compiled": "Euclidean ViT, torch.compile(model)",
    "polar-regional": "Polar-ViT, polar, compiled blocks",
    "euclidean-regional": "Euclidean ViT, compiled blocks",
    "polar-warm": "Polar-ViT, after compile_cpu_kernels()",
    "polar-onnx": "Polar-ViT, ONNX Runtime",
    "hypercore": "HyperCore LViT (ambient Lorentz)",
    "hexformer": "HexFormer (Lorentz ViT)",
}


PEERS = ("hypercore", "hexformer")  # the public Lorentz ViTs (benchmarks/peers.py): never timed from --base
BASE = "@base"  # suffix of a model timed from the --base source tree
INFERENCE_ONLY = ("polar-warm", "polar-onnx")  # models timed with --inference only
CSV_FIELDS = ("params", "tokens", "median_s", "peak_growth_mib", "peak_tensor_mib", "saved_mib", "first_step_s")
PACKAGE_FOLDERS = ("modeling", "training", "conversion", "benchmarks")  # mapped into polar_vit_hf (setup.cfg)


def label(name: str, args: argparse.Namespace) -> str:
    """The table's name of ``name`` (a model of :data:`MODELS`, or one with the :data:`BASE` suffix)."""
    model = name.removesuffix(BASE)
    return LABELS[model] + (f" @ {args.base}" if name.endswith(BASE) else "")


def register_package(name: str, folder: Path) -> tuple:
    """``(spec, module)`` of the package folder ``folder`` under the module name ``name``, entered in
    ``sys.modules`` (its relative imports then resolve there) but not executed yet."""
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None or not (folder / "__init__.py").is_file():
        raise FileNotFoundError(f"{folder} is not a package folder of a polar-vit-hf source tree")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    return spec, module


def import_package_from(tree: Path) -> None:
    """Make ``import polar_vit_hf`` load the package of the source tree ``tree`` (its ``polar_vit_hf/`` with
    ``modeling/``, ``training/``, ``conversion/`` and ``benchmarks/`` mapped in, as ``setup.cfg`` does), whatever
    copy is installed: called before the first import."""
    for finder in list(sys.meta_path):  # an editable install's finder would answer first
        if "editable" in f"{type(finder).__module__}.{type(finder).__name__}".lower():
            sys.meta_path.remove(finder)

    package_spec, package = register_package("polar_vit_hf", tree / "polar_vit_hf")
    for folder in PACKAGE_FOLDERS:
        spec, module = register_package(f"polar_vit_hf.{folder}", tree / folder)
        spec.loader.exec_module(module)
        setattr(package, folder, module)
    package_spec.loader.exec_module(package)


@contextlib.contextmanager
def source_tree(base: str) -> Iterator[Path]:
    """The source tree of ``base``: a folder as it is, or a git revision of the current repository checked out
    into a temporary ``git worktree`` (removed afterwards)."""
    if Path(base, "modeling").is_dir():
        yield Path(base).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="polar-vit-base-") as parent:
        tree = Path(parent) / "tree"
        added = subprocess.run(["git", "worktree", "add", "--detach", str(tree), base], capture_output=True, text=True)
        if added.returncode != 0:
            reason = (added.stderr.strip().splitlines() or ["git failed"])[-1][:60]
            raise ValueError(
                f"--base {base}: not a source tree (a folder with modeling/) nor a git revision; {reason}"
            )
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], capture_output=True)


def worker(args: argparse.Namespace) -> None:
    """Time one model; prints a JSON line."""
    if args.source:
        import_package_from(Path(args.source))
    import torch

    import polar_vit_hf as P
    from polar_vit_hf.baselines import euclidean_vit
    from polar_vit_hf.modeling.runtime import set_runtime_options

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    args.batch = args.batches[0]
    config = P.PolarViTConfig.from_preset(args.preset, num_labels=100)
    config.image_size = args.image_size or config.image_size  # the patch grid, so the tokens: long sequences
    name = args.model.removesuffix("-compiled").removesuffix("-regional").removesuffix("-warm").removesuffix("-onnx")
    if name == "euclidean":
        model = euclidean_vit(config)
    elif args.model in PEERS:
        from polar_vit_hf.benchmarks.peers import peer_classifier

        model = peer_classifier(args.model, Path(getattr(args, args.model)), config)
    else:
        config.arithmetic = name.split("-")[0]
        config.fused_ops = not name.endswith("-reference")
        if name == "polar-chunked":
            config.polar_attn_implementation = "chunked"
        model = P.PolarViTForImageClassification(config)
        P.geometry.set_input_checks(False)  # training loops validate inputs once, not per operation
        if name == "polar-eager":
            set_runtime_options(cpu_kernels=False, gpu_kernels=False)
    device = torch.device(args.device)
    model.to(device).train(not args.inference)
    pixels = torch.randn(args.batch, config.num_channels, config.image_size, config.image_size, device=device)
    labels = torch.randint(0, 100, (args.batch,), device=device)
    step_fn = torch.compile(model) if args.compile or args.model.endswith("-compiled") else model
    if args.model == "polar-warm":  # the documented warm-up of a server, before its first request
        model.compile_cpu_kernels()
    if args.model == "polar-onnx":
        step_fn = onnx_session(model, Path(args.out), args.threads)
    if args.model.endswith("-regional"):  # the training scripts' --compile: each repeated block compiled in place
        from polar_vit_hf.training.compilation import compile_regions

        compile_regions(model, log=lambda _: None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)

    def step() -> None:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            if args.inference:  # how pipelines and Trainer's evaluation run a model
                with torch.no_grad():
                    step_fn(pixel_values=pixels)
                sync()
                return
            loss = step_fn(pixel_values=pixels, labels=labels).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync()

    compile_start = time.perf_counter()
    with peak_memory_growth(device) as growth:  # the first (cold) step: every buffer is allocated once
        step()
    first_step_s = time.perf_counter() - compile_start
    saved = 0 if args.inference else saved_bytes(model, lambda: step_fn(pixel_values=pixels, labels=labels).loss)
    with tensor_memory_growth(device) as tensors:  # a warm step: the tensors alone, not the code the first loaded
        step()
    for _ in range(args.warmup - 1):
        step()
    if args.cuda_graph:
        step = graphed_step(model, step_fn, pixels, labels, args.inference)
    if args.serve:  # interleaved: per line read from stdin, --round_warmup untimed steps and one timed, until EOF
        print(json.dumps({"ready": True}), flush=True)
        for _ in sys.stdin:
            for _ in range(args.round_warmup):  # the process sat idle while the others stepped: caches are cold
                step()
            start = time.perf_counter()
            step()
            print(json.dumps({"step_s": time.perf_counter() - start}), flush=True)
        times = [0.0]
    else:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "model": args.model,
                "median_s": statistics.median(times),
                "times": times,
                "peak_growth_mib": growth.mib,
                "peak_tensor_mib": tensors.mib,
                "saved_mib": saved / 2**20,
                "params": sum(p.numel() for p in model.parameters()),
                "tokens": config.num_patches,  # patches per image, the same grid for every model
                "first_step_s": first_step_s,
                "source": str(Path(P.modeling.__file__).resolve().parent.parent),
            }
        )
    )


def onnx_session(model, out: Path, threads: int) -> Callable:
    """``model`` exported to ONNX once per preset and source (``out/onnx/``), as a function of ``pixel_values``
    run by an ONNX Runtime session with ``threads`` threads."""
    import onnxruntime as ort

    from polar_vit_hf.deploy import ONNX_INPUT, export_onnx
    from polar_vit_hf.modeling.cpu_kernels import source_digest

    config = model.config
    path = out / "onnx" / f"{config.num_hidden_layers}x{config.hidden_size}-{config.image_size}-{source_digest()}.onnx"
    if not path.exists():
        export_onnx(model, path.with_suffix(".partial.onnx")).rename(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda pixel_values, **_: session.run(None, {ONNX_INPUT: pixel_values.numpy()})


def graphed_step(
    model: torch.nn.Module, step_fn: Callable, pixels: torch.Tensor, labels: torch.Tensor, inference: bool
) -> Callable[[], None]:
    """The step captured once as a CUDA graph (``--cuda-graph``; after the warm-up steps, which compiled or loaded
    every kernel): each call replays its launches without Python or the dispatcher.  Three more steps run on a
    side stream first, as capture needs; the gradients are captured into fresh ``.grad`` tensors, overwritten by
    each replay."""

    def body() -> None:
        model.zero_grad(set_to_none=True)  # (in the capture too: backward then captures fresh .grad tensors)
        if inference:
            with torch.no_grad():
                step_fn(pixel_values=pixels)
        else:
            step_fn(pixel_values=pixels, labels=labels).loss.backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()

    def replay() -> None:
        graph.replay()
        torch.cuda.synchronize()

    return replay


def measurement() -> types.ModuleType:
    """``_memory.py`` beside this file: the measuring tree's memory helpers, also in a worker whose ``--source``
    maps ``polar_vit_hf`` to another tree (a ``--base`` revision may predate them)."""
    if "_step_time_memory" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_step_time_memory", Path(__file__).with_name("_memory.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["_step_time_memory"] = module  # before running it: its dataclass looks its module up
        spec.loader.exec_module(module)
    return sys.modules["_step_time_memory"]


def peak_memory_growth(device: torch.device) -> contextlib.AbstractContextManager[MemoryGrowth]:
    """Peak memory of the block: resident-set growth on the CPU, ``max_memory_allocated`` growth on CUDA."""
    return measurement().peak_rss_growth() if device.type != "cuda" else cuda_allocated_growth(device)


def tensor_memory_growth(device: torch.device) -> contextlib.AbstractContextManager[MemoryGrowth]:
    """Peak tensor memory of the block: the live bytes of tensors allocated in it (``_memory.peak_tensor_growth``)
    on the CPU, ``max_memory_allocated`` growth on CUDA."""
    return measurement().peak_tensor_growth() if device.type != "cuda" else cuda_allocated_growth(device)


@contextlib.contextmanager
def cuda_allocated_growth(device: torch.device) -> Iterator[MemoryGrowth]:
    """``max_memory_allocated`` growth of the block on a CUDA ``device`` (a ``_memory.MemoryGrowth``)."""
    import torch

    result = measurement().MemoryGrowth()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield result
    torch.cuda.synchronize(device)
    result.mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20


def saved_bytes(model, forward) -> int:
    """Bytes of the distinct tensors (parameters excluded) autograd saves for backward during ``forward()``."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def parser() -> argparse.ArgumentParser:
    """The command line (shared with ``benchmarks/peers.py``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-cifar")
    parser.add_argument(
        "--image_size", type=int, help="images of this size instead of the preset's (more patches: longer sequences)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[128], dest="batches", help="one table per size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (at least 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--compile", action="store_true", help="torch.compile every model (long compile on CPU)")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="with --device cuda: time replays of each model's step captured as a CUDA graph after the warm-up",
    )
    parser.add_argument(
        "--inference", action="store_true", help="time eval-mode forward passes under torch.no_grad instead"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: times with synchronisation, peak memory from max_memory_allocated",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS[:6]),
        help="which models to time (ratios need euclidean / ambient among them; hypercore / hexformer need "
        "--hypercore / --hexformer)",
    )
    parser.add_argument("--hypercore", help="a checkout of github.com/Graph-and-Geometric-Learning/HyperCore")
    parser.add_argument("--hexformer", help="a checkout of github.com/HayaAlyoussef/HexFormer")
    parser.add_argument(
        "--autocast",
        choices=("none", "bf16", "fp16"),
        default="none",
        help="run each step under torch.autocast in this dtype (the mixed-precision policy)",
    )
    parser.add_argument("--out", default="outputs/step_time")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="keep every model's process alive and time their steps in turns (round robin), so a "
        "change in the machine's speed during the run hits every model alike; the ratios are "
        "the medians of the per-round ratios (all models resident at once: mind the memory)",
    )
    parser.add_argument(
        "--round_warmup",
        type=int,
        default=1,
        help="with --interleave: untimed steps each model takes before its timed step of a round "
        "(a process that sat idle while the others stepped starts with cold caches and, on "
        "this VM, memory the kernel reclaimed; a training loop never idles between steps)",
    )
    parser.add_argument(
        "--base",
        help="a git revision (or a source tree): time every Polar-ViT model of --models from it too, in the same "
        "run, and print each one's time over its twin's (the effect of a change; --base HEAD shows the spread)",
    )
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)  # the worker's source tree (the --base twins)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cuda_graph and args.device != "cuda":
        print("--cuda-graph needs --device cuda", file=sys.stderr)
        return 2
    if args.model:
        worker(args)
        return 0
    for name in args.models:
        if name in PEERS and not getattr(args, name):
            print(f"--models {name} needs --{name} DIR (a checkout of the peer's repository)", file=sys.stderr)
            return 2
        if name in INFERENCE_ONLY and not args.inference:
            print(f"--models {name} is an inference model: add --inference", file=sys.stderr)
            return 2
    tables = {}
    for batch in args.batches:
        args.batch = batch
        if args.base:
            try:
                with source_tree(args.base) as tree:
                    args.source_tree = tree
                    results = measure(args)
            except ValueError as error:
                print(error, file=sys.stderr)
                return 2
        else:
            results = measure(args)
        if results is None:
            return 1
        report(results, args)
        tables[batch] = results
    write_tables(tables, args)
    return 0


def write_tables(tables: dict[int, dict], args: argparse.Namespace) -> None:
    """``step_time.csv`` (a row per batch size and model) and a plot per batch size (``step_time.png``, or
    ``step_time_b<N>.png`` for several sizes)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "step_time.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["batch", "model", *CSV_FIELDS])
        for batch, results in tables.items():
            for name in results:
                writer.writerow([batch, name, *(results[name][key] for key in CSV_FIELDS)])
    for batch, results in tables.items():
        args.batch = batch
        path = out / ("step_time.png" if len(tables) == 1 else f"step_time_b{batch}.png")
        plot(results, {name: label(name, args) for name in results}, path, args)
        print(f"wrote {path}")
    print(f"wrote {out / 'step_time.csv'}")


def timed_models(args: argparse.Namespace) -> list[str]:
    """``--models``, each Polar-ViT model followed by its ``--base`` twin."""
    twins = lambda name: [name, name + BASE] if args.base and name not in ("euclidean", *PEERS) else [name]  # noqa: E731
    return [timed for name in args.models for timed in twins(name)]


def worker_command(args: argparse.Namespace, name: str) -> list[str]:
    """The command line of the subprocess that times ``name`` (a ``--base`` twin: from the base source tree)."""
    model, batch = name.removesuffix(BASE), getattr(args, "batch", args.batches[0])
    line = [sys.executable, __file__, "--model", model, "--preset", args.preset, "--batch", str(batch)]
    line += ["--image_size", str(args.image_size)] if args.image_size else []
    line += ["--source", str(args.source_tree)] if name.endswith(BASE) else []
    line += ["--repeats", str(args.repeats), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    line += ["--device", args.device, "--round_warmup", str(args.round_warmup), "--autocast", args.autocast]
    line += [f"--{peer}={getattr(args, peer)}" for peer in PEERS if getattr(args, peer)]
    line += ["--inference", "--out", args.out] if args.inference else []
    line += ["--cuda-graph"] if args.cuda_graph else []
    return line + (["--compile"] if args.compile else []) + (["--serve"] if args.interleave else [])


def measure(args: argparse.Namespace) -> dict | None:
    """Each of ``args.models`` timed in its own process (interleaved rounds with ``--interleave``); ``None`` (the
    failing worker's error printed) when one fails."""
    from tqdm.auto import tqdm

    if args.interleave:
        return interleaved(args, lambda name: worker_command(args, name), tqdm)
    results = {}
    for name in tqdm(timed_models(args), desc="models", unit="model"):
        done = subprocess.run(worker_command(args, name), capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return None
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        tqdm.write(
            f"{name}: {results[name]['median_s'] * 1e3:.0f} ms / step, "
            f"{results[name]['peak_growth_mib']:.0f} MiB peak, {results[name]['peak_tensor_mib']:.0f} MiB of tensors, "
            f"{results[name]['saved_mib']:.0f} MiB saved"
        )
    return results


def time_ratio(results: dict, name: str, reference: str, interleave: bool) -> float:
    """``name``'s step time over ``reference``'s: the median of the per-round ratios when the rounds were
    interleaved, else the ratio of the medians."""
    if interleave:
        return statistics.median(t / e for t, e in zip(results[name]["times"], results[reference]["times"]))
    return results[name]["median_s"] / results[reference]["median_s"]


def report(results: dict, args: argparse.Namespace) -> None:
    """Print the table: time, peak memory and saved bytes, each with its ratio to the ViT."""
    where = f"{args.threads} CPU threads" if args.device == "cpu" else "CUDA"
    print(
        f"\n{args.preset}{f' at {args.image_size} px' if args.image_size else ''}, batch {args.batch}, "
        f"{'inference (eval, no_grad)' if args.inference else 'forward + backward'}, {where}, "
        f"{'compiled' if args.compile else 'eager'}{', CUDA graph' if args.cuda_graph else ''}, "
        f"median of {args.repeats}" + ("" if args.autocast == "none" else f", under torch.autocast({args.autocast})")
    )
    first_peak = "peak RSS growth" if args.device == "cpu" else "first-step peak"  # CUDA: allocated bytes
    print(
        f"{'model':<40} {'params':>10} {'time / step':>12} {'vs ViT':>7} {first_peak:>16} {'vs ViT':>7} "
        f"{'peak tensors':>13} {'vs ViT':>7} {'saved for bwd':>14} {'vs ViT':>7} {'first step':>11} {'/ median':>9}"
    )
    euclid = results.get("euclidean")
    ratio = lambda name, key: (  # noqa: E731
        f"{'-':>7}"
        if not euclid or not euclid[key]
        else f"{time_ratio(results, name, 'euclidean', args.interleave):>6.2f}x"
        if key == "median_s"
        else f"{results[name][key] / euclid[key]:>6.2f}x"
    )
    for name in results:
        r = results[name]
        print(
            f"{label(name, args):<40} {r['params']:>10,} {r['median_s'] * 1e3:>9.0f} ms {ratio(name, 'median_s')} "
            f"{r['peak_growth_mib']:>12.0f} MiB {ratio(name, 'peak_growth_mib')} "
            f"{r['peak_tensor_mib']:>9.0f} MiB {ratio(name, 'peak_tensor_mib')} "
            f"{r['saved_mib']:>10.0f} MiB {ratio(name, 'saved_mib')} {r['first_step_s']:>9.3f} s "
            f"{r['first_step_s'] / r['median_s']:>8.1f}x"
        )
    if args.interleave and euclid:
        print(
            "(interleaved: time ratios are medians of the per-round ratios; per-round ViT / model times in ms: "
            + "; ".join(f"{name} " + " ".join(f"{t * 1e3:.0f}" for t in results[name]["times"]) for name in results)
            + ")"
        )
    for name in (name for name in results if name + BASE in results):
        twin = results[name + BASE]
        rounds = [t / b for t, b in zip(results[name]["times"], twin["times"])] if args.interleave else []
        print(
            f"{LABELS[name]}: {time_ratio(results, name, name + BASE, args.interleave):.3f}x the time of {args.base} "
            f"({results[name]['source']} against {twin['source']}"
            + (f"; per-round ratios {' '.join(f'{r:.3f}' for r in rounds)})" if rounds else ")")
        )
    if {"polar", "ambient"} <= set(results):
        print(f"polar / ambient: {time_ratio(results, 'polar', 'ambient', args.interleave):.2f}x")
    if {"polar", "polar-reference"} <= set(results):
        print(
            f"fused / reference: time {time_ratio(results, 'polar', 'polar-reference', args.interleave):.2f}x, "
            f"saved {results['polar']['saved_mib'] / results['polar-reference']['saved_mib']:.2f}x"
        )


def interleaved(args: argparse.Namespace, command, tqdm) -> dict | None:
    """Start every model's process (one after another: each measures its memory alone), then time one step
    of each in turn, ``--repeats`` rounds, every other round in reverse order (a fixed order favours one position:
    ``--base HEAD`` measured identical code at 0.95x its twin in all five rounds).  Returns the per-model results,
    ``times`` in round order."""
    workers = {}
    try:
        for name in tqdm(timed_models(args), desc="start models", unit="model"):
            workers[name] = subprocess.Popen(
                command(name), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            line = workers[name].stdout.readline()
            if not line or not json.loads(line).get("ready"):
                print(workers[name].stderr.read()[-3000:], file=sys.stderr)
                return None
        times: dict[str, list[float]] = {name: [] for name in workers}
        for round_index in tqdm(range(args.repeats), desc="rounds", unit="round"):
            turns = list(workers.items())  # every other round in reverse order: no model always steps first
            for name, worker in turns[:: -1 if round_index % 2 else 1]:
                worker.stdin.write("step\n")
                worker.stdin.flush()
                times[name].append(json.loads(worker.stdout.readline())["step_s"])
        results = {}
        for name, worker in workers.items():
            out, err = worker.communicate()  # EOF on stdin: the worker prints its summary
            if worker.returncode != 0:
                print(err[-3000:], file=sys.stderr)
                return None
            results[name] = {
                **json.loads(out.strip().splitlines()[-1]),
                "times": times[name],
                "median_s": statistics.median(times[name]),
            }
        return results
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                worker.kill()


def plot(results: dict, labels: dict, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    names = list(results)
    palette = plt.get_cmap("tab20")
    colors = [palette((2 * MODELS.index(n.removesuffix(BASE)) + n.endswith(BASE)) % palette.N) for n in names]
    for ax, key, scale, label in (
        (axes[0], "median_s", 1e3, "ms / forward (no_grad)" if args.inference else "ms / step (fwd + bwd)"),
        (axes[1], "peak_growth_mib", 1.0, "peak RSS growth, first step (MiB)"),
        (axes[2], "peak_tensor_mib", 1.0, "peak tensor memory (MiB)"),
        (axes[3], "saved_mib", 1.0, "saved for backward (MiB)"),
    ):
        ax.bar([labels[n] for n in names], [results[n][key] * scale for n in names], color=colors)
        ax.set_ylabel(label)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
        ax.grid(axis="y", alpha=0.3)
    mode = (
        "compiled"
        if args.compile
        else "eager"
        if not any(n.endswith("-compiled") for n in names)
        else "eager and compiled"
    )
    fig.suptitle(f"{args.preset}, batch {args.batch}, CPU ({mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
