"""Configuration as data: the parallel layout (`Plan`), next to the model's shape (`ModelConfig`,
its families and presets: mini3d/models/config.py, re-exported here).

Everything else in mini3d reads these two frozen dataclasses: the launcher, the trainer, the
memory estimator, the cost model, the planner and the course widgets. `Plan.problems()` checks a
plan against a model once, and names every offending value together with what would fit, so that
`mini3d train` can refuse bad input (exit status 2) before a single process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mini3d.models.config import ModelConfig, PlanError, model_from_dict
from mini3d.models.families import ACTIVATIONS, FAMILIES, divisors
from mini3d.models.presets import ALIASES, PRESETS, model_from_preset
from mini3d.schedule_kinds import SCHEDULES, schedule_kind, schedule_problems

RECOMPUTE = ("none", "selective", "full")
DTYPES = ("float32", "bf16", "float64")  # float64: exact parity checks (tests/matrix.py)
ATTENTION = ("explicit", "sdpa")
COMPILE = ("none", "inductor", "aot_eager")  # Plan.compile: off, or the torch.compile backend


@dataclass(frozen=True)
class Plan:
    """How one training step is split across tp * cp * pp * dp processes."""

    tp: int = 1
    """tensor-parallel degree (splits each layer's matrices; wants NVLink)"""
    pp: int = 1
    """pipeline-parallel degree (splits the layers into stages)"""
    dp: int = 1
    """data-parallel degree (replicas, or shards under ZeRO)"""
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters"""
    schedule: str = "1f1b"
    """pipeline schedule: gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zbv"""
    micro_batches: int = 1
    """micro-batches per optimizer step on each dp replica"""
    virtual_stages: int = 1
    """model chunks per pipeline rank (interleaved, looped-bfs; zbv: 2)"""
    recompute: str = "none"
    """activation recomputation: none, selective or full"""
    dtype: str = "float32"
    """float32; bf16 with fp32 master weights; or float64 everywhere (parameters, activations,
    gradients, reductions: parity checks whose bounds do not depend on summation order)"""
    global_batch: int = 8
    """sequences per optimizer step, over all replicas"""
    seq_len: int = 64
    """tokens per sequence"""
    sequence_parallel: bool = False
    """shard LayerNorm/dropout regions along the sequence (tp > 1)"""
    bucket_mb: float = 25.0
    """data-parallel gradient bucket size in MiB: 25, PyTorch DDP's bucket_cap_mb (see mini3d.cost.comm_time)"""
    attention: str = "explicit"
    """attention core: written out (keeps the s x s matrix) or torch's sdpa"""
    grad_dtype: str = "float32"
    """bf16 runs: gradients accumulated and dp-reduced in float32 (Megatron / FSDP default), or in
    bf16: half the gradient memory and dp traffic, but rounded at every sum (see
    mini3d/dp/ddp.py)"""
    cp: int = 1
    """context-parallel degree (splits each sequence; attention by ring attention)"""
    ep: int = 1
    """expert-parallel degree: the routed experts of every MoE layer split over ep ranks carved
    out of dp x cp (dense weights stay replicated there); tokens reach their experts by
    all-to-all (mini3d.cost.moe.a2a_bytes). Does not change the world size"""
    expert_tp: bool = False
    """split every routed and shared expert's FFN over the tp ranks like the dense MLP (Megatron-Core's
    expert-tp = tp; mini3d.tp.experts); off: the experts stay whole on every tp rank"""
    compile: str = "none"
    """torch.compile each transformer block (mini3d.run.compile): 'none', or the backend
    ('inductor'; 'aot_eager' traces and partitions the same graphs without generating code, for
    quick tests)"""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def micro_batch_size(self) -> int:
        """Sequences in one micro-batch on one replica."""
        return self.global_batch // (self.dp * self.micro_batches)

    def problems(self, model: ModelConfig, world_size: int | None = None) -> list[str]:
        """Every reason this plan cannot run `model`, each naming the values and what would fit."""
        out = list(model.problems())
        ints = ("tp", "cp", "pp", "dp", "micro_batches", "virtual_stages", "global_batch", "seq_len")
        bad_int = [n for n in ints if not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        out += [f"{n}={getattr(self, n)} must be a positive integer" for n in bad_int]
        if bad_int:
            return out
        if world_size is not None and world_size != self.world_size and self.cp > 1:
            out.append(f"world size {world_size} != tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*"
                       f"{self.dp} = {self.world_size} (choose degrees whose product is {world_size})")
        elif world_size is not None and world_size != self.world_size:
            out.append(f"world size {world_size} != tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = "
                       f"{self.world_size} (choose degrees whose product is {world_size})")
        out += self._cp_problems()
        out += self._ep_problems(model)
        out += self._expert_tp_problems(model)
        out += self._choice_problems()
        out += self._split_problems(model)
        out += self._batch_problems(model)
        return out


    def _ep_problems(self, model: ModelConfig) -> list[str]:
        """Expert parallelism: ep ranks out of dp x cp, each holding n_experts / ep experts."""
        if not isinstance(self.ep, int) or self.ep < 1:
            return [f"ep={self.ep} must be a positive integer"]
        if self.ep == 1:
            return []
        out = []
        if not model.n_experts:
            out.append(f"ep={self.ep} needs a mixture-of-experts model (--experts E; this model "
                       f"is dense)")
        elif model.n_experts % self.ep:
            out.append(f"ep={self.ep} does not divide n_experts={model.n_experts} (each ep rank "
                       f"holds whole experts; choose ep in {divisors(model.n_experts)})")
        if (self.dp * self.cp) % self.ep:
            out.append(f"ep={self.ep} does not divide dp*cp = {self.dp}*{self.cp} = "
                       f"{self.dp * self.cp} (the ep ranks are carved out of dp x cp; choose ep in "
                       f"{divisors(self.dp * self.cp)})")
        return out

    def _expert_tp_problems(self, model: ModelConfig) -> list[str]:
        """`expert_tp`: tp > 1, a MoE model, and tp dividing one expert's FFN width."""
        if not self.expert_tp:
            return []
        if not model.n_experts or self.tp == 1:
            return [f"expert_tp needs tp > 1 and a mixture-of-experts model (tp={self.tp}, "
                    f"n_experts={model.n_experts}; give --tp N and --experts E, or leave out "
                    f"--expert-tp)"]
        if model.moe_width % self.tp:
            return [f"expert_tp: tp={self.tp} does not divide the expert FFN width "
                    f"moe_width={model.moe_width} (choose tp in {divisors(model.moe_width)[:12]}, "
                    f"or --moe-ffn a multiple of {self.tp})"]
        return []

    def _choice_problems(self) -> list[str]:
        """The named choices (ZeRO stage, schedule, recompute, dtypes, attention) and their pairs."""
        out = []
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero={self.zero} is not a ZeRO stage (choose 0, 1, 2 or 3)")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule={self.schedule!r} is unknown (choose {', '.join(SCHEDULES)})")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute={self.recompute!r} is unknown (choose {', '.join(RECOMPUTE)})")
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} is unknown (choose {', '.join(DTYPES)})")
        if self.grad_dtype not in ("float32", "bf16"):
            out.append(f"grad_dtype={self.grad_dtype!r} is unknown (choose float32 or bf16)")
        elif self.grad_dtype == "bf16" and self.dtype != "bf16":
            out.append("grad_dtype='bf16' needs dtype='bf16' (float32 parameters have float32 "
                       "gradients)")
        if self.compile not in COMPILE:
            out.append(f"compile={self.compile!r} is unknown (choose {', '.join(COMPILE)})")
        if self.attention not in ATTENTION:
            out.append(f"attention={self.attention!r} is unknown (choose {', '.join(ATTENTION)})")
        elif self.attention == "sdpa" and self.recompute == "selective":
            out.append("recompute='selective' recomputes the attention core's s x s matrix, which "
                       "attention='sdpa' never stores (its fused kernel recomputes it anyway): "
                       "use --recompute none or full with --attention sdpa")
        return out


    def _split_problems(self, model: ModelConfig) -> list[str]:
        """tp against the heads, key/value heads, dropout and MLP width of `model`."""
        out = []
        if model.n_heads % self.tp:
            out.append(f"tp={self.tp} does not divide n_heads={model.n_heads} "
                       f"(choose tp in {divisors(model.n_heads)})")
        if model.n_kv_heads != model.n_heads and model.n_kv_heads % self.tp:
            out.append(f"tp={self.tp} does not divide n_kv_heads={model.n_kv_heads} (each tp rank "
                       f"holds whole key/value heads; choose tp in {divisors(model.n_kv_heads)})")
        if model.dropout and self.tp > 1:
            out.append(f"tp={self.tp} with dropout={model.dropout} is refused: the tp ranks would "
                       f"draw different masks on replicated activations (train with --tp 1)")
        if model.d_ff % self.tp:
            out.append(f"tp={self.tp} does not divide the MLP width d_ff={model.d_ff} "
                       f"(choose tp in {divisors(model.d_ff)[:12]})")
        return out


    def _batch_problems(self, model: ModelConfig) -> list[str]:
        """Stages against layers, the batch split, the schedule's rules, sequence length, SP, ZeRO-3."""
        out = []
        chunks = self.pp * self.virtual_stages
        if chunks > model.n_layers:
            out.append(f"pp={self.pp} x virtual_stages={self.virtual_stages} = {chunks} stages "
                       f"exceeds n_layers={model.n_layers} (each stage needs at least one layer)")
        elif self.virtual_stages > 1 and model.n_layers % chunks:
            out.append(f"n_layers={model.n_layers} does not split evenly into pp*virtual_stages = "
                       f"{chunks} model chunks (choose pp*virtual_stages in {divisors(model.n_layers)})")
        per_rank = self.dp * self.micro_batches
        if self.global_batch % per_rank:
            fits = [g for g in range(per_rank, 8 * per_rank + 1, per_rank)][:4]
            out.append(f"global_batch={self.global_batch} does not split into dp={self.dp} x "
                       f"micro_batches={self.micro_batches} equal micro-batches (choose a multiple "
                       f"of {per_rank}, e.g. {fits})")
        if self.schedule in SCHEDULES:  # the pipeline schedule's own rules, one source
            out += schedule_problems(self.schedule, self.pp, self.micro_batches,
                                     self.virtual_stages)
            out += schedule_kind(self.schedule).model_problems(self.pp, model.tie_embeddings)
        if self.seq_len > model.max_seq_len:
            out.append(f"seq_len={self.seq_len} exceeds the model's max_seq_len={model.max_seq_len}")
        if self.sequence_parallel and (self.seq_len // self.cp) % self.tp:
            out.append(f"sequence parallelism needs tp={self.tp} to divide seq_len={self.seq_len}"
                       + (f" / cp={self.cp} = {self.seq_len // self.cp}" if self.cp > 1 else ""))
        if self.zero == 3 and self.pp > 1:
            out.append(f"zero=3 with pp={self.pp} is refused: every micro-batch would all-gather "
                       f"each stage's parameters again in forward and backward "
                       f"(2 x micro_batches={self.micro_batches} gathers per step instead of 2); "
                       f"use --zero 1 (or 2) with pipeline parallelism")
        if self.bucket_mb <= 0:
            out.append(f"bucket_mb={self.bucket_mb} must be > 0")
        return out

    def _cp_problems(self) -> list[str]:
        """Context parallelism: 2*cp equal zig-zag chunks per sequence (see mini3d.cp.layout)."""
        if self.cp == 1:
            return []
        out = []
        if self.seq_len % (2 * self.cp):
            fits = [n for n in range(2 * self.cp, 2 * self.cp * 5, 2 * self.cp)]
            ok = [c for c in range(1, self.seq_len // 2 + 1) if self.seq_len % (2 * c) == 0][:8]
            out.append(f"cp={self.cp} needs seq_len={self.seq_len} to split into 2*cp = "
                       f"{2 * self.cp} equal chunks (choose seq_len in {fits}..., or cp in {ok})")
        if self.recompute == "selective":
            out.append("recompute='selective' recomputes the s x s attention matrix, which ring "
                       "attention (cp > 1) never stores: use --recompute none or full with --cp")
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


__all__ = ["ModelConfig", "Plan", "PlanError", "PRESETS", "ALIASES", "FAMILIES", "RECOMPUTE", "DTYPES", "ATTENTION", "COMPILE",
           "model_from_preset", "plan_from_dict", "model_from_dict"]
