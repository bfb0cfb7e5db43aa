"""The optimizer's settings over time (learning-rate schedule) and over parameters (weight decay).

Schedule. `LRSchedule.at(step)` is the learning rate of optimizer step `step` (0-based), a closed
form of the step alone, so a resumed run that knows the step continues the schedule exactly (the
schedule itself is stored in the checkpoint's meta, so a resume keeps it even if flags change):

    warmup   step < W:          lr * (step + 1) / W
    decay    t = clamp((step - W) / (D - W), 0, 1), D = decay_steps
             constant: lr;  linear: lr - (lr - min_lr) t;  cosine: min_lr + (lr - min_lr)(1 + cos pi t)/2

Weight decay. As in Megatron-LM and nanoGPT, decoupled weight decay applies to the weight matrices
only: not to biases and LayerNorm parameters (1-d), and not to the embeddings unless asked. The
optimizer sees flat shards (mini3d.dp: one master tensor per bucket, a ZeRO shard of it), which mix
matrices and biases, so torch's per-parameter groups cannot express it. Instead the inner AdamW runs
with weight_decay=0 and `WeightDecay` multiplies the decayed *ranges* of each master by
(1 - lr * wd) just before the update: exactly what AdamW does first for a decayed parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the optimizer step."""

    kind: str = "constant"  # constant, cosine or linear (after the warmup)
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 0  # linear warmup steps
    decay_steps: int = 1  # the step where the decay reaches min_lr
    min_lr: float = 0.0  # floor of the decay

    def at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        t = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)))
        if self.kind == "linear":
            return self.lr - (self.lr - self.min_lr) * t
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))

    def differs_from(self, other: "LRSchedule") -> bool:
        """Whether the two give different learning rates at some step (a constant schedule
        ignores decay_steps and min_lr)."""
        if self.kind == other.kind == "constant":
            return (self.lr, self.warmup_steps) != (other.lr, other.warmup_steps)
        return self != other

    def as_dict(self) -> dict:
        return dict(kind=self.kind, lr=self.lr, warmup_steps=self.warmup_steps,
                    decay_steps=self.decay_steps, min_lr=self.min_lr)


def decays(name: str, p: torch.Tensor, embeddings: set, decay_embeddings: bool) -> bool:
    """Whether parameter `p` gets weight decay: matrices yes, 1-d no, embeddings if asked."""
    if p.ndim < 2:
        return False
    return decay_embeddings or id(p) not in embeddings


class WeightDecay:
    """Decoupled weight decay on the decayed ranges of a ShardedOptimizer's flat masters."""

    def __init__(self, optimizer, module: nn.Module, weight_decay: float, decay_embeddings: bool):
        self.optimizer, self.wd = optimizer, weight_decay
        embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
        tied = any(getattr(getattr(m, "cfg", None), "tie_embeddings", False) for m in module.modules())
        embeddings |= {id(p) for n, p in module.named_parameters() if _is_embedding(n, tied)}
        names = {p: n for n, p in module.named_parameters()}
        sharded = optimizer.wrapper.strategy.shards_optimizer_states
        self.ranges = []  # per master: [(lo, hi)] within the master to decay
        for group, _, _ in optimizer.shards:
            lo, hi = (group.lo, group.hi) if sharded else (0, group.padded)
            spans = []
            for p, off in zip(group.params, group.offsets):
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a < b and decays(names.get(p, ""), p, embeddings, decay_embeddings):
                    spans.append((a - lo, b - lo))
            self.ranges.append(_merge(spans))

    @torch.no_grad()
    def apply(self, lr: float):
        """Multiply the decayed entries by (1 - lr * wd), as AdamW does before its update."""
        if self.wd == 0:
            return
        factor = 1.0 - lr * self.wd
        for master, spans in zip(self.optimizer.masters, self.ranges):
            for a, b in spans:
                master[a:b].mul_(factor)


def _is_embedding(name: str, tied: bool = False) -> bool:
    # tensor-parallel embeddings are not nn.Embedding subclasses: known by their reference names;
    # a tied head's copy on the last pipeline stage is the embedding (mini3d.models.transformer.canonical_name)
    return name.endswith(("wte.weight", "wpe.weight")) or (tied and name.endswith("head.out.weight"))


def _merge(spans: list) -> list:
    out = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


def adamw(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """mini3d's optimizer. On CUDA the fused kernel: one pass over each flat master instead of the
    default multi-tensor path's several elementwise kernels; on CPU torch's default (what the
    float32 parity tests compare with)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             fused=True if device.type == "cuda" else None)

__all__ = ["adamw", "LRSchedule", "SCHEDULES", "WeightDecay", "decays", "set_lr"]
