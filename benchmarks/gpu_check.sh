#!/usr/bin/env bash
# One-call GPU check of Polar-ViT: Triton kernels, correctness on CUDA, timings. Fetches nothing.
#
#   bash benchmarks/gpu_check.sh            # on a CUDA machine (the stage time limits add up to 9.7 minutes)
#   bash benchmarks/gpu_check.sh --compile-table  # the training-step table instead (limits add up to 9.8 min):
#                                           # tiny-cifar and small at batch 128, eager / compiled blocks /
#                                           # compiled blocks in a CUDA graph, fp32 and bf16 autocast
#   bash benchmarks/gpu_check.sh --kernel-table  # the attention kernels alone (limits add up to 9.7 min): their
#                                           # tests on CUDA (both chord designs), memcheck, the per-pair PTX and
#                                           # time table against SDPA and the baseline kernels, a timed tuning sweep
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: argument parsing, the install step (pip --dry-run),
#                                           # the skip logic and one kernel report; nothing runs on a GPU
#
# Needs python with torch, triton, transformers, pytest (no datasets / evaluate). Results (logs, CSV,
# PNG) go to $GPU_CHECK_DIR (default outputs/gpu_check/); where $OUT is set, also as one archive,
# $OUT/gpu_check.tar.gz (the profiler's traces left out). Compiled kernels are cached in .triton_cache/.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
TABLE=0
KERNELS=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --compile-table) TABLE=1 ;;
    --kernel-table) KERNELS=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run, --compile-table, --kernel-table or --help)" >&2
       exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_DIR:-outputs/gpu_check}
mkdir -p "$OUT_DIR"
export TRITON_CACHE_DIR="$PWD/.triton_cache"
# the fused layers' compiled GPU kernels: compiled by their test, loaded by the training step's benchmark
export POLAR_VIT_KERNEL_CACHE="${POLAR_VIT_KERNEL_CACHE:-$(mktemp -d)}"
unset TRITON_INTERPRET
START=$SECONDS
FAILED=()
stage() { echo; echo "== [$((SECONDS - START)) s] $*"; }

stage "install: pip install --no-index --no-deps --no-build-isolation -e ."
if [ "$DRY_RUN" = 1 ]; then
  "$PY" -m pip install --dry-run --no-index --no-deps --no-build-isolation -e . || exit 1
else
  timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi

stage "environment"
HAS_CUDA=$("$PY" -c "
import sys, torch, triton, transformers
cuda = torch.cuda.is_available()
where = torch.cuda.get_device_name() if cuda else 'no CUDA device'
print(f'torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}: {where}',
      file=sys.stderr)
print(int(cuda))") || exit 1
if [ "$HAS_CUDA" != 1 ] && [ "$DRY_RUN" != 1 ]; then
  echo "no CUDA device: run with --dry-run to check the script without one" >&2
  exit 1
fi
ARCH=$("$PY" -c "
import torch
major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
print('sm_90' if (major, minor) >= (9, 0) else 'sm_80')")

run_gpu() {  # run_gpu LABEL SECONDS COMMAND...: run it on the GPU (log in $OUT_DIR), or list it when there is none
  local label=$1 limit=$2
  shift 2
  stage "$label (limit ${limit} s)"
  if [ "$HAS_CUDA" != 1 ]; then
    echo "skipped, no GPU: $*"
    return 0
  fi
  timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$(echo "$label" | tr -c 'a-zA-Z0-9\n' '_').log"
  local status=${PIPESTATUS[0]}
  if [ "$status" != 0 ]; then
    echo "!! $label: exit status $status$([ "$status" = 124 ] && echo ' (time limit)')"
    FAILED+=("$label")
  fi
}

finish() {  # the summary, the archive under $OUT and the exit status
  stage "done in $((SECONDS - START)) s; results in $OUT_DIR"
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu_check.tar.gz" --exclude='*.json' -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
    echo "packed into $OUT/gpu_check.tar.gz"
  fi
  if [ ${#FAILED[@]} -gt 0 ]; then
    printf '!! failed: %s\n' "${FAILED[@]}"
    exit 1
  fi
  exit 0
}

if [ "$TABLE" = 1 ]; then
  # the fused layers as compiled blocks on a GPU (the training scripts' --compile), next to the same-shape ViT
  # under the same policy; each model's first step is its compile time
  export TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor_cache"
  run_gpu "compiled model on CUDA: one graph, eager's gradients, a CUDA graph" 90 \
    env POLAR_VIT_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -p no:logging tests/test_gpu_kernels.py \
    -k compiled_model
  for preset in tiny-cifar small; do
    for precision in none bf16; do
      run_gpu "step $preset batch 128 autocast $precision: eager and compiled blocks" 95 "$PY" \
        benchmarks/step_time.py --device cuda --preset "$preset" --batch 128 --repeats 5 --interleave \
        --autocast "$precision" --models euclidean euclidean-regional polar polar-regional \
        --out "$OUT_DIR/step_${preset}_${precision}"
    done
    run_gpu "step $preset batch 128: compiled blocks in a CUDA graph" 45 "$PY" benchmarks/step_time.py \
      --device cuda --preset "$preset" --batch 128 --repeats 5 --cuda-graph \
      --models euclidean-regional polar-regional --out "$OUT_DIR/step_${preset}_graph"
  done
  finish
fi

if [ "$KERNELS" = 1 ]; then
  # the polar attention kernels: correct on the device (both chord designs, half inputs), clean under memcheck,
  # their per-pair PTX figures and their time against SDPA and the baseline kernels, then the tuning sweep
  run_gpu "attention tests on CUDA" 150 \
    env POLAR_VIT_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -p no:logging tests/test_attention.py -k triton
  SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$SANITIZER" ]; then
    run_gpu "compute-sanitizer memcheck" 40 "$SANITIZER" --tool memcheck --error-exitcode 1 \
      "$PY" benchmarks/attention_speed.py --device cuda --sizes 100 --batch 1 --heads 2 --dim 16 --impls triton \
      --repeats 1 --out "$OUT_DIR/sanitizer"
  fi
  run_gpu "attention kernels: PTX per pair, time vs SDPA and the baseline" 240 "$PY" benchmarks/attention_kernel.py \
    --sizes 196 256 1024 4096 8192 --repeats 5 --out "$OUT_DIR/attention_kernel"
  run_gpu "launch configurations timed at D = 64, N = 1024" 140 "$PY" benchmarks/attention_tune.py --dim 64 \
    --size 1024 --blocks-m 16 32 64 --blocks-n 16 32 64 --warps 4 8 --stages 2 --repeats 3 --out "$OUT_DIR/tune"
  finish
fi

stage "registers and spills of the default launch configurations ($ARCH; no GPU needed)"
if [ "$DRY_RUN" = 1 ]; then
  "$PY" benchmarks/triton_report.py --head-dims 16 --arch "$ARCH" --kernels fwd --chords gram --out "$OUT_DIR" \
    || FAILED+=(report)
else
  timeout 40 "$PY" benchmarks/triton_report.py --head-dims 16 64 --arch "$ARCH" --chords gram --out "$OUT_DIR" \
    || FAILED+=("report (spills or time limit)")
fi

run_gpu "attention tests on CUDA" 60 \
  env POLAR_VIT_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -p no:logging tests/test_attention.py -k triton
run_gpu "compiled GPU kernels against eager and float64" 130 \
  env POLAR_VIT_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -p no:logging tests/test_gpu_kernels.py
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$SANITIZER" ]; then
  run_gpu "compute-sanitizer memcheck" 25 "$SANITIZER" --tool memcheck --error-exitcode 1 \
    "$PY" benchmarks/attention_speed.py --device cuda --sizes 100 --batch 1 --heads 2 --dim 16 --impls triton \
    --repeats 1 --out "$OUT_DIR/sanitizer"
else
  stage "compute-sanitizer memcheck"
  echo "skipped: compute-sanitizer is not on PATH or in /usr/local/cuda/bin"
fi
run_gpu "attention: triton vs eager vs SDPA" 40 "$PY" benchmarks/attention_speed.py --device cuda \
  --sizes 256 1024 4096 --impls eager triton sdpa --repeats 5 --out "$OUT_DIR/attention"
# the fused layers eagerly (the default on GPUs), then through the compiled GPU kernels (loaded from the test's)
run_gpu "training step tiny-cifar, eager and compiled GPU kernels" 150 env POLAR_VIT_GPU_KERNELS=1 \
  "$PY" benchmarks/step_time.py --device cuda --preset tiny-cifar --batch 64 --repeats 5 \
  --models euclidean polar polar-eager --out "$OUT_DIR/step_tiny-cifar"
# the same step captured as a CUDA graph: what is left once launches and Python cost nothing
run_gpu "training step tiny-cifar, compiled GPU kernels in a CUDA graph" 60 env POLAR_VIT_GPU_KERNELS=1 \
  "$PY" benchmarks/step_time.py --device cuda --preset tiny-cifar --batch 64 --repeats 5 \
  --models euclidean polar --cuda-graph --out "$OUT_DIR/step_tiny-cifar_graph"
run_gpu "profile of a tiny-cifar step, compiled GPU kernels" 45 env POLAR_VIT_GPU_KERNELS=1 \
  "$PY" benchmarks/profile_step.py --device cuda --preset tiny-cifar --batch 64 --top 30 --out "$OUT_DIR/profile"
finish
