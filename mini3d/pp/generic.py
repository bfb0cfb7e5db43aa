"""Pipeline stages from ANY sequential stack of blocks (a model defined outside mini3d).

mini3d's own GPT is cut into stages by `partition.build_stages`. A user's model only needs to be a
list of blocks applied one after the other (`x = block(x)` for each) plus a loss on the output:

    blocks = list(my_model.layers)                       # every rank builds the same model
    stages = stages_from_blocks(blocks, topo.pp.index, topo.pp.size, loss_fn=my_loss)
    runtime = PipelineRuntime(stages, make_schedule("1f1b", p, m), topo, act_shape=(b, d))
    result = runtime.step([(x0, y0), (x1, y1), ...])     # gradients accumulate in .grad

`stages_from_blocks` keeps only this pipeline rank's blocks (split by `partition_layers`, so the same
balanced / explicit `boundaries` rules apply); the other blocks are simply not referenced any more.
The runtime's contract is all a stage must follow: the first stage takes the micro-batch input, a
middle stage maps activations to activations of the fixed shape `act_shape`, the last stage returns
the micro-batch's (mean) loss when given the targets.
"""

from __future__ import annotations

import torch.nn as nn

from mini3d.pp.partition import local_specs


class BlockStage(nn.Module):
    """Consecutive blocks of a user's model; the last stage also applies `loss_fn(output, targets)`.

    `block_ids` are the blocks' indices in the full stack, so `full_names()` can name every
    parameter as the full model does (e.g. `layers.3.up.weight` for `prefix="layers."`)."""

    def __init__(self, blocks, block_ids, loss_fn=None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.block_ids = list(block_ids)
        self.loss_fn = loss_fn

    def forward(self, x, targets=None):
        for block in self.blocks:
            x = block(x)
        if self.loss_fn is not None and targets is not None:
            return self.loss_fn(x, targets)
        return x

    def full_names(self, prefix: str = "") -> dict:
        """{parameter: its name in the full model}, e.g. {p: "layers.3.up.weight"}."""
        out = {}
        for local, block in zip(self.block_ids, self.blocks):
            for name, p in block.named_parameters():
                out[p] = f"{prefix}{local}.{name}"
        return out


def stages_from_blocks(blocks, pp_rank: int, p: int, v: int = 1, loss_fn=None,
                       boundaries=None, placement: str = "loop") -> dict:
    """{global stage id: BlockStage} for pipeline rank `pp_rank` (v chunks; `placement` "v" for
    the zbv schedule, see `placement.stage_rank`)."""
    blocks = list(blocks)
    out = {}
    for spec in local_specs(pp_rank, len(blocks), p, v, boundaries, placement):
        out[spec.stage] = BlockStage([blocks[i] for i in spec.layers], spec.layers,
                                     loss_fn if spec.last else None)
    return out


__all__ = ["BlockStage", "stages_from_blocks"]
