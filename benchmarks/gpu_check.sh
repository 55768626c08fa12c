#!/usr/bin/env bash
# GPU check of the fused polar attention, for the day a CUDA machine is lent. Installs nothing.
#  1. correctness: Triton forward + backward (and the chunked path) against the float64 eager
#     reference, head widths 16 and 64, N = 100 and 256 (non-multiples of the block size);
#  2. timing and peak memory of forward + backward: triton vs eager polar vs Euclidean SDPA,
#     batch 8, 12 heads, head width 64, N = 256 ... 4096 (table + outputs/gpu_check/attention.png).
# Finishes in well under 5 minutes on one H100/H200-class GPU (most of it Triton compilation).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 290 "$PY" benchmarks/attention.py --device cuda --check --check-dims 16 64 \
    --sizes 256 512 1024 2048 4096 --repeats 10 --out outputs/gpu_check
