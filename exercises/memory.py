"""Exercise memory: bytes per parameter for training, and what ZeRO leaves on each rank.

Chapter: 01 memory anatomy (course/01_memory_anatomy.ipynb); ZeRO sharding is chapter 03.
"""
from __future__ import annotations

def bytes_per_param(dtype: str) -> dict:
    """Bytes of each model-state category per parameter when training with AdamW.

    float32: params 4, grads 4, optimizer 8 (exp_avg and exp_avg_sq in fp32).
    bf16 (mixed precision): params 2, grads 2, optimizer 12 (fp32 master copy + exp_avg + exp_avg_sq).
    Returns {"params": .., "grads": .., "optimizer": ..}."""
    raise NotImplementedError('float32 AdamW keeps params, grads and two moments in fp32; bf16 adds an fp32 master copy to the optimizer states')

def zero_bytes_per_rank(n_params: int, dp: int, zero: int, dtype: str='bf16') -> dict:
    """Model-state bytes on one data-parallel rank under ZeRO stage `zero` (0-3).

    Stage 1 shards the optimizer states over the dp ranks, stage 2 also the gradients, stage 3 also
    the parameters. A sharded category holds n_params / dp of them (use true division: a float)."""
    raise NotImplementedError('start from bytes_per_param(dtype); stage s shards the first s of (optimizer, grads, params) over dp')
