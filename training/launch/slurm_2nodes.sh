#!/usr/bin/env bash
# Polar-ViT-Small on ImageNet-1k (paper Table 2) on two nodes of 8 GPUs, one task per node:
#   sbatch training/launch/slurm_2nodes.sh /path/to/ILSVRC2012 runs/in1k-small
# Resubmitting the same command after a preemption or a time limit continues from the newest checkpoint.
#SBATCH --job-name=polar-vit-in1k
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
set -euo pipefail
DATA=${1:?usage: sbatch slurm_2nodes.sh DATA_DIR OUTPUT_DIR [extra pretrain flags]}
OUT=${2:?usage: sbatch slurm_2nodes.sh DATA_DIR OUTPUT_DIR [extra pretrain flags]}
shift 2
NODE0=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RESUME=()
if [ -d "$OUT/checkpoints" ]; then RESUME=(--resume); fi
# one accelerate launcher per node; each starts 8 processes, one per GPU
srun --kill-on-bad-exit=1 bash -c "accelerate launch --config_file training/launch/accelerate_2nodes.yaml \
    --machine_rank \$SLURM_NODEID --main_process_ip $NODE0 --main_process_port 29500 \
    -m polar_vit_hf.training.pretrain --recipe imagenet1k --data_dir $DATA --output_dir $OUT \
    --num_workers 8 ${RESUME[*]} $*"
