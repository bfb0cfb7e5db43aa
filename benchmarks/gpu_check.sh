#!/usr/bin/env bash
# One-GPU check of mini3d (see benchmarks/gpu_check.py): mini3d train --device cuda --dtype bf16 at
# world size 1 on gpt2-small (124M parameters, 8 x 1024 tokens/step, fused sdpa attention as a real
# run would use; --attention explicit for the course's written-out core), tokens/s, MFU, peak memory vs
# the estimator, the step-time ratio to two plain PyTorch loops, and a torch.profiler table of 8
# mini3d steps; before it, a short strict-device bf16 ZeRO-1 `mini3d train` on CUDA. Under five
# minutes on an A100/H100/H200. Needs only torch (+ numpy, tqdm): mini3d is taken from this checkout, so it runs on a machine where nothing can be installed.
# The report goes to stdout and into benchmarks/RESULTS.md's GPU section; the numbers to
# $GPU_CHECK_JSON. Extra arguments go to gpu_check.py (e.g. --peak-tflops 312 on a GPU without a
# preset). On a lent machine whose files come back only from $OUT:
#   GPU_CHECK_JSON=$OUT/gpu_check.json bash benchmarks/gpu_check.sh; cp benchmarks/RESULTS.md $OUT/
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA GPU visible")'
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# 1. Strict-device mode on CUDA (MINI3D_STRICT_DEVICE=1: torch's default device is `meta`, so any
# tensor created without an explicit device fails at once), bf16 with ZeRO-1 at dp=1, through the
# NCCL backend with PyTorch's flight recorder on (mini3d train sets TORCH_FR_* / TORCH_NCCL_* for
# NCCL; its dumps would land in the run directory). About 30 s; its failure is reported, and the
# benchmark below still runs.
STRICT_DIR="${GPU_CHECK_STRICT_DIR:-/tmp/mini3d_gpu_check_strict}"
STRICT_RC=0
MINI3D_STRICT_DEVICE=1 timeout 60 "$PY" -m mini3d train --device cuda --dtype bf16 --zero 1 \
    --dp 1 --model small --seq-len 256 --global-batch 8 --steps 5 --no-progress \
    --run-dir "$STRICT_DIR" --log-jsonl "$STRICT_DIR/strict_train.jsonl" || STRICT_RC=$?
echo "gpu_check.sh: strict-device bf16 ZeRO-1 train on CUDA: exit $STRICT_RC (log: $STRICT_DIR)"
# 2. The benchmark (gpu_check.py); the two together stay under five minutes.
RC=0
timeout 230 "$PY" -m benchmarks.gpu_check --device cuda --model gpt2-small --seq-len 1024 \
    --global-batch 8 --steps 20 --warmup 3 --attention sdpa --profile-steps 8 \
    --results benchmarks/RESULTS.md \
    --json "${GPU_CHECK_JSON:-/tmp/mini3d_gpu_check.json}" "$@" || RC=$?
exit $(( RC ? RC : STRICT_RC ))
