"""Registers, spills and shared memory of the Triton attention kernels, compiled for a GPU without one.

Run:  python benchmarks/triton_report.py [--head-dims 16 32 64 128] [--arch sm_90 sm_80] [--out DIR]

Every kernel of ``modeling/triton_kernels.py`` (forward, backward dq, backward dk/dv; for wide
heads the dk/dv kernel is two launches, ``bwd_k`` and ``bwd_v``) is compiled
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


def compile_kernel(kernel: str, head_dim: int, arch: str, part: int = 0) -> dict:
    """Compile one kernel for ``arch`` with its default launch configuration; the ptxas figures.

    ``part``: the ``PART`` of the dk/dv kernel (``triton_attention.kv_parts``).
    """
    import torch  # noqa: F401  (triton's compiler expects torch to be imported first)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from polar_vit_hf.modeling import triton_attention as T
    from polar_vit_hf.modeling.triton_kernels import KERNELS

    config = T.launch_config(kernel, head_dim)
    fn = KERNELS[kernel]
    constexprs = dict(
        D=head_dim, D_PAD=T.padded_head_dim(head_dim), BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"]
    )
    if kernel == "bwd_kv":
        constexprs["PART"] = part
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INTEGER_ARGS:
            signature[name] = "i32"
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "*fp32"
    capability, ptx_arch = ARCHS[arch]
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", capability, 32),
        options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]),
    )
    seconds = time.perf_counter() - start
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        done = subprocess.run(
            [str(ptxas), f"-arch={ptx_arch}", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    info = done.stderr + done.stdout
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else 0  # noqa: E731
    label = {0: kernel, 1: "bwd_k", 2: "bwd_v"}[part]
    return dict(
        kernel=label,
        head_dim=head_dim,
        arch=arch,
        block_m=config["BLOCK_M"],
        block_n=config["BLOCK_N"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack=number(r"(\d+) bytes stack frame"),
        shared=int(compiled.metadata.shared),
        compile_s=round(seconds, 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--arch", nargs="+", choices=list(ARCHS), default=["sm_90", "sm_80"])
    parser.add_argument("--kernels", nargs="+", choices=["fwd", "bwd_q", "bwd_kv"], default=["fwd", "bwd_q", "bwd_kv"])
    parser.add_argument("--out", default="outputs/triton_report")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter
    from tqdm.auto import tqdm

    from polar_vit_hf.modeling.triton_attention import kv_parts

    jobs = [
        (kernel, dim, arch, part)
        for arch in args.arch
        for dim in args.head_dims
        for kernel in args.kernels
        for part in (kv_parts(dim) if kernel == "bwd_kv" else (0,))
    ]
    rows = [compile_kernel(*job) for job in tqdm(jobs, desc="compiling", unit="kernel")]
    header = (
        f"{'kernel':<7} {'D':>4} {'arch':<6} {'blocks':>7} {'warps':>5} {'stages':>6} {'regs':>5} "
        f"{'spill st/ld (B)':>16} {'stack':>6} {'smem (B)':>9} {'compile':>8}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['kernel']:<7} {row['head_dim']:>4} {row['arch']:<6} {row['block_m']:>3}x{row['block_n']:<3} "
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
        print(f"SPILLS: {row['kernel']} D={row['head_dim']} {row['arch']}", file=sys.stderr)
    print(f"wrote {out / 'triton_report.csv'}")
    return 1 if spilling else 0


if __name__ == "__main__":
    raise SystemExit(main())
