"""Exercise memory: bytes per parameter for training, and what ZeRO leaves on each rank.

Chapter: 01 memory anatomy (course/01_memory_anatomy.ipynb); ZeRO sharding is chapter 03.
"""

from __future__ import annotations


def bytes_per_param(dtype: str) -> dict:
    """Bytes of each model-state category per parameter when training with AdamW.

    float32: params 4, grads 4, optimizer 8 (exp_avg and exp_avg_sq in fp32).
    bf16 (mixed precision, as mini3d runs it): params 2, grads 4 (accumulated and reduced in fp32,
    as Megatron and FSDP do by default), optimizer 12 (fp32 master copy + exp_avg + exp_avg_sq):
    18 bytes. The ZeRO paper's 16 (2 + 2 + 12) assumes bf16 gradients (`--grad-dtype bf16`).
    Returns {"params": .., "grads": .., "optimizer": ..}."""
    if dtype == "float32":
        return {"params": 4, "grads": 4, "optimizer": 8}
    if dtype == "bf16":
        return {"params": 2, "grads": 4, "optimizer": 12}
    raise ValueError(f"dtype={dtype!r} is unknown (choose float32 or bf16)")


def zero_bytes_per_rank(n_params: int, dp: int, zero: int, dtype: str = "bf16") -> dict:
    """Model-state bytes on one data-parallel rank under ZeRO stage `zero` (0-3).

    Stage 1 shards the optimizer states over the dp ranks, stage 2 also the gradients, stage 3 also
    the parameters. A sharded category holds n_params / dp of them (use true division: a float)."""
    per = bytes_per_param(dtype)
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"),
               3: ("optimizer", "grads", "params")}[zero]
    return {k: n_params * b / (dp if k in sharded else 1) for k, b in per.items()}
