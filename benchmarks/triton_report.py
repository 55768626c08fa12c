"""Registers, spills and shared memory of the Triton attention kernels, compiled for a GPU without one.

Run:  python benchmarks/triton_report.py [--head-dims 16 32 64 128] [--arch sm_90 sm_80] [--chords gram difference]
          [--out DIR]

Every kernel of ``modeling/triton_kernels.py`` (forward, backward dq, backward dk/dv; for wide
heads the dk/dv kernel is two launches, ``bwd_dk`` and ``bwd_dv``), with either chord design, is compiled
with its default launch configuration (``triton_attention.launch_config``: the very values a launch
uses) for the target by ``triton.compile`` (``GPUTarget``), and its PTX is assembled by the ``ptxas``
inside the triton wheel with ``-v``.  Prints, per kernel, head width and architecture: blocks,
warps, stages, registers per thread, spill stores / loads (bytes), stack frame, shared memory and
compile time; writes ``triton_report.csv``.  Exits 1 if any default configuration spills.
No GPU and no CUDA driver are needed.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARCHS = {"sm_90": (90, "sm_90a"), "sm_80": (80, "sm_80")}
INTEGER_ARGS = ("n_q", "n_k", "heads")
FLOAT_ARGS = ("sqrt_k", "k_val")
FLOAT64_ARGS = ("HQ", "HK", "HV", "HHAT")  # the Gram chords' half squared norms


def compile_ptx(fn, constexprs: dict, options: dict, arch: str):
    """``(compiled kernel, PTX text, seconds)`` of the Triton function ``fn`` for ``arch`` (``triton.compile`` with a
    ``GPUTarget``: no GPU needed); its other arguments are float32 pointers, ``FLOAT64_ARGS`` float64 pointers."""
    import torch  # noqa: F401  (triton's compiler expects torch to be imported first)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INTEGER_ARGS:
            signature[name] = "i32"
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "*fp64" if name in FLOAT64_ARGS else "*fp32"
    capability, _ = ARCHS[arch]
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", capability, 32),
        options=options,
    )
    return compiled, compiled.asm["ptx"], time.perf_counter() - start


def assemble(ptx: str, arch: str) -> dict[str, int]:
    """Registers per thread, spill stores / loads (bytes) and stack frame of ``ptx`` assembled for ``arch`` by the
    ``ptxas`` inside the triton wheel (``-v``)."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run(
            [str(ptxas), f"-arch={ARCHS[arch][1]}", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    info = done.stderr + done.stdout
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else 0  # noqa: E731
    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack=number(r"(\d+) bytes stack frame"),
    )


def kernel_launch(kernel: str, head_dim: int, part: int = 0, chords: str = "gram"):
    """``(Triton function, compile-time constants, launch options, launch configuration)`` of one kernel of
    ``modeling/triton_kernels.py`` with its default launch configuration and the products' precisions of sm_80 and
    newer (the values a launch there uses)."""
    from polar_vit_hf.modeling import triton_attention as T
    from polar_vit_hf.modeling.triton_kernels import KERNELS

    config = T.launch_config(kernel, head_dim, chords=chords)
    constexprs = dict(
        **T.kernel_constants(head_dim, chords, T.DotPrecisions("bf16x6", "tf32x3"), kernel),
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
    )
    if kernel == "bwd_dkdv":
        constexprs["PART"] = part
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    return KERNELS[kernel], constexprs, options, config


def compile_kernel(kernel: str, head_dim: int, arch: str, part: int = 0, chords: str = "gram") -> dict:
    """Compile one kernel for ``arch`` with its default launch configuration; the ptxas figures.

    ``part``: the ``PART`` of the dk/dv kernel (``triton_attention.kv_parts``); ``chords``: the chord design.
    """
    fn, constexprs, options, config = kernel_launch(kernel, head_dim, part, chords)
    compiled, ptx, seconds = compile_ptx(fn, constexprs, options, arch)
    label = {0: kernel, 1: "bwd_dk", 2: "bwd_dv"}[part]
    return dict(
        kernel=label,
        head_dim=head_dim,
        arch=arch,
        chords=chords,
        block_m=config["BLOCK_M"],
        block_n=config["BLOCK_N"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **assemble(ptx, arch),
        shared=int(compiled.metadata.shared),
        compile_s=round(seconds, 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--arch", nargs="+", choices=list(ARCHS), default=["sm_90", "sm_80"])
    parser.add_argument(
        "--kernels", nargs="+", choices=["fwd", "bwd_dq", "bwd_dkdv"], default=["fwd", "bwd_dq", "bwd_dkdv"]
    )
    parser.add_argument("--chords", nargs="+", choices=["gram", "difference"], default=["gram", "difference"])
    parser.add_argument("--out", default="outputs/triton_report")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter
    from tqdm.auto import tqdm

    from polar_vit_hf.modeling.triton_attention import kv_parts

    jobs = [
        (kernel, dim, arch, part, chords)
        for chords in args.chords
        for arch in args.arch
        for dim in args.head_dims
        for kernel in args.kernels
        for part in (kv_parts(dim) if kernel == "bwd_dkdv" else (0,))
    ]
    rows = [compile_kernel(*job) for job in tqdm(jobs, desc="compiling", unit="kernel")]
    header = (
        f"{'kernel':<8} {'chords':<10} {'D':>4} {'arch':<6} {'blocks':>7} {'warps':>5} {'stages':>6} {'regs':>5} "
        f"{'spill st/ld (B)':>16} {'stack':>6} {'smem (B)':>9} {'compile':>8}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['kernel']:<8} {row['chords']:<10} {row['head_dim']:>4} {row['arch']:<6} "
            f"{row['block_m']:>3}x{row['block_n']:<3} "
            f"{row['num_warps']:>5} {row['num_stages']:>6} {row['registers']:>5} "
            f"{row['spill_stores']:>8}/{row['spill_loads']:<7} {row['stack']:>6} {row['shared']:>9} "
            f"{row['compile_s']:>7.1f}s"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "triton_report.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    spilling = [row for row in rows if row["spill_stores"] or row["spill_loads"]]
    for row in spilling:
        print(f"SPILLS: {row['kernel']} {row['chords']} D={row['head_dim']} {row['arch']}", file=sys.stderr)
    print(f"wrote {out / 'triton_report.csv'}")
    return 1 if spilling else 0


if __name__ == "__main__":
    raise SystemExit(main())
