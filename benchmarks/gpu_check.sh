#!/usr/bin/env bash
# One-GPU check of mini3d (see benchmarks/gpu_check.py): mini3d train --device cuda --dtype bf16 at
# world size 1 on gpt2-small (124M parameters, 8 x 1024 tokens/step), tokens/s, MFU, peak memory vs
# the estimator, and the step-time ratio to a plain PyTorch loop. Under five minutes on an A100/H100.
# Extra arguments go to gpu_check.py (e.g. --peak-tflops 312 on a GPU without a preset).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA GPU visible")'
exec timeout 290 python -m benchmarks.gpu_check --device cuda --model gpt2-small --seq-len 1024 \
    --global-batch 8 --steps 20 --warmup 3 --results benchmarks/RESULTS.md \
    --json "${GPU_CHECK_JSON:-/tmp/mini3d_gpu_check.json}" "$@"
