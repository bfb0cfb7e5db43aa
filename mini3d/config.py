"""Configuration as data: the model's shape (`ModelConfig`) and the parallel layout (`Plan`).

Everything else in mini3d reads these two frozen dataclasses: the launcher, the trainer, the
memory estimator, the cost model, the planner and the course widgets. `Plan.problems()` checks a
plan against a model once, and names every offending value together with what would fit, so that
`mini3d train` can refuse bad input (exit status 2) before a single process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv")  # = mini3d.pp KINDS
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("float32", "bf16")
ATTENTION = ("explicit", "sdpa")


class PlanError(ValueError):
    """A plan that cannot run; the message names each offending value and what would fit."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid plan: " + "; ".join(self.problems))


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT (pre-LayerNorm, causal attention, GELU MLP, untied head)."""

    n_layers: int = 4  # transformer blocks
    d_model: int = 64  # hidden size h
    n_heads: int = 4  # attention heads a (d_model % n_heads == 0)
    vocab_size: int = 256  # V; byte-level tokenizer by default
    max_seq_len: int = 128  # length of the learned position table
    d_ff: int = 0  # MLP width; 0 means 4 * d_model
    name: str = "custom"  # preset name, for reports

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_params(self) -> int:
        """Exact parameter count of `mini3d.model.GPT` for this shape (biases and LayerNorms included)."""
        h, f, V, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        per_layer = (
            2 * h  # ln1 weight + bias
            + 3 * h * h + 3 * h  # qkv
            + h * h + h  # attention out-projection
            + 2 * h  # ln2
            + h * f + f  # MLP up
            + f * h + h  # MLP down
        )
        return V * h + self.max_seq_len * h + L * per_layer + 2 * h + V * h

    def problems(self) -> list[str]:
        out = []
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", "d_ff"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append(f"n_heads={self.n_heads} does not divide d_model={self.d_model} "
                       f"(choose n_heads in {_divisors(self.d_model)[:12]})")
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Presets: `tiny` trains on a laptop CPU in minutes; the others are well-known shapes used by the
# estimator and planner (the 22B and 175B rows are those of Korthikanti et al. 2022; `gpt-70b`
# widens the MLP so that this GPT-style model holds ~70e9 parameters like Llama-2-70B).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(4, 64, 4, 256, 128, name="tiny"),
    "small": ModelConfig(6, 256, 8, 256, 256, name="small"),
    "gpt2-small": ModelConfig(12, 768, 12, 50257, 1024, name="gpt2-small"),
    "gpt-1.3b": ModelConfig(24, 2048, 16, 50257, 2048, name="gpt-1.3b"),
    "gpt-7b": ModelConfig(32, 4096, 32, 32000, 4096, name="gpt-7b"),
    "gpt-22b": ModelConfig(48, 6144, 64, 51200, 2048, name="gpt-22b"),
    "gpt-70b": ModelConfig(80, 8192, 64, 32000, 4096, d_ff=36864, name="gpt-70b"),
    "gpt-175b": ModelConfig(96, 12288, 96, 51200, 2048, name="gpt-175b"),
}


def model_from_preset(preset: str, **overrides) -> ModelConfig:
    """A preset, with any ModelConfig fields overridden."""
    if preset not in PRESETS:
        raise PlanError([f"model={preset!r} is not a preset (choose from {', '.join(PRESETS)})"])
    return dataclasses.replace(PRESETS[preset], **overrides) if overrides else PRESETS[preset]


@dataclass(frozen=True)
class Plan:
    """How one training step is split across tp * pp * dp processes."""

    tp: int = 1  # tensor-parallel degree (splits each layer's matrices; wants NVLink)
    pp: int = 1  # pipeline-parallel degree (splits the layers into stages)
    dp: int = 1  # data-parallel degree (replicas, or shards under ZeRO)
    zero: int = 0  # ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters
    schedule: str = "1f1b"  # pipeline schedule: gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zbv
    micro_batches: int = 1  # micro-batches per optimizer step on each dp replica
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved, looped-bfs; zbv: 2)
    recompute: str = "none"  # activation recomputation: none, selective or full
    dtype: str = "float32"  # float32, or bf16 with fp32 master weights
    global_batch: int = 8  # sequences per optimizer step, over all replicas
    seq_len: int = 64  # tokens per sequence
    sequence_parallel: bool = False  # shard LayerNorm/dropout regions along the sequence (tp > 1)
    bucket_mb: float = 1.0  # data-parallel gradient bucket size in MiB
    attention: str = "explicit"  # attention core: written out (keeps the s x s matrix) or torch's sdpa

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batch_size(self) -> int:
        """Sequences in one micro-batch on one replica."""
        return self.global_batch // (self.dp * self.micro_batches)

    def problems(self, model: ModelConfig, world_size: int | None = None) -> list[str]:
        """Every reason this plan cannot run `model`, each naming the values and what would fit."""
        out = list(model.problems())
        ints = ("tp", "pp", "dp", "micro_batches", "virtual_stages", "global_batch", "seq_len")
        bad_int = [n for n in ints if not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        out += [f"{n}={getattr(self, n)} must be a positive integer" for n in bad_int]
        if bad_int:
            return out
        if world_size is not None and world_size != self.world_size:
            out.append(f"world size {world_size} != tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = "
                       f"{self.world_size} (choose degrees whose product is {world_size})")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero={self.zero} is not a ZeRO stage (choose 0, 1, 2 or 3)")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule={self.schedule!r} is unknown (choose {', '.join(SCHEDULES)})")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute={self.recompute!r} is unknown (choose {', '.join(RECOMPUTE)})")
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} is unknown (choose {', '.join(DTYPES)})")
        if self.attention not in ATTENTION:
            out.append(f"attention={self.attention!r} is unknown (choose {', '.join(ATTENTION)})")
        elif self.attention == "sdpa" and self.recompute == "selective":
            out.append("recompute='selective' recomputes the attention core's s x s matrix, which "
                       "attention='sdpa' never stores (its fused kernel recomputes it anyway): "
                       "use --recompute none or full with --attention sdpa")
        if model.n_heads % self.tp:
            out.append(f"tp={self.tp} does not divide n_heads={model.n_heads} "
                       f"(choose tp in {_divisors(model.n_heads)})")
        if model.d_ff % self.tp:
            out.append(f"tp={self.tp} does not divide the MLP width d_ff={model.d_ff} "
                       f"(choose tp in {_divisors(model.d_ff)[:12]})")
        chunks = self.pp * self.virtual_stages
        if chunks > model.n_layers:
            out.append(f"pp={self.pp} x virtual_stages={self.virtual_stages} = {chunks} stages "
                       f"exceeds n_layers={model.n_layers} (each stage needs at least one layer)")
        elif self.virtual_stages > 1 and model.n_layers % chunks:
            out.append(f"n_layers={model.n_layers} does not split evenly into pp*virtual_stages = "
                       f"{chunks} model chunks (choose pp*virtual_stages in {_divisors(model.n_layers)})")
        per_rank = self.dp * self.micro_batches
        if self.global_batch % per_rank:
            fits = [g for g in range(per_rank, 8 * per_rank + 1, per_rank)][:4]
            out.append(f"global_batch={self.global_batch} does not split into dp={self.dp} x "
                       f"micro_batches={self.micro_batches} equal micro-batches (choose a multiple "
                       f"of {per_rank}, e.g. {fits})")
        if self.schedule in SCHEDULES:  # the pipeline schedule's own rules, one source
            from mini3d.pp.schedules import schedule_problems

            out += schedule_problems(self.schedule, self.pp, self.micro_batches,
                                     self.virtual_stages)
        if self.seq_len > model.max_seq_len:
            out.append(f"seq_len={self.seq_len} exceeds the model's max_seq_len={model.max_seq_len}")
        if self.sequence_parallel and self.seq_len % self.tp:
            out.append(f"sequence parallelism needs tp={self.tp} to divide seq_len={self.seq_len}")
        if self.zero == 3 and self.pp > 1:
            out.append(f"zero=3 with pp={self.pp} is refused: every micro-batch would all-gather "
                       f"each stage's parameters again in forward and backward "
                       f"(2 x micro_batches={self.micro_batches} gathers per step instead of 2); "
                       f"use --zero 1 (or 2) with pipeline parallelism")
        if self.bucket_mb <= 0:
            out.append(f"bucket_mb={self.bucket_mb} must be > 0")
        return out

    def validate(self, model: ModelConfig, world_size: int | None = None) -> "Plan":
        problems = self.problems(model, world_size)
        if problems:
            raise PlanError(problems)
        return self

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_from_dict(d: dict) -> Plan:
    names = {f.name for f in dataclasses.fields(Plan)}
    return Plan(**{k: v for k, v in d.items() if k in names})


def model_from_dict(d: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


__all__ = ["ModelConfig", "Plan", "PlanError", "PRESETS", "SCHEDULES", "RECOMPUTE", "DTYPES", "ATTENTION",
           "model_from_preset", "plan_from_dict", "model_from_dict"]
