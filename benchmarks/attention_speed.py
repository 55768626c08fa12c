"""Polar attention cost: eager vs chunked vs fused vs Triton vs Euclidean SDPA, forward + backward.

Run:  python benchmarks/attention_speed.py [--device cpu|cuda] [--sizes 64 128 ... 4096] [--check]
      python benchmarks/attention_speed.py --sharpness [--repeats 7]

For each sequence length N and implementation, one forward + backward of the attention core on
``(batch, heads, N, head_dim)`` inputs (default 1 x 4 x N x 16 on CPU, 8 x 12 x N x 64 on CUDA)
is timed (median of ``--repeats`` after a warm-up) and the peak memory of the first (cold) step
measured: on CUDA with ``torch.cuda.max_memory_allocated``; on CPU as the growth of the resident set
(``benchmarks/_memory.py``) in a fresh subprocess per measurement, after one shorter call of ``fused`` has loaded
inductor and its compiled kernels (a once-per-process cost, not the attention's memory).  ``fused`` is the CPU
model's core (compiled kernels in blocks of cache size).  ``sdpa`` is
``torch.nn.functional.scaled_dot_product_attention`` on
the same shapes (Euclidean yardstick).  ``--check`` first compares the Triton kernels (and the
chunked path) with the float64 eager reference.  Prints a table and writes ``attention.csv`` and
``attention.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IMPLS = ("eager", "chunked", "fused", "triton", "sdpa")


def make_inputs(batch, heads, n, dim, device, dtype=None, seed=0, rmax=3.0, scale=None):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = dtype or torch.float32

    def points():
        r = rmax * torch.rand(batch, heads, n, generator=gen)
        u = torch.nn.functional.normalize(torch.randn(batch, heads, n, dim, generator=gen), dim=-1)
        return r.to(device, dtype), u.to(device, dtype)

    (rq, uq), (rk, uk), (rv, uv) = points(), points(), points()
    scales = torch.full((heads,), dim**-0.5 if scale is None else scale, dtype=dtype, device=device)
    return [t.requires_grad_(True) for t in (rq, uq, rk, uk, rv, uv, scales)]


def step_fn(impl, inputs):
    """One forward + backward of ``impl`` on ``inputs``."""
    import torch

    from polar_vit_hf.modeling.attention import polar_attention

    def run():
        for t in inputs:
            t.grad = None
        if impl == "sdpa":
            q, k, v = inputs[1], inputs[3], inputs[5]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            out.sum().backward()
            return
        r, u = polar_attention(*inputs[:6], inputs[6], 1.0, impl=impl)
        (r.sum() + u.sum()).backward()

    return run


KERNEL_WARMUP_TOKENS = 128  # a fused call this long runs the compiled kernels (kernel_min_elements pairs at 4 heads)
EAGER_PAIR_TENSORS = 18  # B x H x N x N float32 tensors eager autograd keeps per attention call (profiled)


def eager_bytes(batch: int, heads: int, n: int) -> int:
    """Memory the eager reference needs for one forward + backward: its N x N tensors."""
    return EAGER_PAIR_TENSORS * batch * heads * n * n * 4


def median_time(run, repeats: int, sync=lambda: None) -> float:
    """Median seconds of ``repeats`` calls of ``run`` (each followed by ``sync``)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(impl, batch, heads, n, dim, device, repeats):
    """Median seconds and peak memory (MiB) of one forward + backward."""
    import torch

    if impl == "fused" and device == "cpu":  # load inductor and the core's compiled kernels: once per process
        step_fn(impl, make_inputs(1, heads, KERNEL_WARMUP_TOKENS, dim, device))()
    inputs = make_inputs(batch, heads, n, dim, device)
    run = step_fn(impl, inputs)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        from polar_vit_hf.benchmarks._memory import peak_rss_growth

        with peak_rss_growth() as growth:
            run()
        peak = growth.mib
    return median_time(run, repeats, synchronizer(device)), peak


SHARPNESS_CASES = {"generic": (1.0, None), "sharp": (8.0, 1.0)}  # (largest radius, scale; None: d^-1/2)


def sharpness(repeats: int, batch: int = 64, heads: int = 12, n: int = 64, dim: int = 16) -> None:
    """Print the fused core's forward + backward time on generic and sharp inputs (:data:`SHARPNESS_CASES`), with
    the share of softmax weights below ``sqrt(tiny)`` (:func:`stable_math.weight_cutoff`)."""
    import torch

    from polar_vit_hf.modeling.geometry import pairwise_sq_distance
    from polar_vit_hf.modeling.stable_math import weight_cutoff

    print(f"\nfused polar attention, forward + backward, {batch} x {heads} x {n} x {dim}, median of {repeats}")
    print(f"{'inputs':<10}{'ms':>10}{'weights < 1e-19':>18}")
    for name, (rmax, scale) in SHARPNESS_CASES.items():
        inputs = make_inputs(batch, heads, n, dim, "cpu", rmax=rmax, scale=scale)
        run = step_fn("fused", inputs)
        run()
        seconds = median_time(run, repeats)
        with torch.no_grad():
            scores = inputs[6].view(-1, 1, 1) * pairwise_sq_distance(*inputs[:4], 1.0)
            gap = scores - scores.amin(-1, keepdim=True)  # -log of the unnormalised weight
            tiny = (gap > -weight_cutoff(torch.float32)).float().mean().item()
        print(f"{name:<10}{seconds * 1e3:>10.1f}{tiny:>17.0%}")


def synchronizer(device: str | torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def float64_reference(inputs: list) -> tuple:
    """``(r, u, gradients)`` of the eager float64 attention on ``inputs`` for the loss ``sum r + sum u``."""
    from polar_vit_hf.modeling.attention import eager_polar_attention

    ref = [t.detach().double().requires_grad_(True) for t in inputs]
    r, u, _ = eager_polar_attention(*ref[:6], ref[6], 1.0)
    (r.sum() + u.sum()).backward()
    return r.detach(), u.detach(), [t.grad for t in ref]


def attention_errors(impl: str | Callable, inputs: list, reference: tuple) -> tuple[float, float]:
    """``(largest geodesic error of the output, largest gradient error relative to each reference gradient's
    largest entry)`` of ``impl`` (an implementation's name, or an attention function) on copies of ``inputs``
    against their :func:`float64_reference`."""
    from polar_vit_hf.modeling.attention import polar_attention
    from polar_vit_hf.modeling.geometry import distance

    test = [t.detach().clone().requires_grad_(True) for t in inputs]
    if callable(impl):
        r, u = impl(*test[:6], test[6], 1.0)
    else:
        r, u = polar_attention(*test[:6], test[6], 1.0, impl=impl)
    (r.sum() + u.sum()).backward()
    r_ref, u_ref, grads_ref = reference
    err = float(distance(r.detach().double(), u.detach().double(), r_ref, u_ref).max())
    grad_err = max(float((a.grad.double() - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(test, grads_ref))
    return err, grad_err


def check(device: str, dims=(16, 32, 64)) -> None:
    """Triton (where usable) and chunked against the float64 eager reference."""
    import torch

    from polar_vit_hf.modeling.triton_attention import triton_usable

    impls = ["chunked"] + (["triton"] if triton_usable(torch.device(device)) else [])
    for dim in dims:
        for n in (100, 256):
            inputs = make_inputs(2, 3, n, dim, device)
            reference = float64_reference(inputs)
            for impl in impls:
                err, grad_err = attention_errors(impl, inputs, reference)
                status = "ok" if err < 1e-4 and grad_err < 1e-3 else "FAIL"
                print(
                    f"check {impl:<8} d={dim:<3} N={n:<4} max geodesic error {err:.1e}  "
                    f"max relative gradient error {grad_err:.1e}  {status}"
                )
                if status == "FAIL":
                    raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--batch", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--check-dims", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--out", default="outputs/attention")
    parser.add_argument("--sharpness", action="store_true", help="the fused core on generic and sharp inputs")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: "impl,n" measured in this process
    args = parser.parse_args(argv)
    if args.sharpness:
        import torch

        torch.manual_seed(0)
        sharpness(args.repeats)
        return 0
    cuda = args.device == "cuda"
    batch = args.batch or (8 if cuda else 1)
    heads = args.heads or (12 if cuda else 4)
    dim = args.dim or (64 if cuda else 16)
    if args.one:
        impl, n = args.one.split(",")
        seconds, peak = measure(impl, batch, heads, int(n), dim, args.device, args.repeats)
        print(json.dumps({"seconds": seconds, "peak_mib": peak}))
        return 0
    if args.check:
        check(args.device, args.check_dims)
    import torch

    from polar_vit_hf.modeling.triton_attention import triton_usable

    impls = [i for i in args.impls if i != "triton" or (cuda and triton_usable(torch.device("cuda")))]
    from tqdm.auto import tqdm

    results = {}
    jobs = [(impl, n) for n in args.sizes for impl in impls]
    for impl, n in tqdm(jobs, desc="attention", unit="run"):
        if cuda:
            if impl == "eager" and eager_bytes(batch, heads, n) > 0.5 * torch.cuda.mem_get_info()[0]:
                tqdm.write(f"eager N={n}: skipped (would keep ~{eager_bytes(batch, heads, n) / 2**30:.0f} GiB)")
                results[(impl, n)] = (float("nan"), float("nan"))
                continue
            results[(impl, n)] = measure(impl, batch, heads, n, dim, "cuda", args.repeats)
            tqdm.write(f"{impl} N={n}: {results[(impl, n)][0] * 1e3:.2f} ms, {results[(impl, n)][1]:.1f} MiB")
            continue
        command = [
            sys.executable,
            __file__,
            "--one",
            f"{impl},{n}",
            "--device",
            "cpu",
            "--batch",
            str(batch),
            "--heads",
            str(heads),
            "--dim",
            str(dim),
            "--repeats",
            str(args.repeats),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        value = json.loads(done.stdout.strip().splitlines()[-1])
        results[(impl, n)] = (value["seconds"], value["peak_mib"])

    print(
        f"\nforward + backward, batch {batch}, heads {heads}, head dim {dim}, {args.device}, median of {args.repeats}"
    )
    header = "".join(f"{impl + ' ms':>14}{impl + ' MiB':>14}" for impl in impls)
    print(f"{'N':>6}{header}")
    for n in args.sizes:
        row = "".join(f"{results[(impl, n)][0] * 1e3:>14.1f}{results[(impl, n)][1]:>14.1f}" for impl in impls)
        print(f"{n:>6}{row}")
    last = args.sizes[-1]
    if "eager" in impls and "chunked" in impls:
        e, c = results[("eager", last)], results[("chunked", last)]
        print(
            f"N={last}: chunked / eager time {c[0] / e[0]:.2f}x, eager / chunked memory {e[1] / max(c[1], 1e-9):.1f}x"
        )
    if {"triton", "sdpa", "eager"} <= set(impls):
        for n in args.sizes:
            t = results[("triton", n)][0]
            print(
                f"N={n}: triton / sdpa {t / results[('sdpa', n)][0]:.2f}x, eager / triton "
                f"{results[('eager', n)][0] / t:.2f}x"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "attention.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["impl", "N", "seconds", "peak_mib"])
        for (impl, n), (seconds, peak) in results.items():
            writer.writerow([impl, n, seconds, peak])
    plot(results, impls, args.sizes, out / "attention.png", f"{args.device}, B={batch}, H={heads}, d={dim}")
    print(f"wrote {out / 'attention.csv'} and {out / 'attention.png'}")
    return 0


def plot(results, impls, sizes, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl in impls:
        axes[0].loglog(sizes, [results[(impl, n)][0] * 1e3 for n in sizes], "o-", label=impl)
        axes[1].loglog(sizes, [max(results[(impl, n)][1], 0.1) for n in sizes], "o-", label=impl)
    axes[0].set_ylabel("ms (forward + backward)")
    axes[1].set_ylabel("peak memory growth (MiB)")
    for ax in axes:
        ax.set_xlabel("sequence length N")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(f"polar attention: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
