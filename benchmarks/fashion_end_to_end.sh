#!/usr/bin/env bash
# Fashion-MNIST end to end, with the installed console scripts:
#   pretrain -> export -> verify -> pipeline("image-classification") on real test images -> finetune on the digits.
#
# Usage: benchmarks/fashion_end_to_end.sh [OUT_DIR]      (default outputs/fashion_end_to_end)
# Environment: DATA_DIR (the four IDX files; default: Debian's location or the package cache),
#              STEPS (pretraining steps, default 900), LR (default 3e-2, Polar-ViT's tuned rate in
#              benchmarks/fashion_accuracy.py), FINETUNE_STEPS (default 150).
# About 15 minutes on 2 cores with the defaults; every step's log is kept under OUT_DIR.
set -euo pipefail
OUT=${1:-outputs/fashion_end_to_end}
STEPS=${STEPS:-900}
LR=${LR:-3e-2}
FINETUNE_STEPS=${FINETUNE_STEPS:-150}
DATA=()
if [[ -n "${DATA_DIR:-}" ]]; then DATA=(--data_dir "$DATA_DIR"); fi
mkdir -p "$OUT"
step() { echo; echo "== $1"; shift; echo "\$ $*"; "$@" 2>&1 | tee -a "$OUT/log.txt" | grep -v "it/s\]" || true; }

rm -rf "$OUT/pretrain" "$OUT/export" "$OUT/finetune"
step "1. pretrain Polar-ViT (fashion-cpu) on the 60,000 training images" \
  polar-vit-pretrain --recipe fashion-mnist --arch polar --output_dir "$OUT/pretrain" --max_steps "$STEPS" \
  --eval_steps "$STEPS" --save_steps "$STEPS" --lr "$LR" --no_progress "${DATA[@]}"
step "2. export the run as a Hub folder (safetensors, config, processor, remote code, model card)" \
  polar-vit-export "$OUT/pretrain" "$OUT/export"
step "3. verify the folder (reload, remote code, logits)" polar-vit-verify "$OUT/export"
step "4. pipeline('image-classification') on real test images" \
  python -m polar_vit_hf.benchmarks.fashion_pipeline "$OUT/export" --out "$OUT" "${DATA[@]}"
step "5. fine-tune the exported checkpoint on the digits with transformers' Trainer" \
  polar-vit-finetune --model "$OUT/export" --dataset digits --output_dir "$OUT/finetune" \
  --max_steps "$FINETUNE_STEPS" --per_device_batch_size 32 --grad_accum 1 --base_lr 0.05 --warmup_epochs 0.5 \
  --mixup 0 --cutmix 0 --rand_augment none --random_erasing 0 --crop_scale 1 --hflip 0 --drop_path 0 \
  --label_smoothing 0
grep -h "eval_accuracy\|accuracy" "$OUT/log.txt" | tail -n 4
echo "done: $OUT"
