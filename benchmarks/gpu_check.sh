#!/usr/bin/env bash
# One-GPU check of mini3d (see benchmarks/gpu_check.py): mini3d train --device cuda --dtype bf16 at
# world size 1 on gpt2-small (124M parameters, 8 x 1024 tokens/step, fused sdpa attention as a real
# run would use; --attention explicit for the course's written-out core), tokens/s, MFU, peak memory vs
# the estimator, the step-time ratio to two plain PyTorch loops, and a torch.profiler table of 8
# mini3d steps. Under five minutes on an A100/H100/H200. Needs only torch (+ numpy, tqdm): mini3d is
# taken from this checkout, so it runs on a machine where nothing can be installed.
# The report goes to stdout and into benchmarks/RESULTS.md's GPU section; the numbers to
# $GPU_CHECK_JSON. Extra arguments go to gpu_check.py (e.g. --peak-tflops 312 on a GPU without a
# preset). On a lent machine whose files come back only from $OUT:
#   GPU_CHECK_JSON=$OUT/gpu_check.json bash benchmarks/gpu_check.sh; cp benchmarks/RESULTS.md $OUT/
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA GPU visible")'
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 290 "$PY" -m benchmarks.gpu_check --device cuda --model gpt2-small --seq-len 1024 \
    --global-batch 8 --steps 20 --warmup 3 --attention sdpa --profile-steps 8 \
    --results benchmarks/RESULTS.md \
    --json "${GPU_CHECK_JSON:-/tmp/mini3d_gpu_check.json}" "$@"
