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
    raise NotImplementedError('float32 AdamW keeps params, grads and two moments in fp32; bf16 keeps fp32 gradients and adds an fp32 master copy to the optimizer states')

def zero_bytes_per_rank(n_params: int, dp: int, zero: int, dtype: str='bf16') -> dict:
    """Model-state bytes on one data-parallel rank under ZeRO stage `zero` (0-3).

    Stage 1 shards the optimizer states over the dp ranks, stage 2 also the gradients, stage 3 also
    the parameters. A sharded category holds n_params / dp of them (use true division: a float)."""
    raise NotImplementedError('start from bytes_per_param(dtype); stage s shards the first s of (optimizer, grads, params) over dp')
