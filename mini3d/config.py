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
MULTI_CHUNK = ("interleaved", "looped-bfs", "zbv")  # kinds with v > 1 chunks per rank
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("float32", "bf16")
ATTENTION = ("explicit", "sdpa")


def schedule_problems(kind: str, p: int, m: int, v: int = 1) -> list[str]:
    """Why (kind, p, m, v) has no pipeline schedule (`mini3d.pp.make_schedule` refuses it with these
    messages, `Plan.problems` reports them). Here, with the plan, because the configuration layer
    imports nothing above it."""
    out = [f"{n}={x} must be a positive integer" for n, x in (("pp", p), ("micro_batches", m),
           ("virtual_stages", v)) if not isinstance(x, int) or x < 1]
    if kind not in SCHEDULES:
        out.append(f"schedule={kind!r} is unknown (choose {', '.join(SCHEDULES)})")
    if out:
        return out
    if kind in ("1f1b", "zb-h1") and p > 1 and m < p:
        out.append(f"{kind} needs micro_batches >= pp, got micro_batches={m} < pp={p} "
                   f"(use --micro-batches {p} or more)")
    if kind == "interleaved":
        rounds = max(1, m // p)
        if v < 2:
            out.append(f"interleaved needs virtual_stages >= 2, got {v}")
        if m % rounds:
            fits = sorted({p * rounds, m - m % rounds, p})
            out.append(f"interleaved needs micro_batches={m} to be a multiple of its rounds "
                       f"max(1, micro_batches // pp={p}) = {rounds} (e.g. {fits})")
    elif kind == "zbv" and v != 2:
        out.append(f"zbv needs exactly virtual_stages=2 (two chunks per rank in a V), got {v}")
    elif kind not in MULTI_CHUNK and v != 1:
        out.append(f"virtual_stages={v} needs schedule interleaved, looped-bfs or zbv "
                   f"(got schedule={kind!r})")
    return out


class PlanError(ValueError):
    """A plan that cannot run; the message names each offending value and what would fit."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid plan: " + "; ".join(self.problems))


FAMILIES = ("gpt2", "llama")
ACTIVATIONS = {"gpt2": ("gelu", "gelu_tanh"), "llama": ("silu",)}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer of one family (one code path: `mini3d.model.GPT`).

    `family="gpt2"`: LayerNorm, learned positions, biases everywhere, a GELU MLP (exact erf by
    default, GPT-2's tanh approximation with activation="gelu_tanh"). `family="llama"`: RMSNorm,
    rotary positions (base `rope_base`), a SwiGLU MLP (three matrices), grouped-query attention
    (`n_kv_heads` key/value heads), no biases. Either family may tie the output head to the token
    embedding. The defaults (and the course's `tiny` / `small` presets) keep exact GELU and an
    untied head: the numbers the course and its parity tests were built on; the `gpt2-*` presets
    and Hugging Face imports are the real GPT-2 (tanh GELU, tied)."""

    n_layers: int = 4  # transformer blocks
    d_model: int = 64  # hidden size h
    n_heads: int = 4  # attention (query) heads a (d_model % n_heads == 0)
    vocab_size: int = 256  # V; byte-level tokenizer by default
    max_seq_len: int = 128  # longest sequence (gpt2: length of the learned position table)
    d_ff: int = 0  # MLP width; 0 means 4 * d_model
    name: str = "custom"  # preset name, for reports
    family: str = "gpt2"  # gpt2 or llama (see the class docstring)
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 means n_heads
    rope_base: float = 10000.0  # rotary position base theta (llama)
    tie_embeddings: bool = False  # the output head is the token embedding matrix
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    activation: str = ""  # gpt2: gelu (exact) or gelu_tanh; llama: silu (SwiGLU); "" = family default
    dropout: float = 0.0  # dropout on the embedding output and each residual branch (0 = none)
    rope_scaling: tuple = ()  # Llama 3.1's rotary rescaling: (factor, low_freq_factor,
    #                           high_freq_factor, original context); () for none

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))  # (JSON gives a list)
        if not self.activation:
            object.__setattr__(self, "activation", "silu" if self.family == "llama" else "gelu")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): n_kv_heads * head_dim (= d_model without grouped-query attention)."""
        return self.n_kv_heads * self.head_dim

    @property
    def biases(self) -> bool:
        return self.family == "gpt2"

    def layer_weights(self) -> dict:
        """Elements of each weight matrix of one block (the matmuls: 2 FLOPs per element per token)."""
        h, f = self.d_model, self.d_ff
        return {"qkv": h * (h + 2 * self.kv_dim), "proj": h * h,
                "mlp": (3 if self.family == "llama" else 2) * h * f}

    def norm_params(self) -> int:
        """Parameters of one normalisation layer: LayerNorm weight + bias, RMSNorm weight."""
        return 2 * self.d_model if self.family == "gpt2" else self.d_model

    def position_params(self) -> int:
        """The learned position table (gpt2); rotary positions have none."""
        return self.max_seq_len * self.d_model if self.family == "gpt2" else 0

    def layer_param_count(self, tp: int = 1) -> int:
        """Parameters of one block on one of `tp` ranks: column-parallel matrices (qkv, MLP up and
        gate) split with their biases, row-parallel ones (attention / MLP out-projections) split
        with their biases replicated, the two norms replicated."""
        h, f, w = self.d_model, self.d_ff, self.layer_weights()
        col_bias = (h + 2 * self.kv_dim + f) if self.biases else 0
        row_bias = 2 * h if self.biases else 0
        return (w["qkv"] + w["proj"] + w["mlp"] + col_bias) // tp + row_bias + 2 * self.norm_params()

    def n_params(self) -> int:
        """Exact parameter count of `mini3d.model.GPT` for this shape (a tied head counted once)."""
        V, h = self.vocab_size, self.d_model
        head = 0 if self.tie_embeddings else V * h
        return (V * h + self.position_params() + self.n_layers * self.layer_param_count()
                + self.norm_params() + head)

    def problems(self) -> list[str]:
        out = []
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", "d_ff", "n_kv_heads"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append(f"n_heads={self.n_heads} does not divide d_model={self.d_model} "
                       f"(choose n_heads in {_divisors(self.d_model)[:12]})")
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            out.append(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads} "
                       f"(choose n_kv_heads in {_divisors(self.n_heads)})")
        if self.family not in FAMILIES:
            out.append(f"family={self.family!r} is unknown (choose {', '.join(FAMILIES)})")
        else:
            if self.activation not in ACTIVATIONS[self.family]:
                out.append(f"activation={self.activation!r} is not one of the {self.family} family "
                           f"(choose {', '.join(ACTIVATIONS[self.family])})")
            if self.family == "gpt2" and self.n_kv_heads != self.n_heads:
                out.append(f"n_kv_heads={self.n_kv_heads} != n_heads={self.n_heads}: grouped-query "
                           f"attention is a llama-family feature (use --family llama)")
            if self.family == "llama" and self.n_heads >= 1 and self.head_dim % 2:
                out.append(f"head_dim={self.head_dim} must be even for rotary positions")
        if self.rope_scaling and (len(self.rope_scaling) != 4 or self.family != "llama"):
            out.append(f"rope_scaling={self.rope_scaling} must be (factor, low_freq_factor, "
                       f"high_freq_factor, original context) of a llama-family model")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"dropout={self.dropout} must be in [0, 1)")
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Presets: `tiny` and `small` train on a laptop CPU in minutes (exact GELU, untied head: the
# course's numbers); `gpt-1.3b` .. `gpt-175b` are GPT-style shapes (the 22B and 175B rows are those
# of Korthikanti et al. 2022, which calibrate the cost model; `gpt-70b` widens the MLP to ~70e9
# parameters: a teaching shape, not a real model, kept because the course's lessons and exercises
# use its full multi-head attention, e.g. tp=16); the rest are real models with their
# published dimensions: GPT-2 (Radford et al. 2019; tanh GELU, tied head) and Llama 3 (Llama 3 Herd
# of Models, 2024, table 3; 128256-token vocabulary, rope base 500000, 8 key/value heads).
# Llama's max_seq_len is 8192, the context of its main pre-training stage (the default sequence
# length of estimates); the 3.1 / 3.2 models rescale their rotary frequencies for 128K contexts.
_GPT2 = dict(family="gpt2", activation="gelu_tanh", tie_embeddings=True)
_LLAMA3 = dict(family="llama", n_kv_heads=8, rope_base=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192))
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(4, 64, 4, 256, 128, name="tiny"),
    "small": ModelConfig(6, 256, 8, 256, 256, name="small"),
    "gpt2-124m": ModelConfig(12, 768, 12, 50257, 1024, name="gpt2-124m", **_GPT2),
    "gpt2-355m": ModelConfig(24, 1024, 16, 50257, 1024, name="gpt2-355m", **_GPT2),
    "gpt2-774m": ModelConfig(36, 1280, 20, 50257, 1024, name="gpt2-774m", **_GPT2),
    "gpt2-1.5b": ModelConfig(48, 1600, 25, 50257, 1024, name="gpt2-1.5b", **_GPT2),
    "gpt-1.3b": ModelConfig(24, 2048, 16, 50257, 2048, name="gpt-1.3b"),
    "gpt-7b": ModelConfig(32, 4096, 32, 32000, 4096, name="gpt-7b"),
    "gpt-22b": ModelConfig(48, 6144, 64, 51200, 2048, name="gpt-22b"),
    "gpt-70b": ModelConfig(80, 8192, 64, 32000, 4096, d_ff=36864, name="gpt-70b"),
    "gpt-175b": ModelConfig(96, 12288, 96, 51200, 2048, name="gpt-175b"),
    "llama-3.2-1b": ModelConfig(16, 2048, 32, 128256, 8192, 8192, name="llama-3.2-1b",
                                tie_embeddings=True, **{**_LLAMA3, "rope_scaling": (32.0, 1.0, 4.0, 8192)}),
    "llama-3.1-8b": ModelConfig(32, 4096, 32, 128256, 8192, 14336, name="llama-3.1-8b", **_LLAMA3),
    "llama-3.1-70b": ModelConfig(80, 8192, 64, 128256, 8192, 28672, name="llama-3.1-70b", **_LLAMA3),
    "llama-3.1-405b": ModelConfig(126, 16384, 128, 128256, 8192, 53248, name="llama-3.1-405b",
                                  **_LLAMA3),
}
# Old names, kept working: each is the same object as the preset it names.
ALIASES = {"gpt2-small": "gpt2-124m", "gpt2-medium": "gpt2-355m", "gpt2-large": "gpt2-774m",
           "gpt2-xl": "gpt2-1.5b"}
PRESETS.update({old: PRESETS[new] for old, new in ALIASES.items()})


def model_from_preset(preset: str, **overrides) -> ModelConfig:
    """A preset, with any ModelConfig fields overridden."""
    if preset not in PRESETS:
        raise PlanError([f"model={preset!r} is not a preset (choose from {', '.join(PRESETS)})"])
    return dataclasses.replace(PRESETS[preset], **overrides) if overrides else PRESETS[preset]


@dataclass(frozen=True)
class Plan:
    """How one training step is split across tp * cp * pp * dp processes."""

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
    # bf16 runs: gradients accumulated and dp-reduced in float32 (Megatron / FSDP default), or in
    # bf16: half the gradient memory and dp traffic, but rounded at every sum (see mini3d/dp/ddp.py)
    grad_dtype: str = "float32"
    cp: int = 1  # context-parallel degree (splits each sequence; attention by ring attention)

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
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero={self.zero} is not a ZeRO stage (choose 0, 1, 2 or 3)")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule={self.schedule!r} is unknown (choose {', '.join(SCHEDULES)})")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute={self.recompute!r} is unknown (choose {', '.join(RECOMPUTE)})")
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} is unknown (choose {', '.join(DTYPES)})")
        if self.grad_dtype not in DTYPES:
            out.append(f"grad_dtype={self.grad_dtype!r} is unknown (choose {', '.join(DTYPES)})")
        elif self.grad_dtype == "bf16" and self.dtype != "bf16":
            out.append("grad_dtype='bf16' needs dtype='bf16' (float32 parameters have float32 "
                       "gradients)")
        if self.attention not in ATTENTION:
            out.append(f"attention={self.attention!r} is unknown (choose {', '.join(ATTENTION)})")
        elif self.attention == "sdpa" and self.recompute == "selective":
            out.append("recompute='selective' recomputes the attention core's s x s matrix, which "
                       "attention='sdpa' never stores (its fused kernel recomputes it anyway): "
                       "use --recompute none or full with --attention sdpa")
        if model.n_heads % self.tp:
            out.append(f"tp={self.tp} does not divide n_heads={model.n_heads} "
                       f"(choose tp in {_divisors(model.n_heads)})")
        if model.n_kv_heads != model.n_heads and model.n_kv_heads % self.tp:
            out.append(f"tp={self.tp} does not divide n_kv_heads={model.n_kv_heads} (each tp rank "
                       f"holds whole key/value heads; choose tp in {_divisors(model.n_kv_heads)})")
        if model.dropout and self.tp > 1:
            out.append(f"tp={self.tp} with dropout={model.dropout} is refused: the tp ranks would "
                       f"draw different masks on replicated activations (train with --tp 1)")
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
            out += schedule_problems(self.schedule, self.pp, self.micro_batches,
                                     self.virtual_stages)
        if self.schedule == "zbv" and self.pp > 1 and model.tie_embeddings:
            out.append("schedule='zbv' puts the first and the last stage on pipeline rank 0, but "
                       "tied embeddings are summed between pipeline ranks 0 and pp-1 "
                       "(mini3d.pp.tied): use --schedule zb-h1, or a model with untied embeddings")
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


def model_from_dict(d: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


__all__ = ["ModelConfig", "Plan", "PlanError", "schedule_problems", "MULTI_CHUNK", "PRESETS", "ALIASES", "FAMILIES", "SCHEDULES", "RECOMPUTE", "DTYPES", "ATTENTION",
           "model_from_preset", "plan_from_dict", "model_from_dict"]
