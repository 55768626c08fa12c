"""The vectorised ``exp``, ``expm1``, ``log``, ``log1p`` and ``sqrt`` of this torch build, before and after
:func:`stable_math.page_in_vector_math`.

Run:  python benchmarks/vector_math.py [--size 507000] [--rounds 3] [--threads 2] [--out outputs/vector_math]

Each round is a fresh process that imports only ``torch``, times every function on ``--size`` ordinary values
(uniform in ``[0, 3)``, float32 and float64; the median of 20 calls), then imports ``polar_vit_hf``'s
:mod:`stable_math` (whose import pages in the vector code's constants) and times them again.  Prints the medians over
the rounds and the ratio before / after, writes ``vector_math.csv``.  A ratio far above 1 means this build's
functions run into the suppressed-fault assist that the page-in removes (see its docstring).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

FUNCTIONS = ("exp", "expm1", "log", "log1p", "sqrt")
DTYPES = ("float32", "float64")


def time_functions(size: int) -> dict[str, float]:
    """Milliseconds per call of every function and dtype (median of 20 calls after one warm-up).  Timed with
    ``timeit``, not ``attention_speed.median_time``: importing the package would page the constants in before the
    first timing."""
    import torch

    values = 3.0 * torch.rand(size, generator=torch.Generator().manual_seed(0))
    result = {}
    for dtype in DTYPES:
        x = values.to(getattr(torch, dtype))
        for name in FUNCTIONS:
            call = functools.partial(getattr(torch, name), x)
            call()
            result[f"{name} {dtype}"] = 1e3 * statistics.median(timeit.repeat(call, number=1, repeat=20))
    return result


def worker(size: int, threads: int) -> None:
    """One round: times before and after the page-in, in this fresh process; prints one JSON line."""
    import torch

    torch.set_num_threads(threads)
    before = time_functions(size)
    from polar_vit_hf.modeling import stable_math  # noqa: F401 - its import pages the constants in

    print(json.dumps({"before": before, "after": time_functions(size)}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=507_000)  # one attention group of tiny-cifar at batch 64
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="outputs/vector_math")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.size, args.threads)
        return 0

    import torch
    from tqdm import tqdm

    command = [sys.executable, __file__, "--worker", "--size", str(args.size), "--threads", str(args.threads)]
    rounds = []
    for _ in tqdm(range(args.rounds), desc="fresh processes", unit="process"):
        lines = subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()
        rounds.append(json.loads(lines[-1]))
    rows = []
    for key in rounds[0]["before"]:
        before = statistics.median(r["before"][key] for r in rounds)
        after = statistics.median(r["after"][key] for r in rounds)
        rows.append((key, before, after, before / after))

    capability = torch.backends.cpu.get_cpu_capability()
    print(f"\n{args.size} values in [0, 3), {capability}, {args.threads} threads, median of {args.rounds} processes")
    print(f"{'function':16s} {'before ms':>10s} {'after ms':>10s} {'before / after':>15s}")
    for key, before, after, ratio in rows:
        print(f"{key:16s} {before:10.3f} {after:10.3f} {ratio:14.1f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "vector_math.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["function", "before_ms", "after_ms", "ratio"])
        writer.writerows(rows)
    print(f"wrote {out / 'vector_math.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
