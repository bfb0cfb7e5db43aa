"""A ZeRO stage as a strategy object: what it shards, how and when it reduces the gradients, and
how the parameters come back. One object per stage, registered in `dp.zero.STAGES`:

    stage   shards (1/dp per rank)                  reduces                               parameters come back
    0       nothing                                 all-reduce, once per step              (never sharded)
    1       optimizer states                        reduce-scatter, once per step          all-gather after the step
    2       optimizer states, gradients             reduce-scatter, every micro-batch      all-gather after the step
    3       optimizer states, gradients, parameters reduce-scatter, every micro-batch      all-gather per unit, forward and backward

Stages 0-2 keep the parameters in flat buckets (`ddp.DataParallel`, which asks its stage, a
`ddp.BucketStage`, for every stage-specific step: `zero0.py`, `zero1.py`, `zero2.py`); stage 3
gathers one unit at a time (`zero3.py`, `FullyShardedDP`). Why ZeRO-2/3 reduce every micro-batch:
zero.py, "Micro-batches under ZeRO-2/3". The collectives a step issues follow from these answers
(`collectives_per_step`); `mini3d.cost.comm_time` times them and states their traffic in Psi
(`zero_traffic_psi`, the one owner: 2, 2, M + 1, 3M).
"""

from __future__ import annotations

SHARDABLE = ("optimizer_states", "gradients", "parameters")
PARAM_GATHERS = ("never", "after_step", "per_unit")


class ZeroStage:
    """The answers every ZeRO stage gives; subclasses set the four class attributes."""

    number: int
    shards: tuple = ()  # which of SHARDABLE each rank keeps only 1/dp of
    reduce_op: str = "all_reduce"  # the gradient collective: "all_reduce" or "reduce_scatter"
    reduces_every_micro_batch: bool = False  # False: accumulate (no_sync), reduce once per step
    param_gather: str = "never"  # one of PARAM_GATHERS: how the parameters come back

    @property
    def shards_optimizer_states(self) -> bool:
        return "optimizer_states" in self.shards

    @property
    def shards_gradients(self) -> bool:
        return "gradients" in self.shards

    @property
    def shards_parameters(self) -> bool:
        return "parameters" in self.shards

    def shard_of(self, axis) -> tuple[int, int]:
        """(shard count, this rank's shard index) of a flat buffer over the dp `axis`: a stage that
        shards nothing keeps the whole buffer (no padding)."""
        return (axis.size, axis.index) if self.shards else (1, 0)

    def collectives_per_step(self, micro_batches: int) -> tuple[int, int]:
        """(gradient reductions, parameter all-gathers) of the whole model one rank issues per
        optimizer step with `micro_batches` micro-batches: one reduction per step, or one per
        micro-batch; no gather, one after the step, or one per micro-batch's forward and one per
        its backward. `mini3d.cost.comm_time` turns them into time and traffic (zero_traffic_psi)."""
        reductions = micro_batches if self.reduces_every_micro_batch else 1
        gathers = {"never": 0, "after_step": 1, "per_unit": 2 * micro_batches}[self.param_gather]
        return reductions, gathers

    def __repr__(self):
        return (f"ZeRO-{self.number}(shards={list(self.shards)}, {self.reduce_op} "
                f"{'every micro-batch' if self.reduces_every_micro_batch else 'once per step'}, "
                f"param gather {self.param_gather})")
