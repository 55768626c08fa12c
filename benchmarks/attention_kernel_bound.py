"""How far the compiled attention kernel is from a hand-written one: the fused polar attention forward, per group.

Run:  python benchmarks/attention_kernel_bound.py [--samples 10] [--heads 12] [--tokens 65] [--dim 16]
          [--rounds 8] [--threads 2] [--out outputs/attention_kernel_bound]

On one group of ``samples x heads`` slices (the default: one group of tiny-cifar's attention at batch 64, the size
``attention_group_elements`` gives it), times the package's forward of :class:`FusedPolarAttention` on that group
(``_attention_group_forward`` as the model runs it: a compiled kernel, inductor's loops and a batched product)
against ``benchmarks/per_row_attention.cpp``: the same formulas hand-written one query row at a time, vectorised
over the keys with ``at::vec``, everything of a row in registers or L1, built here with
``torch.utils.cpp_extension`` (a C++ compiler and ninja; flags for the CPU's capability).  Both are first checked
against the float64 forward (largest error relative to each output's largest value).  Rounds alternate the two,
each the median of 40 calls; prints the table and the median ratio, writes ``attention_kernel_bound.csv``.

The ratio bounds what a hand-fused kernel could gain over the compiled one for the same arithmetic.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Callable
from pathlib import Path

OUTPUTS = ("lse", "T", "E", "S", "||V||", "u_hat")  # what both kernels return (the package's also the radius)
CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"],
}


def build_extension():
    """``per_row_attention.cpp`` compiled for this CPU's vector capability (cached by torch's extension cache)."""
    import torch
    from torch.utils.cpp_extension import load

    flags = CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    source = Path(__file__).with_name("per_row_attention.cpp")
    return load("polar_vit_per_row_attention", [str(source)], extra_cflags=["-O3", "-fopenmp", *flags])


def group_rows(samples: int, heads: int, tokens: int, dim: int, seed: int = 0):
    """A :class:`fused_attention.GroupRows` of random points (radii up to 3) and the model's default scale."""
    import torch

    from polar_vit_hf.modeling.fused_attention import AttentionRows, Block

    gen = torch.Generator().manual_seed(seed)

    def points():
        radii = 3.0 * torch.rand(samples, heads, tokens, generator=gen)
        return radii, torch.nn.functional.normalize(torch.randn(samples, heads, tokens, dim, generator=gen), dim=-1)

    (rq, uq), (rk, uk), (rv, uv) = points(), points(), points()
    scale = torch.full((heads,), dim**-0.5)
    return AttentionRows(rq, uq, rk, uk, rv, uv, scale, 1.0)[Block(slice(0, samples))]


def hand_written_call(extension, rows) -> Callable:
    """The extension's forward on ``rows`` (contiguous copies made once, outside the timing)."""
    import torch

    from polar_vit_hf.modeling.stable_math import weight_cutoff

    row = rows.scalars
    exps = (row.exp_a, row.exp_minus_a, row.exp_b, row.exp_minus_b)
    fields = (rows.uq, rows.uk, rows.uv, row.a, row.b, *exps, row.sinh_a, row.sinh_b)
    values = (row.sinh_beta, row.cosh_beta, row.exp_beta, row.root_coef.reshape(-1))
    args = [t.contiguous() for t in (*fields, *values)]
    cutoff = float(weight_cutoff(torch.float32))
    return lambda: shared_outputs(extension.forward(*args, cutoff))


def shared_outputs(result) -> tuple:
    """:data:`OUTPUTS` of the extension's ``(lse, sums = (T, E, V), ||V||, u_hat, S)`` or of the package's
    ``RowStatistics``."""
    if hasattr(result, "_fields"):
        return result.lse, result.big_t, result.big_e, result.big_s, result.v_norm, result.u_hat
    lse, sums, v_norm, u_hat, big_s = result
    return lse, sums[..., 0], sums[..., 1], big_s, v_norm, u_hat


def compiled_call(rows) -> Callable:
    """The package's group forward as the fused attention runs it (its compiled CPU kernel)."""
    from polar_vit_hf.modeling.cpu_kernels import run_maybe_compiled
    from polar_vit_hf.modeling.fused_attention import _attention_group_forward

    pairs = rows.uq.shape[0] * rows.uq.shape[1] * rows.uk.shape[1]
    return lambda: shared_outputs(run_maybe_compiled(_attention_group_forward, rows.uq, rows, elements=pairs))


def relative_errors(outputs, rows) -> list[float]:
    """Largest error of each output against the float64 forward, relative to that output's largest value."""

    from polar_vit_hf.modeling.cpu_kernels import map_tensors
    from polar_vit_hf.modeling.fused_attention import _attention_group_forward

    exact = shared_outputs(_attention_group_forward(map_tensors(rows, lambda t: t.double())))
    return [float((o.double() - e).abs().max() / e.abs().max()) for o, e in zip(outputs, exact)]


def median_ms(fn: Callable, calls: int = 40) -> float:
    """Median wall time of ``calls`` calls after three warm-up calls."""
    from polar_vit_hf.benchmarks.attention_speed import median_time

    for _ in range(3):
        fn()
    return median_time(fn, calls) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=65)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="outputs/attention_kernel_bound")
    args = parser.parse_args(argv)

    import torch
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    extension = build_extension()
    rows = group_rows(args.samples, args.heads, args.tokens, args.dim)
    calls = {"compiled (package)": compiled_call(rows), "hand-written per row": hand_written_call(extension, rows)}
    errors = {name: relative_errors(call(), rows) for name, call in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for name, call in calls.items():
            times[name].append(median_ms(call))
    ratios = [c / h for c, h in zip(*times.values())]

    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"\nfused polar attention forward, one group of {args.samples} x {args.heads} slices, N = M = {args.tokens}, "
        f"d = {args.dim}; {capability}, {args.threads} threads, median of {args.rounds} rounds"
    )
    print(f"{'kernel':24s} {'ms':>8s}   " + "  ".join(f"{'err ' + o:>10s}" for o in OUTPUTS))
    for name in calls:
        cells = "  ".join(f"{e:10.1e}" for e in errors[name])
        print(f"{name:24s} {statistics.median(times[name]):8.3f}   {cells}")
    ratio = statistics.median(ratios)
    print(f"compiled / hand-written: {ratio:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "attention_kernel_bound.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["kernel", "median_ms", *(f"error_{o}" for o in OUTPUTS)])
        for name in calls:
            writer.writerow([name, statistics.median(times[name]), *errors[name]])
    print(f"wrote {out / 'attention_kernel_bound.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
