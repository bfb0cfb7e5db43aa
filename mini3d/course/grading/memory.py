"""Checks of the exercises count_params (chapter 00) and memory (chapter 01).

The ground truth is the real `mini3d.models.transformer.GPT` (its parameters counted) and the bytes per
parameter of mixed-precision AdamW as mini3d runs it (`mini3d.cost.memory.state_bytes`: fp32
gradients, 18 bytes), sharded per ZeRO stage.
"""

from __future__ import annotations

import dataclasses

from mini3d.config import ModelConfig
from mini3d.cost.memory import state_bytes
from mini3d.course.grading.core import Check, Exercise, expect


def _random_cfg(rng) -> ModelConfig:
    heads = rng.choice([1, 2, 4])
    return ModelConfig(rng.randint(1, 3), heads * rng.randint(2, 6), heads, rng.randint(5, 40),
                       rng.randint(4, 20), d_ff=rng.choice([0, rng.randint(3, 30)]))


def count_matches_model(ctx):
    from mini3d.models.transformer import GPT

    for _ in range(3):
        cfg = _random_cfg(ctx.rng)
        truth = sum(p.numel() for p in GPT(cfg).parameters())
        got = ctx.impl.count_params(cfg)
        expect(got == truth, f"count_params for {cfg}", f"{truth} (counted on mini3d.models.transformer.GPT)", got)


def count_70b(ctx):
    from mini3d.config import PRESETS

    # the GPT-style 70B shape (PRESETS["gpt-70b"] now names Llama-3.1-70B, another family)
    cfg = dataclasses.replace(PRESETS["gpt-22b"], n_layers=80, d_model=8192, n_heads=64,
                              vocab_size=32000, max_seq_len=4096, d_ff=36864, name="gpt-style-70b")
    got = ctx.impl.count_params(cfg)
    expect(got == cfg.n_params(), "count_params(a GPT-style 70B: 80 x 8192, d_ff 36864)",
           cfg.n_params(), got)


def min_gpus(ctx):
    for _ in range(5):
        n, gb, bpp = ctx.rng.randint(10**6, 10**11), ctx.rng.randint(10**8, 10**11), ctx.rng.choice([8, 16])
        truth = -(-n * bpp // gb)
        got = ctx.impl.min_gpus_for_model_states(n, gb, bpp)
        expect(got == truth, f"min_gpus_for_model_states({n}, {gb}, {bpp})",
               f"{truth} (round up: a partial GPU is a whole GPU)", got)



# the exercise's two training dtypes, by the estimator's one rule (float64 is a parity-debugging
# mode only): bf16 with mini3d's default fp32 gradients, 2 + 4 + 12 = 18 bytes
_PER = {dtype: dict(zip(("params", "grads", "optimizer"), state_bytes(dtype)))
        for dtype in ("float32", "bf16")}


def bytes_per_param_ok(ctx):
    for dtype, truth in _PER.items():
        got = ctx.impl.bytes_per_param(dtype)
        expect(got == truth, f"bytes_per_param({dtype!r})", truth, got)


def _zero_case(ctx, stage):
    for _ in range(3):
        n, dp, dtype = ctx.rng.randint(10**5, 10**10), ctx.rng.choice([2, 4, 8, 64]), ctx.rng.choice(list(_PER))
        shard = {0: set(), 1: {"optimizer"}, 2: {"optimizer", "grads"},
                 3: {"optimizer", "grads", "params"}}[stage]
        truth = {k: n * b / (dp if k in shard else 1) for k, b in _PER[dtype].items()}
        got = ctx.impl.zero_bytes_per_rank(n, dp, stage, dtype)
        ok = isinstance(got, dict) and set(got) == set(truth) and all(
            abs(got[k] - truth[k]) <= 1e-9 * truth[k] for k in truth)
        expect(ok, f"zero_bytes_per_rank({n}, dp={dp}, zero={stage}, {dtype!r})", truth, got)


def zero_stage(stage):
    return lambda ctx: _zero_case(ctx, stage)


EXERCISES = [
    Exercise("count_params", "00 why 70B does not fit", [
        Check("matches_model", 3, count_matches_model, "equals the parameter count of mini3d.models.transformer.GPT"),
        Check("gpt_70b", 1, count_70b, "the 70B preset"),
        Check("min_gpus", 1, min_gpus, "GPUs needed just for model states"),
    ]),
    Exercise("memory", "01 memory anatomy", [
        Check("bytes_per_param", 2, bytes_per_param_ok, "fp32 and mixed-precision AdamW bytes"),
        Check("zero0", 1, zero_stage(0), "no sharding"),
        Check("zero1", 1, zero_stage(1), "ZeRO-1 shards optimizer states"),
        Check("zero2", 1, zero_stage(2), "ZeRO-2 also shards gradients"),
        Check("zero3", 1, zero_stage(3), "ZeRO-3 also shards parameters"),
    ]),
]
