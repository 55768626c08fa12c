"""Launch configurations of the Triton attention kernels, swept on the device: registers, time and error.

Run:  python benchmarks/attention_tune.py [--dim 64] [--size 1024] [--batch 8] [--heads 12]
          [--kernels fwd bwd_dq bwd_dkdv] [--blocks-m 16 32 64] [--blocks-n 16 32 64] [--warps 4 8]
          [--stages 1 2] [--arch sm_90|sm_80|none] [--chords gram|difference] [--workers 8] [--ptxas-only]
          [--repeats 5] [--out outputs/attention_tune]

Each candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of one kernel (``fwd``, ``bwd_dq``, ``bwd_dkdv``; the
others keep their defaults, :data:`triton_attention.LAUNCH_CONFIGS`) is

* compiled for ``--arch`` and assembled by the ``ptxas`` inside the triton wheel (:func:`triton_report.compile_kernel`,
  no GPU needed; ``--workers`` processes; ``--arch none`` skips it) and dropped if it spills: registers and spills
  are the first filter (``--ptxas-only``: only this, on any machine);
* timed on ``(batch, heads, size, dim)`` inputs (median of ``--repeats`` after a warm-up that compiles it): the
  forward for ``fwd``, the backward for the backward kernels (the other backward kernel is the same in every row,
  so the differences are this kernel's);
* checked against the float64 eager reference on a problem of 1 x 2 x ``min(size, 256)`` tokens: the output's
  largest geodesic error (``fwd``) or the gradients' largest relative error (the backward kernels) must stay within
  4x the default configuration's own error (or ``1e-6``), as the GPU-kernel tests demand.

Prints per kernel the candidates by time with their registers, time relative to the default and error relative to
the default's, and the fastest accepted one as the ``LAUNCH_CONFIGS`` entry it would be; writes
``attention_tune.csv`` and ``attention_tune.png``.  On a CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter)
the same steps run as a dry run of the script: its times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
ERROR_FACTOR = 4.0  # a candidate's error may be this many times the default configuration's
ERROR_FLOOR = 1e-6  # ... or up to this, where the default's own error is smaller


class Candidate(NamedTuple):
    """One launch configuration, in the order of ``LAUNCH_CONFIGS``' entries."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class Job(NamedTuple):
    """One compile for the ptxas figures: ``kernel`` at head width ``dim`` with ``candidate`` for ``arch``."""

    kernel: str
    dim: int
    candidate: Candidate
    arch: str
    chords: str = "gram"


class Problem(NamedTuple):
    """The timed inputs, the checked inputs and the checked inputs' float64 output and gradients."""

    timed: list[torch.Tensor]
    checked: list[torch.Tensor]
    reference: tuple


class Row(NamedTuple):
    """One candidate of one kernel: its ptxas figures (``-1`` without ``--arch``), time and error."""

    kernel: str
    candidate: Candidate
    default: bool
    registers: int
    spills: int
    ms: float
    error: float
    status: str  # "ok", "spills" or "inexact"


def candidates(args: argparse.Namespace) -> list[Candidate]:
    """Every combination of the swept values."""
    return [
        Candidate(m, n, w, s) for m in args.blocks_m for n in args.blocks_n for w in args.warps for s in args.stages
    ]


def default_candidate(kernel: str, dim: int, chords: str = "gram") -> Candidate:
    """The configuration a launch uses today without autotuning (:func:`triton_attention.launch_config`)."""
    from polar_vit_hf.modeling.triton_attention import launch_config

    config = launch_config(kernel, dim, chords=chords)
    return Candidate(config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"])


@contextlib.contextmanager
def launched_with(kernel: str, dim: int, candidate: Candidate, chords: str = "gram") -> Iterator[None]:
    """Inside: launches of ``kernel`` at head width ``dim`` use ``candidate`` (the first entry of its
    ``LAUNCH_CONFIGS`` list; the autotuner off, so that every kernel takes its first entry)."""
    from polar_vit_hf.modeling import triton_attention
    from polar_vit_hf.modeling.triton_attention import LAUNCH_CONFIGS, padded_head_dim

    table, width = LAUNCH_CONFIGS[chords][kernel], padded_head_dim(dim)
    previous = table.get(width)
    table[width] = [tuple(candidate)]
    triton_attention.AUTOTUNE = False
    try:
        yield
    finally:
        triton_attention.AUTOTUNE = True
        if previous is None:
            del table[width]
        else:
            table[width] = previous


def ptxas_figures(job: Job) -> tuple[int, int]:
    """``(registers, spill bytes)`` of the ``job``'s compile (both parts of a split dk/dv kernel: the larger
    registers, the summed spills); ``(-1, 0)`` for ``arch="none"``."""
    kernel, dim, candidate, arch, chords = job
    if arch == "none":
        return -1, 0
    os.environ.pop("TRITON_INTERPRET", None)  # (a worker process of its own: compile for the GPU)
    from polar_vit_hf.benchmarks.triton_report import compile_kernel
    from polar_vit_hf.modeling.triton_attention import kv_parts

    with launched_with(kernel, dim, candidate, chords):
        parts = kv_parts(dim) if kernel == "bwd_dkdv" else (0,)
        reports = [compile_kernel(kernel, dim, arch, part, chords) for part in parts]
    registers = max(report["registers"] for report in reports)
    return registers, sum(report["spill_stores"] + report["spill_loads"] for report in reports)


def all_ptxas_figures(jobs: list[Job], workers: int) -> list[tuple[int, int]]:
    """:func:`ptxas_figures` of every job, in ``workers`` processes (each compile is about a second of one core)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tqdm.auto import tqdm

    if not jobs or jobs[0].arch == "none":
        return [(-1, 0)] * len(jobs)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(tqdm(pool.map(ptxas_figures, jobs), total=len(jobs), desc="ptxas", unit="config"))


def time_kernel(kernel: str, inputs: list[torch.Tensor], repeats: int, chords: str) -> float:
    """Milliseconds (median of ``repeats`` after one warm-up) of the forward (``fwd``) or of the backward."""
    from polar_vit_hf.benchmarks.attention_speed import synchronizer
    from polar_vit_hf.modeling.triton_attention import triton_polar_attention

    sync = synchronizer(inputs[0].device)
    times = []
    for attempt in range(repeats + 1):
        for tensor in inputs:
            tensor.grad = None
        sync()
        start = time.perf_counter()
        r, u = triton_polar_attention(*inputs[:6], inputs[6], 1.0, chords=chords)
        if kernel != "fwd":
            sync()
            start = time.perf_counter()
            (r.sum() + u.sum()).backward()
        sync()
        if attempt:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def kernel_error(kernel: str, inputs: list[torch.Tensor], reference: tuple, chords: str) -> float:
    """The output's largest geodesic error from the float64 ``reference`` (``fwd``), or the gradients' largest
    error relative to each reference gradient's largest entry (the backward kernels)."""
    from functools import partial

    from polar_vit_hf.benchmarks.attention_speed import attention_errors
    from polar_vit_hf.modeling.triton_attention import triton_polar_attention

    attention = partial(triton_polar_attention, chords=chords)
    output_error, gradient_error = attention_errors(attention, inputs, reference)
    return output_error if kernel == "fwd" else gradient_error


def configurations(kernel: str, args: argparse.Namespace) -> list[Candidate]:
    """The default configuration of ``kernel`` first (the yardstick of time and error), then the other candidates."""
    default = default_candidate(kernel, args.dim, args.chords)
    return [default, *(c for c in candidates(args) if c != default)]


def sweep(
    kernel: str,
    figures: list[tuple[int, int]],
    args: argparse.Namespace,
    problem: Problem | None,
) -> list[Row]:
    """Every candidate of ``kernel`` (:func:`configurations`) with its ptxas ``figures``: those that spill dropped,
    the others timed and checked on the ``problem``; without one (``--ptxas-only``) the figures alone."""
    from tqdm.auto import tqdm

    rows: list[Row] = []
    default_error = float("nan")
    nothing = float("nan")
    for candidate, (registers, spills) in tqdm(
        list(zip(configurations(kernel, args), figures)), desc=kernel, unit="config", disable=problem is None
    ):
        is_default = not rows
        if spills or problem is None:
            rows.append(
                Row(kernel, candidate, is_default, registers, spills, nothing, nothing, "spills" if spills else "ok")
            )
            continue
        with launched_with(kernel, args.dim, candidate, args.chords):
            ms = time_kernel(kernel, problem.timed, args.repeats, args.chords)
            error = kernel_error(kernel, problem.checked, problem.reference, args.chords)
        if is_default:
            default_error = error
        status = "ok" if error <= max(ERROR_FACTOR * default_error, ERROR_FLOOR) else "inexact"
        rows.append(Row(kernel, candidate, is_default, registers, spills, ms, error, status))
    return rows


def print_rows(rows: list[Row], dim: int, chords: str) -> None:
    """One kernel's table, fastest first, and its best accepted configuration as a ``LAUNCH_CONFIGS`` entry."""
    from polar_vit_hf.modeling.triton_attention import padded_head_dim

    default = next(row for row in rows if row.default)
    print(f"\n{rows[0].kernel}, D = {dim}: blocks, warps, stages, registers, ms, x default, error, x default's error")
    for row in sorted(rows, key=lambda row: (row.status != "ok", row.ms)):
        c = row.candidate
        mark = " (default)" if row.default else ""
        head = f"  {c.block_m:>3}x{c.block_n:<3} {c.num_warps:>2} {c.num_stages}  {row.registers:>4}"
        if row.status == "spills" or math.isnan(row.ms):
            print(f"{head}  spills {row.spills} B{mark}")
            continue
        print(
            f"{head}  {row.ms:9.3f} ms  {row.ms / default.ms:5.2f}x  {row.error:8.1e}  "
            f"{row.error / max(default.error, 1e-300):6.2f}x  {row.status}{mark}"
        )
    if math.isnan(default.ms):  # --ptxas-only: no times
        return
    best = min((row for row in rows if row.status == "ok"), key=lambda row: row.ms)
    print(
        f"  best: LAUNCH_CONFIGS[{chords!r}][{best.kernel!r}][{padded_head_dim(dim)}][0] = {tuple(best.candidate)}  "
        f"# {best.ms:.3f} ms, {best.ms / default.ms:.2f}x the default {tuple(default.candidate)}"
    )


def write_csv(rows: list[Row], path: Path) -> None:
    """Every row, one line per candidate."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["kernel", *Candidate._fields, "default", "registers", "spill_bytes", "ms", "error", "status"])
        for row in rows:
            writer.writerow(
                [row.kernel, *row.candidate, row.default, row.registers, row.spills, row.ms, row.error, row.status]
            )


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Per kernel, the accepted candidates' times relative to the default (bars; the default's bar at 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = [kernel for kernel in KERNELS if any(row.kernel == kernel for row in rows)]
    fig, axes = plt.subplots(1, len(kernels), figsize=(4.5 * len(kernels), 4.5), squeeze=False)
    for ax, kernel in zip(axes[0], kernels):
        mine = [row for row in rows if row.kernel == kernel and row.status == "ok"]
        default_ms = next(row.ms for row in rows if row.kernel == kernel and row.default)
        mine.sort(key=lambda row: row.ms)
        labels = ["{}x{} w{} s{}".format(*row.candidate) for row in mine]
        colors = ["tab:orange" if row.default else "tab:blue" for row in mine]
        ax.barh(labels, [row.ms / default_ms for row in mine], color=colors)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_title(kernel)
        ax.set_xlabel("time / default (orange)")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--size", type=int, default=1024, help="tokens N of the timed problem")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--blocks-m", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--blocks-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--arch", choices=["sm_90", "sm_80", "none"], default="sm_90")
    parser.add_argument(
        "--chords", choices=["gram", "difference"], help="the chord design (default: the device's, gram on a CPU)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes compiling for --arch"
    )
    parser.add_argument("--ptxas-only", action="store_true", help="registers and spills only (no GPU needed)")
    parser.add_argument("--out", default="outputs/attention_tune")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from polar_vit_hf.benchmarks.attention_speed import float64_reference, make_inputs
    from polar_vit_hf.modeling.triton_attention import default_chords, triton_usable

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.chords = args.chords or default_chords(device)
    if not args.ptxas_only and not triton_usable(device):
        raise SystemExit("attention_tune.py needs a CUDA GPU with triton (or TRITON_INTERPRET=1 for a dry run)")
    if args.ptxas_only and args.arch == "none":
        raise SystemExit("--ptxas-only needs an --arch to compile for")
    jobs = [
        Job(kernel, args.dim, candidate, args.arch, args.chords)
        for kernel in args.kernels
        for candidate in configurations(kernel, args)
    ]
    figures = iter(all_ptxas_figures(jobs, args.workers))
    problem = None
    if not args.ptxas_only:
        checked = make_inputs(1, 2, min(args.size, 256), args.dim, device, seed=1)
        timed = make_inputs(args.batch, args.heads, args.size, args.dim, device)
        problem = Problem(timed, checked, float64_reference(checked))
    rows = [
        row
        for kernel in args.kernels
        for row in sweep(kernel, [next(figures) for _ in configurations(kernel, args)], args, problem)
    ]
    for kernel in args.kernels:
        print_rows([row for row in rows if row.kernel == kernel], args.dim, args.chords)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "attention_tune.csv")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    title = f"{name}: B{args.batch} H{args.heads} N{args.size} D{args.dim}"
    if problem is None:
        print(f"wrote {out / 'attention_tune.csv'}")
        return 0
    plot(rows, out / "attention_tune.png", title)
    print(f"wrote {out / 'attention_tune.csv'} and {out / 'attention_tune.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
