#!/usr/bin/env bash
# One-GPU check of mini3d (see benchmarks/gpu_check.py): mini3d train --device cuda --dtype bf16 at
# world size 1 on gpt2-small (124M parameters, 8 x 1024 tokens/step, fused sdpa attention as a real
# run would use; --attention explicit for the course's written-out core), tokens/s, MFU, peak memory vs
# the estimator, the step-time ratio to two plain PyTorch loops, and a torch.profiler table of 8
# mini3d steps; before it, a short strict-device bf16 ZeRO-1 `mini3d train` on CUDA. Under five
# minutes on an A100/H100/H200. Needs only torch (+ numpy, tqdm): mini3d is taken from this checkout, so it runs on a machine where nothing can be installed.
# 3. (benchmarks/gpu_llama.py) llama-3.2-1b (1.24B) in bf16 with sdpa and --compile: tokens/s, MFU,
# the compile warm-up, peak memory vs the estimator, and the ratio to a plain loop whose blocks are
# compiled the same way; its own RESULTS.md section. 4. (benchmarks/gpu_extras.py) host syncs per
# step, the fused ring-attention kernel and the step's timeline on CUDA events (issue #34). GPU_CHECK_CPU=1 runs all three sections'
# logic on this machine's CPU with tiny shapes (no GPU needed; the report goes to
# $GPU_CHECK_RESULTS, default a copy in /tmp, never into benchmarks/RESULTS.md).
# The report goes to stdout and into benchmarks/RESULTS.md's GPU section; the numbers to
# $GPU_CHECK_JSON. Extra arguments go to gpu_check.py (e.g. --peak-tflops 312 on a GPU without a
# preset). On a lent machine whose files come back only from $OUT:
#   GPU_CHECK_JSON=$OUT/gpu_check.json bash benchmarks/gpu_check.sh; cp benchmarks/RESULTS.md $OUT/
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$SECONDS
if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then  # the logic on a CPU, tiny shapes
    DEV=cpu RESULTS="${GPU_CHECK_RESULTS:-/tmp/mini3d_gpu_check_cpu_RESULTS.md}"
    cp benchmarks/RESULTS.md "$RESULTS"
    STRICT_MODEL=(--model tiny --seq-len 64) GPT2=(--tiny --peak-tflops 0.1) LLAMA=(--tiny --peak-tflops 0.1)
    EXTRAS=(--tiny)
else
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA GPU visible")'
    DEV=cuda RESULTS="${GPU_CHECK_RESULTS:-benchmarks/RESULTS.md}"
    STRICT_MODEL=(--model small --seq-len 256)
    GPT2=(--model gpt2-small --seq-len 1024 --global-batch 8 --steps 12 --warmup 3 --profile-steps 8)
    LLAMA=() EXTRAS=()
fi
# 1. Strict-device mode on CUDA (MINI3D_STRICT_DEVICE=1: torch's default device is `meta`, so any
# tensor created without an explicit device fails at once), bf16 with ZeRO-1 at dp=1, through the
# NCCL backend with PyTorch's flight recorder on (mini3d train sets TORCH_FR_* / TORCH_NCCL_* for
# NCCL; its dumps would land in the run directory). About 30 s; its failure is reported, and the
# benchmark below still runs.
STRICT_DIR="${GPU_CHECK_STRICT_DIR:-/tmp/mini3d_gpu_check_strict}"
STRICT_RC=0
mkdir -p "$STRICT_DIR"  # --log-jsonl wants its directory to exist
MINI3D_STRICT_DEVICE=1 timeout 45 "$PY" -m mini3d train --device "$DEV" --dtype bf16 --zero 1 \
    --dp 1 "${STRICT_MODEL[@]}" --global-batch 8 --steps 5 --no-progress \
    --run-dir "$STRICT_DIR" --log-jsonl "$STRICT_DIR/strict_train.jsonl" || STRICT_RC=$?
echo "gpu_check.sh: strict-device bf16 ZeRO-1 train on $DEV: exit $STRICT_RC (log: $STRICT_DIR)"
# 2. The gpt2-small benchmark (gpu_check.py). 3. The Llama ~1B compiled check (gpu_llama.py:
# about 150 s on an H200, most of it inductor's compilation). All three stay under five minutes.
RC=0
timeout 100 "$PY" -m benchmarks.gpu_check --device "$DEV" --attention sdpa ${GPT2[@]+"${GPT2[@]}"} \
    --results "$RESULTS" --json "${GPU_CHECK_JSON:-/tmp/mini3d_gpu_check.json}" "$@" || RC=$?
LLAMA_RC=0
timeout 150 "$PY" -m benchmarks.gpu_llama --device "$DEV" ${LLAMA[@]+"${LLAMA[@]}"} --timeout 110 \
    --results "$RESULTS" --json "${GPU_LLAMA_JSON:-/tmp/mini3d_gpu_llama.json}" || LLAMA_RC=$?
echo "gpu_check.sh: llama-3.2-1b compiled check: exit $LLAMA_RC"
# 4. Issue #34's checks (benchmarks/gpu_extras.py, about 40 s): host syncs per step (the program's
# count and CUDA's sync debug mode), the fused ring-attention block against the explicit math, and
# the measured timeline on the GPU's clock (CUDA events: the actions' GPU times, not launch times).
EXTRAS_RC=0
timeout 120 "$PY" -m benchmarks.gpu_extras --device "$DEV" ${EXTRAS[@]+"${EXTRAS[@]}"} \
    --json "${GPU_EXTRAS_JSON:-/tmp/mini3d_gpu_extras.json}" || EXTRAS_RC=$?
echo "gpu_check.sh: syncs, fused ring and timeline check: exit $EXTRAS_RC; $((SECONDS - START)) s in all; report in $RESULTS"
exit $(( RC ? RC : (STRICT_RC ? STRICT_RC : (LLAMA_RC ? LLAMA_RC : EXTRAS_RC)) ))
