"""The model's shape as data: `ModelConfig` (one dataclass for every family, exact parameter
counts) and `PlanError`, the error every validation raises with each offending value named. The
presets with their published dimensions are mini3d.models.presets. `mini3d.config` re-exports all
of it next to `Plan`; this module imports only mini3d.exits and the families' names (mini3d.models.families) (a `PlanError` is bad input:
exit 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mini3d.exits import BadInput
from mini3d.models.families import FAMILY_FEATURES, LLAMA_LIKE


class PlanError(BadInput):
    """A plan that cannot run; the message names each offending value and what would fit."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid plan: " + "; ".join(self.problems))


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer of one family (one code path: `mini3d.models.transformer.GPT`).

    `family="gpt2"`: LayerNorm, learned positions, biases everywhere, a GELU MLP (exact erf by
    default, GPT-2's tanh approximation with activation="gelu_tanh"). `family="llama"`: RMSNorm,
    rotary positions (base `rope_base`), a SwiGLU MLP (three matrices), grouped-query attention
    (`n_kv_heads` key/value heads), no biases. `family="qwen2"` is llama with biases on the q, k
    and v projections (`qkv_bias`), `family="qwen3"` llama with an RMSNorm over each query and key
    head before the rotation (`qk_norm`) and usually a head width of its own (`explicit_head_dim`,
    so n_heads * head_dim may differ from d_model). `family="deepseek"` is llama with multi-head
    latent attention (mini3d.models.mla: q_lora_rank, kv_lora_rank, qk_rope_dim, qk_nope_dim,
    v_head_dim, rope_interleave, yarn) in place of q/k/v projections. Any family may tie the output head to the token
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
    """gpt2, llama, qwen2, qwen3 or deepseek (see the class docstring)"""
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
    # ---- attention variants of the qwen families (h-fam)
    explicit_head_dim: int = 0
    """width of one attention head; 0 means d_model / n_heads (qwen3's is 128 at every size)"""
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotation (on for the qwen3 family)"""
    qkv_bias: bool = False
    """biases on the q, k and v projections only (on for the qwen2 family)"""
    # ---- multi-head latent attention of the deepseek family (mini3d.models.mla; h-mla)
    q_lora_rank: int = 0
    """deepseek: width of the query latent (q = up(norm(down x))); 0 = one full q projection (V2-Lite)"""
    kv_lora_rank: int = 32
    """deepseek: width of the joint key/value latent every head's k and v are expanded from"""
    qk_rope_dim: int = 8
    """deepseek: rotary part of each query/key head (the key's is one head shared by all)"""
    qk_nope_dim: int = 16
    """deepseek: position-free part of each query/key head (expanded from the latent)"""
    v_head_dim: int = 16
    """deepseek: width of each value head (the output projection reads n_heads * v_head_dim)"""
    rope_interleave: bool = False
    """rotate feature pairs (2i, 2i+1) as DeepSeek's checkpoints lay them out, not (i, i + d/2)"""
    yarn: tuple = ()
    """deepseek: YaRN rotary rescaling (factor, original context, beta_fast, beta_slow, mscale,
    mscale_all_dim); () for none"""
    # ---- mixture of experts (mini3d.models.moe; h-moe's block) ----
    n_experts: int = 0
    """routed experts per MoE layer (0 = a dense model)"""
    top_k: int = 2
    """experts each token is routed to"""
    moe_ffn: int = 0
    """width of one expert's MLP (0 = d_ff)"""
    n_shared_experts: int = 0
    """always-on shared experts: one MLP of width moe_ffn * n_shared_experts"""
    moe_every: int = 1
    """layer i (i >= dense_layers) is a MoE layer when i % moe_every == 0 (DeepSeek's rule)"""
    dense_layers: int = 0
    """the first dense_layers layers keep a dense MLP"""
    router: str = "softmax"
    """softmax (top-k of softmax), softmax-norm (renormalised top-k) or sigmoid (aux-loss-free bias)"""
    aux_loss_coef: float = 0.0
    """weight of the switch-style load-balancing loss in the training loss"""
    aux_loss_scope: str = "model"
    """model: f, P pooled over all MoE layers (transformers); layer: each layer's, summed (pp)"""
    z_loss_coef: float = 0.0
    """weight of the router z-loss (mean squared logsumexp of the router logits)"""
    seq_aux_loss_coef: float = 0.0
    """weight (alpha) of DeepSeek-V3's sequence-wise balance loss: each sequence's
    E/(k T) sum_e f_e P_e, averaged over sequences, summed over MoE layers (0 = off)"""
    capacity_factor: float = 0.0
    """tokens per expert capped at ceil(C * tokens * top_k / n_experts), overflow dropped (0 = dropless)"""
    router_bias_rate: float = 0.0
    """speed of the aux-loss-free bias update (sigmoid router): bias += rate * sign(mean load - load)"""
    route_groups: int = 1
    """sigmoid router: experts in this many equal groups; a token picks among the best route_topk_groups"""
    route_topk_groups: int = 1
    """sigmoid router: groups a token may use (group score: the sum of its two best biased scores)"""
    routed_scaling_factor: float = 1.0
    """sigmoid router: the routed experts' weights multiplied by this (DeepSeek-V3: 2.5)"""
    norm_topk_prob: bool = True
    """sigmoid router: renormalise the top-k scores to sum to one before the scaling factor"""

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))  # (JSON gives a list)
        object.__setattr__(self, "yarn", tuple(self.yarn))
        if not self.activation:
            object.__setattr__(self, "activation", "silu" if self.llama_like else "gelu")
        if self.family in FAMILY_FEATURES:  # the feature that makes the family
            object.__setattr__(self, FAMILY_FEATURES[self.family], True)

    @property
    def llama_like(self) -> bool:
        """RMSNorm, rotary positions, SwiGLU, grouped-query attention: llama and the qwens."""
        return self.family in LLAMA_LIKE

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (the deepseek family) instead of q/k/v projections."""
        return self.family == "deepseek"

    @property
    def head_dim(self) -> int:
        """Width of one query/key head (deepseek: qk_nope_dim + qk_rope_dim)."""
        if self.mla:
            return self.qk_nope_dim + self.qk_rope_dim
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of Q (and of the attention projection's input): n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): n_kv_heads * head_dim (= d_model without grouped-query attention)."""
        return self.n_kv_heads * self.head_dim

    @property
    def biases(self) -> bool:
        return self.family == "gpt2"

    def layer_weights(self) -> dict:
        """Elements of each weight matrix of one block (the matmuls: 2 FLOPs per element per token);
        deepseek's "qkv" is the sum of its latent attention's projections (`mla_weights`)."""
        h, f, q = self.d_model, self.d_ff, self.q_dim
        if self.mla:
            return {"qkv": sum(n for n, _ in self.mla_weights().values()),
                    "proj": self.n_heads * self.v_head_dim * h, "mlp": 3 * h * f}
        return {"qkv": h * (q + 2 * self.kv_dim), "proj": q * h,
                "mlp": (3 if self.llama_like else 2) * h * f}

    def mla_weights(self) -> dict:
        """{matrix: (elements, split over tp?)} of the latent attention's input side: the
        down-projections to the latents (q_a, kv_a) are replicated under tp, the per-head
        up-projections (q_b, or the full q without a query latent, and kv_b) split by heads."""
        h, a, r = self.d_model, self.n_heads, self.q_lora_rank
        q = {"q_a": (h * r, False), "q_b": (r * a * self.head_dim, True)} if r else \
            {"q": (h * a * self.head_dim, True)}
        return {**q, "kv_a": (h * (self.kv_lora_rank + self.qk_rope_dim), False),
                "kv_b": (self.kv_lora_rank * a * (self.qk_nope_dim + self.v_head_dim), True)}

    def norm_params(self) -> int:
        """Parameters of one normalisation layer: LayerNorm weight + bias, RMSNorm weight."""
        return 2 * self.d_model if self.family == "gpt2" else self.d_model

    def position_params(self) -> int:
        """The learned position table (gpt2); rotary positions have none."""
        return self.max_seq_len * self.d_model if self.family == "gpt2" else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Block `layer` holds a mixture of experts instead of the dense MLP."""
        return self.n_experts > 0 and layer >= self.dense_layers and layer % self.moe_every == 0

    @property
    def moe_width(self) -> int:
        """One expert's MLP width (moe_ffn, else d_ff)."""
        return self.moe_ffn or self.d_ff

    def moe_params(self, tp: int = 1, active: bool = False, ep: int = 1,
                   expert_tp: bool = False) -> dict:
        """Parameters of one MoE layer's parts on one rank: the router (E x d, replicated), the
        routed experts (the E / ep one ep rank holds, or the top_k a token uses when `active`) and
        the shared-expert MLP. By default the engine keeps a MoE layer whole on every tp rank
        (routed and shared experts and the router replicated over tp, as Megatron-Core's
        expert-tp 1; mini3d.tp.parallelize), so `tp` divides none of them; `expert_tp`
        (mini3d.tp.experts) splits the routed experts' FFN width over tp, and the shared experts
        like a dense MLP (weights and the up-projection's bias split, the down-projection's bias
        replicated). The router stays replicated."""
        h, f = self.d_model, self.moe_width
        t = tp if expert_tp else 1
        n = self.top_k if active else self.n_experts // ep
        per_expert = (3 if self.llama_like else 2) * h * f // t
        fs = f * self.n_shared_experts
        shared = (3 if self.llama_like else 2) * h * fs // t
        shared += ((fs // t + h) if self.biases else 0) if fs else 0
        return {"router": self.n_experts * h, "experts": n * per_expert, "shared": shared}

    def layer_param_count(self, tp: int = 1, layer: int | None = None, active: bool = False,
                          ep: int = 1, expert_tp: bool = False) -> int:
        """Parameters of one block on one of `tp` ranks: column-parallel matrices (qkv, MLP up and
        gate) split with their biases, row-parallel ones (attention / MLP out-projections) split
        with their biases replicated, the two norms (and qk_norm's two head-wide ones) replicated.
        A MoE `layer` (`is_moe_layer`) holds `moe_params` in place of the dense MLP (`active`: the
        experts one token uses; `ep`: the E / ep experts of one ep rank; `expert_tp`: split over tp)."""
        h, f, w = self.d_model, self.d_ff, self.layer_weights()
        qkv_bias = (self.q_dim + 2 * self.kv_dim) if self.biases or self.qkv_bias else 0
        col_bias = qkv_bias + (f if self.biases else 0)
        row_bias = 2 * h if self.biases else 0
        qk_norms = 2 * self.head_dim if self.qk_norm else 0
        dense = ((w["qkv"] + w["proj"] + w["mlp"] + col_bias) // tp + row_bias
                 + 2 * self.norm_params() + qk_norms)
        if self.mla:  # the replicated latent projections and the latents' two RMSNorms
            whole = sum(n for n, split in self.mla_weights().values() if not split)
            dense += whole - whole // tp + self.q_lora_rank + self.kv_lora_rank
        if layer is None or not self.is_moe_layer(layer):
            return dense
        mlp = (w["mlp"] + (f if self.biases else 0)) // tp + (h if self.biases else 0)
        return dense - mlp + sum(self.moe_params(tp, active, ep, expert_tp).values())

    def n_params(self) -> int:
        """Exact parameter count of `mini3d.models.transformer.GPT` for this shape (a tied head counted once)."""
        return self._count(active=False)

    def active_params(self) -> int:
        """Parameters one token computes with: embeddings, head, attention, dense layers, and per MoE
        layer the router, top_k routed experts and the shared experts (= n_params when dense)."""
        return self._count(active=True)

    def moe_layer_count(self) -> int:
        """How many blocks `is_moe_layer` (closed form: validation counts the parameters of any
        --layers value, 10**12 included, before a process starts)."""
        if self.n_experts <= 0 or self.n_layers <= 0:
            return 0
        first = -(-self.dense_layers // self.moe_every) * self.moe_every  # first MoE index
        return max(0, (self.n_layers - 1 - first) // self.moe_every + 1) if first < self.n_layers else 0

    def block_kinds(self) -> list:
        """One layer index per kind of block the model has: None for a dense block, the first MoE
        layer's index for a MoE block (every MoE block counts the same; closed form, as
        `moe_layer_count`)."""
        n_moe = self.moe_layer_count()
        return ([None] if n_moe < self.n_layers or not n_moe else []) + (
            [self.dense_layers + (-self.dense_layers) % self.moe_every] if n_moe else [])

    def _count(self, active: bool) -> int:
        V, h = self.vocab_size, self.d_model
        head = 0 if self.tie_embeddings else V * h
        n_moe = self.moe_layer_count()
        moe = self.layer_param_count(1, self.block_kinds()[-1], active) if n_moe else 0
        layers = (self.n_layers - n_moe) * self.layer_param_count(1, None, active) + n_moe * moe
        return V * h + self.position_params() + layers + self.norm_params() + head

    def problems(self) -> list[str]:
        """Every reason this shape cannot be built, each naming the value and what would fit
        (mini3d.models.checks)."""
        from mini3d.models.checks import model_problems

        return model_problems(self)


def model_from_dict(d: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


__all__ = ["ModelConfig", "PlanError", "model_from_dict"]
