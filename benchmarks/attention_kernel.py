"""The Triton polar attention kernels per query-key pair: instructions from their PTX, occupancy from ptxas, and
on a GPU their time against SDPA.

Run:  python benchmarks/attention_kernel.py [--head-dim 64] [--arch sm_90] [--designs baseline gram difference]
          [--sizes 196 256 1024 4096 8192] [--batch 8] [--heads 12] [--repeats 10] [--no-timing]
          [--out outputs/attention_kernel]

**Instructions (no GPU needed).**  Each kernel of a design (``baseline``: ``benchmarks/attention_baseline.py``, the
kernels before the FlashAttention-2 rewrite; ``gram`` and ``difference``: ``modeling/triton_kernels.py`` with its
float64 Gram chords or its coordinate-difference chords) is compiled for ``--arch`` with its default launch
configuration and its PTX read: the instructions of one iteration of its main loop over the other side's blocks
along its common path (inner loops counted their trip count times; the rare path of a tile with near-equal
directions, which recomputes its chords from differences, left out; the loops of a kernel with several summed),
per thread, times the threads of a program, divided by the ``BLOCK_M x BLOCK_N`` pairs of the iteration.
Columns: float32 arithmetic, float64 arithmetic, special-function operations (``ex2 lg2 rcp rsqrt sqrt sin cos
tanh div``), global loads (``ld.global``, ``cp.async``, bulk copies), tensor-core instructions (``mma``,
``wgmma``) and warp shuffles, per pair; registers and spills from the wheel's ``ptxas``; resident warps per SM
from registers, shared memory and the warp limit.  The design's total is forward + both backward kernels,
checked against the goals (``GOALS``).

**Time (CUDA).**  One forward + backward on ``(batch, heads, N, head_dim)`` float32 inputs, median of
``--repeats`` after a warm-up (which autotunes): the design the device uses (:func:`triton_attention.default_chords`),
the baseline, ``scaled_dot_product_attention`` in float32 (the yardstick) and in bfloat16 (FlashAttention, for
reference); peak memory of the polar kernels.  Prints both tables; writes ``attention_kernel_ptx.csv``,
``attention_kernel_time.csv`` (on a GPU) and ``attention_kernel.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

DESIGNS = ("baseline", "gram", "difference")
SFU = ("ex2", "lg2", "rcp", "rsqrt", "sqrt", "sin", "cos", "tanh", "div")
ARITHMETIC = ("add", "sub", "mul", "fma", "mad", "neg", "abs", "min", "max", "setp", "selp", "copysign", "testp")
ARITHMETIC += SFU
GOALS = {"fp32": 700, "sfu": 25, "loads": 64}  # per pair, forward + backward, at D = 64
SHARED_PER_SM = {"sm_90": 228 * 1024, "sm_80": 164 * 1024}
INSTRUCTION = re.compile(r"^(?:@!?%p\w+\s+)?([a-z][\w.:]*)")
LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


class Loop(NamedTuple):
    """A loop of the PTX: the lines from its header label to its backward branch."""

    start: int
    end: int


def loops(lines: list[str]) -> list[Loop]:
    """Every loop of a PTX listing (a branch back to an earlier label)."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line.strip()))}
    found = []
    for i, line in enumerate(lines):
        m = BRANCH.search(line)
        if m and labels.get(m.group(1), len(lines)) < i:
            found.append(Loop(labels[m.group(1)], i))
    return found


def trip_count(lines: list[str], loop: Loop) -> int:
    """Iterations of an inner loop with constant bounds: ``add r, r, step`` and ``setp.ne r, limit`` before its
    branch (an induction from 0, as Triton emits for ``range(D)``); 1 where it cannot be read."""
    body = "\n".join(lines[loop.start : loop.end + 1])
    compare = re.findall(r"setp\.(?:ne|lt)\.[bsu]\d+\s+%p\d+,\s+(%r[d]?\d+),\s+(\d+);", body)
    for register, limit in reversed(compare):
        step = re.search(rf"add\.[su]\d+\s+{re.escape(register)},\s+{re.escape(register)},\s+(\d+);", body)
        if step:
            return max(1, int(limit) // int(step.group(1)))
    return 1


def opcode(line: str) -> str | None:
    """The opcode of an instruction line (``None`` for directives, labels, comments)."""
    m = INSTRUCTION.match(line.strip())
    return m.group(1) if m else None


def classify(op: str) -> list[str]:
    """The columns one instruction counts in."""
    base = op.split(".")[0]
    kinds = []
    if base in ARITHMETIC and ".f32" in op:
        kinds.append("fp32")
    if base in ARITHMETIC and ".f64" in op:
        kinds.append("fp64")
    if base in SFU:
        kinds.append("sfu")
    if op.startswith(("ld.global", "cp.async")) and not op.startswith(("cp.async.commit", "cp.async.wait")):
        kinds.append("loads")
    if op.startswith(("mma.sync", "wgmma.mma_async")):
        kinds.append("mma")
    if base == "shfl":
        kinds.append("shuffles")
    return kinds


def loop_headers(lines: list[str]) -> tuple[list[str], set[str]]:
    """The outermost loops' header labels and the inner loops' header labels, from LLVM's loop comments in the PTX
    (``=>This Loop Header: Depth=1``, ``=>  This Inner Loop Header: Depth=2``)."""
    outer, inner = [], set()
    for i, line in enumerate(lines):
        m = LABEL.match(line.strip())
        if not m:
            continue
        notes = " ".join(lines[i : i + 3])
        if "=>This Loop Header: Depth=1" in notes:
            outer.append(m.group(1))
        elif "Inner Loop Header" in notes:
            inner.add(m.group(1))
    return outer, inner


def enters_inner_loop(lines: list[str], start: int, inner: set[str]) -> bool:
    """Whether straight-line code from ``start`` reaches an inner loop's header before any branch."""
    for line in lines[start:]:
        m = LABEL.match(line.strip())
        if m and m.group(1) in inner:
            return True
        if BRANCH.search(line):
            return False
    return False


def main_loop_counts(ptx: str) -> Counter:
    """Instruction counts of one iteration of each outermost loop along its common path, summed: the walk from the
    loop's header to its back edge, inner loops counted their trip count times; at a conditional branch the walk
    takes the side that does not enter an inner loop (the rare path of a tile with near-equal directions, which
    recomputes its chords from differences, is left out; the baseline's chord loops have no such branch)."""
    lines = ptx.splitlines()
    outer, inner = loop_headers(lines)
    counts: Counter = Counter()
    for header in outer:
        counts.update(iteration_counts(lines, header, inner))
    return counts


def iteration_counts(lines: list[str], outer: str, inner: set[str]) -> Counter:
    """:func:`main_loop_counts` of the loop headed by ``outer``."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line.strip()))}
    counts: Counter = Counter()
    at_header: dict[str, Counter] = {}
    i, steps = labels[outer] + 1, 0
    while i < len(lines) and steps < 4 * len(lines):
        steps += 1
        line = lines[i]
        m = LABEL.match(line.strip())
        if m and m.group(1) == outer:  # the latch fell through into the header: one iteration done
            break
        if m and m.group(1) in inner:
            at_header[m.group(1)] = Counter(counts)
        branch = BRANCH.search(line)
        if branch:
            target, conditional = branch.group(1), line.strip().startswith("@")
            if target == outer:
                break
            if conditional and target in at_header and labels[target] < i:  # an inner loop's back edge
                body = counts - at_header[target]
                trips = trip_count(lines, Loop(labels[target], i))
                for kind, n in body.items():
                    counts[kind] += n * (trips - 1)
                i += 1
            elif conditional:
                i = labels[target] if enters_inner_loop(lines, i + 1, inner) else i + 1
            else:
                i = labels[target]
            continue
        op = opcode(line)
        if op is not None:
            for kind in classify(op):
                counts[kind] += 1
            counts["all"] += 1
        i += 1
    return counts


def resident_warps(registers: int, shared: int, warps: int, arch: str) -> int:
    """Warps per SM that registers (65,536, allocated per warp in units of 256), shared memory (1 KiB reserved per
    block) and the 64-warp limit allow, for programs of ``warps`` warps."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // max(1, per_warp * warps)
    by_shared = SHARED_PER_SM[arch] // (shared + 1024)
    return min(by_registers, by_shared, 64 // warps, 32) * warps


def kernel_jobs(design: str, head_dim: int) -> list[tuple[str, int]]:
    """``(kernel, part)`` of a design's forward and backward launches."""
    if design == "baseline":
        from polar_vit_hf.benchmarks.attention_baseline import kv_parts

        return [("fwd", 0), ("bwd_q", 0), *(("bwd_kv", part) for part in kv_parts(head_dim))]
    from polar_vit_hf.modeling.triton_attention import kv_parts

    return [("fwd", 0), ("bwd_dq", 0), *(("bwd_dkdv", part) for part in kv_parts(head_dim))]


def kernel_row(design: str, kernel: str, part: int, head_dim: int, arch: str) -> dict:
    """One kernel's PTX and ptxas figures per pair."""
    from polar_vit_hf.benchmarks.triton_report import assemble, compile_ptx, kernel_launch

    if design == "baseline":
        from polar_vit_hf.benchmarks import attention_baseline as B

        config = B.launch_config(kernel, head_dim)
        fn = B.KERNELS[kernel]
        constexprs = dict(
            D=head_dim, D_PAD=B.padded_head_dim(head_dim), BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"]
        )
        if kernel == "bwd_kv":
            constexprs["PART"] = part
        options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    else:
        fn, constexprs, options, config = kernel_launch(kernel, head_dim, part, design)
    compiled, ptx, _ = compile_ptx(fn, constexprs, options, arch)
    ptxas = assemble(ptx, arch)
    counts = main_loop_counts(ptx)
    threads = 32 * config["num_warps"]
    per_pair = threads / (config["BLOCK_M"] * config["BLOCK_N"])
    shared = int(compiled.metadata.shared)
    return dict(
        design=design,
        kernel=kernel if not part else f"{kernel}:{part}",
        head_dim=head_dim,
        arch=arch,
        blocks=f"{config['BLOCK_M']}x{config['BLOCK_N']}",
        warps=config["num_warps"],
        stages=config["num_stages"],
        registers=ptxas["registers"],
        spills=ptxas["spill_stores"] + ptxas["spill_loads"],
        shared=shared,
        resident_warps=resident_warps(ptxas["registers"], shared, config["num_warps"], arch),
        **{kind: round(counts[kind] * per_pair, 1) for kind in ("fp32", "fp64", "sfu", "loads", "mma", "shuffles")},
    )


def ptx_table(designs: list[str], head_dim: int, arch: str) -> list[dict]:
    """Every kernel of every design, then one total row per design (forward + backward)."""
    from tqdm.auto import tqdm

    jobs = [(design, kernel, part) for design in designs for kernel, part in kernel_jobs(design, head_dim)]
    rows = [kernel_row(design, kernel, part, head_dim, arch) for design, kernel, part in tqdm(jobs, desc="compiling")]
    totals = []
    for design in designs:
        own = [row for row in rows if row["design"] == design]
        total = dict(design=design, kernel="total", head_dim=head_dim, arch=arch, blocks="", warps="", stages="")
        total.update(registers=max(r["registers"] for r in own), spills=sum(r["spills"] for r in own), shared="")
        total["resident_warps"] = min(r["resident_warps"] for r in own)
        total["stages"] = min(r["stages"] for r in own)
        total["latency_hidden"] = all(r["stages"] >= 2 or r["resident_warps"] >= 16 for r in own)
        for kind in ("fp32", "fp64", "sfu", "loads", "mma", "shuffles"):
            total[kind] = round(sum(r[kind] for r in own), 1)
        totals.append(total)
    return rows + totals


def goals_met(total: dict) -> dict[str, bool]:
    """The PTX goals of a design's total row."""
    met = {kind: total[kind] <= limit for kind, limit in GOALS.items()}
    met["mma"] = total["mma"] > 0
    met["no spills"] = total["spills"] == 0
    met["latency hidden"] = total["latency_hidden"]
    return met


def print_ptx_table(rows: list[dict]) -> None:
    columns = ("design", "kernel", "blocks", "warps", "stages", "registers", "spills", "resident_warps")
    columns += ("fp32", "fp64", "sfu", "loads", "mma", "shuffles")
    widths = {c: max(len(c), *(len(str(row[c])) for row in rows)) for c in columns}
    print(f"per query-key pair, D = {rows[0]['head_dim']}, PTX for {rows[0]['arch']}")
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).rjust(widths[c]) for c in columns))
    for row in rows:
        if row["kernel"] == "total":
            met = goals_met(row)
            verdict = ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in met.items())
            print(
                f"goals ({row['design']}; fp32 <= {GOALS['fp32']}, sfu <= {GOALS['sfu']}, loads <= {GOALS['loads']}, "
                f"tensor cores, no spills, every kernel 2 stages or 16 warps per SM): {verdict}"
            )


def time_step(run, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``run`` after one warm-up (CUDA-synchronised)."""
    import torch

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def timing_table(sizes: list[int], batch: int, heads: int, head_dim: int, repeats: int) -> list[dict]:
    """Forward + backward milliseconds of the polar kernels and SDPA per sequence length (CUDA)."""
    import torch
    from tqdm.auto import tqdm

    from polar_vit_hf.benchmarks.attention_baseline import baseline_polar_attention
    from polar_vit_hf.benchmarks.attention_speed import make_inputs
    from polar_vit_hf.modeling.triton_attention import default_chords, triton_polar_attention

    device = torch.device("cuda")
    design = default_chords(device)
    rows = []
    for n in tqdm(sizes, desc="timing", unit="N"):
        inputs = make_inputs(batch, heads, n, head_dim, device)
        half = [t.detach().bfloat16().requires_grad_(True) for t in inputs]

        def polar(attention, args=inputs):
            def run():
                for t in args:
                    t.grad = None
                r, u = attention(*args[:6], args[6], 1.0)
                (r.sum() + u.sum()).backward()

            return run

        def sdpa(args):
            def run():
                for t in args:
                    t.grad = None
                torch.nn.functional.scaled_dot_product_attention(args[1], args[3], args[5]).sum().backward()

            return run

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        new_ms = time_step(polar(triton_polar_attention), repeats)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        baseline_ms = time_step(polar(baseline_polar_attention), repeats)
        sdpa_ms = time_step(sdpa(inputs), repeats)
        flash_ms = time_step(sdpa(half), repeats)
        pairs = batch * heads * n * n
        rows.append(
            dict(
                n=n,
                design=design,
                polar_ms=round(new_ms, 3),
                baseline_ms=round(baseline_ms, 3),
                sdpa_fp32_ms=round(sdpa_ms, 3),
                sdpa_bf16_ms=round(flash_ms, 3),
                polar_vs_sdpa=round(new_ms / sdpa_ms, 2),
                baseline_vs_sdpa=round(baseline_ms / sdpa_ms, 2),
                ps_per_pair=round(1e9 * new_ms / pairs, 1),
                peak_mib=round(peak, 1),
            )
        )
    return rows


def print_timing_table(rows: list[dict]) -> None:
    import torch

    print(f"forward + backward on {torch.cuda.get_device_name()} (float32; SDPA bf16 for reference)")
    columns = list(rows[0])
    print("  ".join(c.rjust(12) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).rjust(12) for c in columns))


def write_csv(rows: list[dict], path: Path) -> None:
    """The rows, with every column any row has."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)


def plot(ptx_rows: list[dict], timing_rows: list[dict] | None, path: Path) -> None:
    """Per-pair instructions of each design's total (and the time against SDPA on a GPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals = [row for row in ptx_rows if row["kernel"] == "total"]
    kinds = ("fp32", "fp64", "sfu", "loads", "mma", "shuffles")
    panels = 2 if timing_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(totals)
    for i, row in enumerate(totals):
        ax.bar([k + i * width for k in range(len(kinds))], [row[kind] for kind in kinds], width, label=row["design"])
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
    ax.set_yscale("symlog")
    ax.set_ylabel("instructions per pair (fwd + bwd)")
    ax.set_title(f"PTX {totals[0]['arch']}, D = {totals[0]['head_dim']}")
    ax.legend()
    if timing_rows:
        ax = axes[0][1]
        sizes = [row["n"] for row in timing_rows]
        for key in ("polar_vs_sdpa", "baseline_vs_sdpa"):
            ax.plot(sizes, [row[key] for row in timing_rows], marker="o", label=key)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("time / SDPA float32")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--arch", choices=list(SHARED_PER_SM), default="sm_90")
    parser.add_argument("--designs", nargs="+", choices=DESIGNS, default=list(DESIGNS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[196, 256, 1024, 4096, 8192])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-timing", action="store_true", help="the PTX table only, even on a GPU")
    parser.add_argument("--out", default="outputs/attention_kernel")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ptx_rows = ptx_table(args.designs, args.head_dim, args.arch)
    print_ptx_table(ptx_rows)
    write_csv(ptx_rows, out / "attention_kernel_ptx.csv")
    timing_rows = None
    if torch.cuda.is_available() and not args.no_timing:
        timing_rows = timing_table(args.sizes, args.batch, args.heads, args.head_dim, args.repeats)
        print_timing_table(timing_rows)
        write_csv(timing_rows, out / "attention_kernel_time.csv")
    else:
        print("no CUDA device: the time table needs one")
    plot(ptx_rows, timing_rows, out / "attention_kernel.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
