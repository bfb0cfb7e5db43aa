"""Published step times the cost model is checked against (not fitted on, except the two
calibration rows of `mini3d.cost.calibration`, marked `fit`).

Each row: the source (paper, table, row), the model's shape, the layout, the batch and the
hardware, and what the source reports, turned into seconds per step with the source's own FLOP
count where it reports FLOP/s:

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21), Table 1 (weak scaling, A100-80GB Selene nodes of 8 GPUs with 8 x 200 Gb/s
  HDR InfiniBand, s=2048, V=51200, full activation recomputation, fp16). It reports teraFLOP/s per
  GPU counted as 96 B s l h^2 (1 + s/6h + V/16lh) per step (the full s x s attention square and
  the recomputed forward included), so step seconds = that count / (reported FLOP/s x GPUs). The
  table does not give the micro-batch size: every row here uses micro-batch 1 and 1F1B, the
  paper's recommendation for these sizes (its Figures 7-8), the data-parallel gradients reduced
  in fp32 at the end of the step (Megatron's local DDP of 2021).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 4 (end-to-end iteration time, A100-80GB, s=2048, V=51200, micro-batch 1, no data
  parallelism): sequence parallelism + selective recomputation ("present work"); the 22B and 175B
  rows are the calibration rows.
* torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3 (Llama 3.1 8B, FSDP
  = ZeRO-3, bf16 with fp32 gradient reduction, selective activation checkpointing, local batch 2,
  eager, no Float8; H100 at 500 W, sequence 8192, torchtitan's llama3_8b default): tokens/s per
  GPU, so step seconds = local batch x 8192 / TPS. torchtitan counts attention over the full
  square too (its 33.7% MFU is 6N + 12 l h s FLOPs per token).

Rows not included: MegaScale (Jiang et al. 2024) changes the model (parallel blocks, sliding
window attention, LAMB) and its table does not give each row's micro-batch and layout split in a
form the cost model can take; torchtitan's 70B / 405B rows use Float8, whose peak the model lacks.
"""

from __future__ import annotations

from mini3d.config import ModelConfig, Plan
from mini3d.cost.hardware import PRESETS as GPUS
from mini3d.cost.model import estimate_cost

A100, H100 = GPUS["A100-80GB"], GPUS["H100-80GB"]
SEQ, VOCAB = 2048, 51200

# Narayanan et al. 2021, Table 1: (name, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU)
MEGATRON_2021 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

# Korthikanti et al. 2022, Table 4, sequence parallelism + selective recompute:
# (name, heads, hidden, layers, tp, pp, virtual stages, GPUs, batch, seconds, calibration row?)
KORTHIKANTI_2022 = [
    ("22B", 64, 6144, 48, 8, 1, 1, 8, 4, 1.10, True),
    ("175B", 96, 12288, 96, 8, 8, 3, 64, 64, 13.75, True),
    ("530B", 128, 20480, 105, 8, 35, 1, 280, 280, 37.83, False),
    ("1T", 160, 25600, 128, 8, 64, 1, 512, 512, 71.49, False),
]

# torchtitan Llama 3.1 8B, FSDP: (GPUs, tokens/s per GPU, table)
TORCHTITAN_8B = [(8, 5762, "Table 1"), (128, 5605, "Table 3")]


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. (3): FLOPs of one step with full recomputation."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def published_rows() -> list[dict]:
    """Every row: name, source, model, plan, hardware, GPU count, published seconds, fit flag."""
    rows = []
    for name, a, h, l, tp, pp, n, batch, tflops in MEGATRON_2021:
        dp = n // (tp * pp)
        plan = Plan(tp=tp, pp=pp, dp=dp, global_batch=batch, micro_batches=batch // dp, seq_len=SEQ,
                    dtype="bf16", recompute="full")
        cfg = ModelConfig(l, h, a, VOCAB, SEQ, name=f"gpt-{name}")
        rows.append(dict(name=f"Megatron-LM {name}", source="Narayanan et al. 2021, Table 1", model=cfg,
                         plan=plan, hw=A100, n_gpus=n, fit=False,
                         published_s=megatron_flops(batch, SEQ, l, h, VOCAB) / (tflops * 1e12 * n)))
    for name, a, h, l, tp, pp, v, n, batch, seconds, fit in KORTHIKANTI_2022:
        mbs = 4 if name == "22B" else 1  # the table's micro-batch sizes
        plan = Plan(tp=tp, pp=pp, dp=1, global_batch=batch, micro_batches=batch // mbs, seq_len=SEQ, dtype="bf16",
                    sequence_parallel=True, recompute="selective", virtual_stages=v,
                    schedule="interleaved" if v > 1 else "1f1b")
        rows.append(dict(name=f"Korthikanti {name}", source="Korthikanti et al. 2022, Table 4",
                         model=ModelConfig(l, h, a, VOCAB, SEQ, name=f"gpt-{name}"), plan=plan, hw=A100,
                         n_gpus=n, fit=fit, published_s=seconds))
    from mini3d.config import PRESETS as MODELS

    for n, tps, table in TORCHTITAN_8B:
        plan = Plan(dp=n, zero=3, global_batch=2 * n, micro_batches=1, seq_len=8192, dtype="bf16",
                    recompute="none", attention="sdpa")  # flash recomputes the core anyway
        rows.append(dict(name=f"torchtitan Llama-3.1-8B, {n} GPUs", source=f"torchtitan H100 2024-12, {table}",
                         model=MODELS["llama-3.1-8b"], plan=plan, hw=H100, n_gpus=n, fit=n == 8,
                         published_s=2 * 8192 / tps))
    return rows


def published_errors(rows: list[dict] | None = None) -> list[dict]:
    """Predicted / published - 1 for every row, with the prediction's MFU and data-parallel width."""
    out = []
    for r in rows or published_rows():
        est = estimate_cost(r["model"], r["plan"], r["hw"], r["n_gpus"])
        out.append({"name": r["name"], "source": r["source"], "gpus": r["n_gpus"], "dp": r["plan"].dp,
                    "published_s": r["published_s"], "predicted_s": est.step_time_s, "mfu": est.mfu,
                    "error": est.step_time_s / r["published_s"] - 1, "fit": r["fit"]})
    return out


def fit_h100_efficiency() -> float:
    """eff_max of the H100 presets: the one that reproduces torchtitan's 8-GPU row (step time is
    linear in 1/eff: T = C / eff + R), at the A100's half width."""
    from mini3d.cost.calibration import matmul_compute_s
    from mini3d.cost.model import CALIBRATED, Efficiency

    r = next(r for r in published_rows() if r["fit"] and r["hw"].name.startswith("H100"))
    ideal = estimate_cost(r["model"], r["plan"], r["hw"], r["n_gpus"], eff=Efficiency(1.0, CALIBRATED.half_width))
    c = matmul_compute_s(ideal.breakdown)
    return c / (r["published_s"] - (ideal.step_time_s - c))


__all__ = ["fit_h100_efficiency", "published_rows", "published_errors", "megatron_flops", "MEGATRON_2021",
           "KORTHIKANTI_2022",
           "TORCHTITAN_8B"]
