"""The model's shape as data: `ModelConfig` (one dataclass for the gpt2 and llama families, exact
parameter counts), the presets with their published dimensions, and `PlanError`, the error every
validation raises with each offending value named. `mini3d.config` re-exports all of it next to
`Plan`; this module imports only mini3d.exits (a `PlanError` is bad input: exit 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mini3d.exits import BadInput


class PlanError(BadInput):
    """A plan that cannot run; the message names each offending value and what would fit."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid plan: " + "; ".join(self.problems))


FAMILIES = ("gpt2", "llama")
ACTIVATIONS = {"gpt2": ("gelu", "gelu_tanh"), "llama": ("silu",)}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer of one family (one code path: `mini3d.models.transformer.GPT`).

    `family="gpt2"`: LayerNorm, learned positions, biases everywhere, a GELU MLP (exact erf by
    default, GPT-2's tanh approximation with activation="gelu_tanh"). `family="llama"`: RMSNorm,
    rotary positions (base `rope_base`), a SwiGLU MLP (three matrices), grouped-query attention
    (`n_kv_heads` key/value heads), no biases. Either family may tie the output head to the token
    embedding. The defaults (and the course's `tiny` / `small` presets) keep exact GELU and an
    untied head: the numbers the course and its parity tests were built on; the `gpt2-*` presets
    and Hugging Face imports are the real GPT-2 (tanh GELU, tied)."""

    n_layers: int = 4
    """transformer blocks"""
    d_model: int = 64
    """hidden size h"""
    n_heads: int = 4
    """attention (query) heads a (d_model % n_heads == 0)"""
    vocab_size: int = 256
    """V; byte-level tokenizer by default"""
    max_seq_len: int = 128
    """longest sequence (gpt2: length of the learned position table)"""
    d_ff: int = 0
    """MLP width; 0 means 4 * d_model"""
    name: str = "custom"
    """preset name, for reports"""
    family: str = "gpt2"
    """gpt2 or llama (see the class docstring)"""
    n_kv_heads: int = 0
    """key/value heads (grouped-query attention); 0 means n_heads"""
    rope_base: float = 10000.0
    """rotary position base theta (llama)"""
    tie_embeddings: bool = False
    """the output head is the token embedding matrix"""
    norm_eps: float = 1e-5
    """LayerNorm / RMSNorm epsilon"""
    activation: str = ""
    """gpt2: gelu (exact) or gelu_tanh; llama: silu (SwiGLU); '' = family default"""
    dropout: float = 0.0
    """dropout on the embedding output and each residual branch (0 = none)"""
    rope_scaling: tuple = ()
    """Llama 3.1's rotary rescaling: (factor, low_freq_factor, high_freq_factor, original
    context); () for none"""

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
        """Exact parameter count of `mini3d.models.transformer.GPT` for this shape (a tied head counted once)."""
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


def model_from_dict(d: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


__all__ = ["ModelConfig", "PlanError", "PRESETS", "ALIASES", "FAMILIES", "ACTIVATIONS",
           "model_from_preset", "model_from_dict"]
