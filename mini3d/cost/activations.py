"""Activation bytes: what one transformer block, the head and the pipeline's in-flight micro-batches
keep for backward, per rank (the `activations` category of `mini3d.cost.memory`'s estimate).

Each function is the one source of its formula: `layer_activation_bytes` (Korthikanti et al. 2022
adapted term by term to mini3d's layers, both families, with recomputation, sequence and context
parallelism), `inflight_microbatches` (from the schedules' own `in_flight_bound`),
`head_activation_bytes` and the ring attention message `ring_block_bytes`.

The terms of `layer_activation_bytes`, Korthikanti et al. 2022's s*b*h*(34 + 5*a*s/h) at 16 bits, with
e = element bytes (2 for bf16, 4 for float32), f = d_ff and tp = t:

* LayerNorm inputs 4sbh -> 2 * sbh*e (ln1, ln2); replicated over tp unless sequence parallel.
* qkv input 2sbh and MLP fc input 2sbh -> 2 * sbh*e (the LayerNorm outputs); same tp rule.
* Q, K (4sbh) and V (2sbh) -> 3 * sbh*e / t (the qkv output, saved by the attention core).
* softmax 2as^2b + its dropout mask as^2b + dropout output 2as^2b: mini3d has no dropout and
  writes the attention core out (mini3d.models.attention.attention_core), so it keeps the softmax
  probabilities: a*s^2*b*e / t (`plan.attention="explicit"`, the default). A fused kernel
  (`plan.attention="sdpa"`: scaled_dot_product_attention's flash path) keeps only its output
  and the fp32 log-sum-exp (4*a*s*b / t); the output is laid out (b, s, a, h/a), so the
  projection's input below is a view of it, not a second copy (measured: tests/test_attention.py).
* attention projection input 2sbh -> sbh*e / t (the core's output, made contiguous).
* attention and MLP dropout masks (sbh each): absent (no dropout).
* GELU input 8sbh and MLP projection input 8sbh -> 2 * sbf*e / t (Korthikanti has f = 4h).

* ring attention (cp > 1, either block math): its float32 output and log-sum-exp,
  4*s*b*h/t + 4*a*s*b/t with s the local s/cp tokens (the output is laid out (b, a, s, h/a), so
  the projection's input is a second tensor); q, k, v are views of the qkv output above.

* a MoE layer (`moe_activation_bytes`) keeps, in place of the dense MLP's terms, for its
  n = s*b tokens (s*b/t under sequence parallelism: the layer is whole on every tp rank)
  and r = n * top_k * kept rows (kept: `mini3d.cost.moe.kept_fraction`): the router's float32
  probabilities 4nE and its top-k indices 8nk (the sigmoid routers more: `router_activation_bytes`);
  the rows' sort order and token index, 2 * 8r;
  three (r, d) row tensors 3*r*h*e (the permuted input the experts read, their output and its
  weighted copy), the routing weights r*e, and per row the expert MLP's hidden values as the
  dense MLP keeps them, (4 llama | 2 gpt2) * r*F*e with F = moe_width; shared experts as a
  dense MLP of width F * n_shared_experts. Counted exactly against the saved-tensor ledger
  (tests/test_cost_moe.py). The rows are the balanced expectation (each rank's experts receive
  as many rows as its own tokens send out); dropless, one rank can receive up to
  ep * n * min(top_k, E/ep) rows at worst (every token of the ep group routed to its experts),
  with a capacity factor at most (E/ep) * ceil(C * n * top_k / E) per source rank.
  With expert-tp (mini3d.tp.experts) the experts' hidden values are F/tp wide, and under
  sequence parallelism they and the permuted input are the tp group's rows (tp x r); the shared
  experts' hidden values likewise (their input gathered along the sequence). Derived from the
  layer's code, not measured against the ledger.

* multi-head latent attention (the deepseek family, `mla_activation_bytes`) keeps its latents
  whole on every tp rank and the heads' expanded q, k, v split, in place of the qkv, projection
  input and core terms above.

Selective recompute drops the attention core term (recomputed from Q, K, V). Full recompute
keeps only the block input, sbh*e (/ t under sequence parallelism), Korthikanti's 2sbh.
With e = 2, f = 4h, a math kernel and dropout masks added back, the sum is the paper's
formula (tested).
"""

from __future__ import annotations

from mini3d.config import ModelConfig, Plan
from mini3d.cost.moe import kept_fraction
from mini3d.pp.schedules import in_flight_bound
from mini3d.schedule_kinds import schedule_kind
from mini3d.tp.layers import padded_size

ELEMENT_BYTES = {"float32": 4, "bf16": 2, "float64": 8}


def local_seq_len(plan: Plan) -> int:
    """Tokens of each sequence one rank holds: s, or s / cp under context parallelism."""
    return plan.seq_len // plan.cp


def ring_block_bytes(cfg: ModelConfig, plan: Plan, element_bytes: int | None = None) -> float:
    """One message of ring attention (mini3d.cp.ring), per layer and micro-batch on one tp rank:
    the K and V of a rank's chunks, 2 * (s/cp) * b * h * e / tp bytes. The backward's dK/dV
    accumulators have this shape in float32 (`element_bytes=4`)."""
    e = ELEMENT_BYTES[plan.dtype] if element_bytes is None else element_bytes
    return 2 * local_seq_len(plan) * plan.micro_batch_size * cfg.d_model * e / plan.tp


def paper_layer_activation_bytes(s, b, h, a, tp=1, sp=False, recompute="none") -> float:
    """Korthikanti et al. 2022, eqs. 1-6: one layer, one micro-batch, 16-bit, with dropout."""
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)
    quad = 0 if recompute == "selective" else 5 * a * s / h
    if sp or tp == 1:
        return s * b * h * (34 + quad) / tp
    return s * b * h * (10 + 24 / tp + quad / tp)


def layer_activation_bytes(cfg: ModelConfig, plan: Plan, fused_attention: bool | None = None,
                           recompute: str | None = None, moe: bool = False) -> dict:
    """Bytes one transformer block keeps for backward, one micro-batch, on one tp rank:
    Korthikanti et al. 2022's s*b*h*(34 + 5*a*s/h) adapted term by term to mini3d's layers (the
    terms: the module docstring). `fused_attention` overrides `plan.attention`, `recompute`
    `plan.recompute`; `moe`: a MoE layer's block (`moe_activation_bytes` in place of the MLP's
    terms). Returns {"stored": bytes kept per layer per micro-batch, "full": bytes the
    block keeps without recompute (the transient peak while one block is recomputed)}."""
    s, b, h, a, f = local_seq_len(plan), plan.micro_batch_size, cfg.d_model, cfg.n_heads, cfg.d_ff
    t, e = plan.tp, ELEMENT_BYTES[plan.dtype]
    if fused_attention is None:
        fused_attention = plan.attention == "sdpa"
    sbh = s * b * h * e
    if cfg.llama_like:
        rep, qkv, mlp = _llama_terms(cfg, fused_attention)
    else:
        rep, qkv, mlp = 4, 3 * h, 2 * f
    rep = rep * sbh / (t if plan.sequence_parallel else 1)
    core = 4 * a * s * b / t if fused_attention else a * s * s * b * e / t
    if plan.cp > 1:
        core = (4 * s * b * h + 4 * a * s * b) / t
    split = (qkv * s * b * e + sbh + mlp * s * b * e) / t
    if cfg.mla:  # the latent attention's own terms in place of q/k/v and the projection input
        terms = mla_activation_bytes(cfg, plan, fused_attention)
        rep += terms["latents"]
        split = terms["heads"] + mlp * s * b * e / t
        core = terms["core"]
    if moe:
        split += moe_activation_bytes(cfg, plan) - mlp * s * b * e / t
    full = rep + split + core
    recompute = plan.recompute if recompute is None else recompute
    if recompute == "full":
        stored = sbh / (t if plan.sequence_parallel else 1)
    elif recompute == "selective":
        stored = rep + split
    else:
        stored = full
    return {"stored": stored, "full": full}


def moe_tokens(plan: Plan) -> float:
    """Tokens one rank routes per micro-batch in each MoE layer: its b * s/cp tokens, split over
    the tp ranks only under sequence parallelism. The engine keeps a MoE layer whole on every tp
    rank (mini3d.tp.parallelize): without sequence parallelism each tp rank routes all the tokens
    it holds (the same ones: replicated work), with it each routes its own s/tp slice."""
    return (plan.micro_batch_size * local_seq_len(plan)
            / (plan.tp if plan.sequence_parallel else 1))


def moe_activation_bytes(cfg: ModelConfig, plan: Plan) -> float:
    """Bytes one MoE layer's mixture keeps for backward, one micro-batch, one rank (the terms:
    the module docstring; the MLP's input is the norm output counted with the block)."""
    n, e, k = moe_tokens(plan), ELEMENT_BYTES[plan.dtype], cfg.top_k
    rows = n * k * kept_fraction(cfg.capacity_factor)
    hidden = 4 if cfg.llama_like else 2  # SwiGLU: gate, up, silu(gate), product; gpt2: fc out, act out
    router = router_activation_bytes(cfg, n)
    t = plan.tp if plan.expert_tp else 1  # the FFN width split (expert-tp), g: the rows it sees
    g = t if plan.sequence_parallel else 1
    routed = (2 * 8 * rows + (2 + g) * rows * cfg.d_model * e + rows * e
              + hidden * g * rows * cfg.moe_width / t * e)
    shared = hidden * g * n * cfg.moe_width * cfg.n_shared_experts / t * e
    return router + routed + shared


def router_activation_bytes(cfg: ModelConfig, n: float) -> float:
    """What the router (mini3d.models.routers) keeps for `n` tokens: every router its float32
    probabilities 4nE and top-k indices 8nk; the sigmoid routers gather the chosen scores by
    those indices (8nk more); with route_groups G > 1 (DeepSeek-V3's node-limited routing) also
    each group's two best indices (16nG) and the allowed-expert mask (nE bools). Left out: the
    renormalisation's few float32 values per token (its sums, at most 4n(k + 2): 0.9% of the
    tiny deepseek MoE layer of tests/test_cost_mla.py, 0.01% of DeepSeek-V3's)."""
    E, k, G = cfg.n_experts, cfg.top_k, cfg.route_groups
    out = 4 * n * E + 8 * n * k
    if cfg.router == "sigmoid":
        out += 8 * n * k + ((16 * n * G + n * E) if G > 1 else 0)
    return out


def mla_activation_bytes(cfg: ModelConfig, plan: Plan, fused_attention: bool) -> dict:
    """What multi-head latent attention (mini3d.models.mla, the deepseek family) keeps for
    backward, one micro-batch, one tp rank, in place of the q/k/v, projection-input and core terms
    (the block's norms and its input to the down-projections are `_llama_terms`' replicated 6 sbh):
    {"latents": the down-projections' outputs, whole on every tp rank (tp splits the heads, not
    the latents): the query latent as its RMSNorm keeps it (input, normalised, output: 3 q_lora_rank
    wide; none without a query latent), kv_a's whole output [kv latent | rotary key]
    (kv_lora_rank + qk_rope_dim, the norm's input), the kv latent normalised and its norm's output
    (2 kv_lora_rank); "heads": the tp-local heads' q and k after the rotation and the shared
    rotary key's expansion (n * (qk_nope_dim + qk_rope_dim) each), v made contiguous and the
    projection's input (n * v_head_dim each); "core": the softmax probabilities (a*s^2*b*e, the
    explicit core) or the fused kernel's output (n * v_head_dim: its (b, a, s, v) layout makes the
    projection's input a second tensor) and float32 log-sum-exp; with ring attention (cp > 1) v
    travels padded to q's width (mini3d.models.mla), so v and the float32 output are that wide.
    Per token, the kv latent and the rotary key are all a KV cache needs to keep
    (`mini3d.cost.kv_cache.kv_cache_bytes`); training keeps the expanded keys and values as well.
    Left out, like the other families' small terms: each RMSNorm's float32 rstd (4sb), the
    rotary cos/sin tables (s * qk_rope_dim each) and the explicit core's causal mask (s^2 bools);
    with them the count is exact against the saved-tensor ledger (tests/test_cost_mla.py)."""
    s, b, t, e = local_seq_len(plan), plan.micro_batch_size, plan.tp, ELEMENT_BYTES[plan.dtype]
    n, qk, r = cfg.n_heads, cfg.head_dim, cfg.kv_lora_rank
    v = qk if plan.cp > 1 else cfg.v_head_dim  # ring attention pads v to k's width
    latents = (3 * cfg.q_lora_rank + r + cfg.qk_rope_dim + 2 * r) * s * b * e
    heads = n * (2 * qk + v + cfg.v_head_dim) * s * b * e / t
    if plan.cp > 1:
        core = (4 * s * b * n * qk + 4 * n * s * b) / t
    elif fused_attention:
        core = (n * cfg.v_head_dim * s * b * e + 4 * n * s * b) / t
    else:
        core = n * s * s * b * e / t
    return {"latents": latents, "heads": heads, "core": core}


def _llama_terms(cfg: ModelConfig, fused_attention: bool) -> tuple[int, int, int]:
    """The llama family's counts in `layer_activation_bytes`, measured with the saved-tensor
    ledger (tests/test_memory.py): (replicated tensors in units of sbh*e, saved q/k/v width,
    saved MLP width). Each RMSNorm keeps its input, the normalised x and (for the next matmul) its
    output: 3 sbh each, 6 for two (LayerNorm's fused kernel keeps 2). The explicit core keeps
    contiguous q, k, v, (h + 2 kv) wide with kv = n_kv_heads * head_dim (grouped-query attention:
    the smaller K/V); the fused one keeps the rotated q and k (h + kv) and, through v, the whole
    qkv output (h + 2 kv). SwiGLU keeps gate, up, silu(gate) and their product: 4 f."""
    h, kv = cfg.d_model, cfg.kv_dim
    return 6, (2 * h + 3 * kv) if fused_attention else (h + 2 * kv), 4 * cfg.d_ff


def inflight_microbatches(plan: Plan, stage: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak, in whole-stage units:
    the schedule kind's `in_flight` chunks (`mini3d.pp.schedules.in_flight_bound`, what the
    schedules promise and check() proves), each 1/v of the stage. E.g. 1F1B: min(m, pp - stage);
    interleaved 1F1B's rank 0 holds (1 + (pp-1)/(pp*v)) * pp micro-batches' worth of its layers
    (Korthikanti et al. 2022, sec. 4.2.3) when pp divides m."""
    v = plan.virtual_stages
    return in_flight_bound(plan.schedule, plan.pp, plan.micro_batches, v, stage) / v


def head_microbatches(plan: Plan) -> int:
    """Micro-batches whose head activations (log-softmax etc.) the last stage holds at once: the
    schedule kind's `head_in_flight` (all m when every forward runs first, min(m, pp) for ZB-H1,
    whose last rank runs its W pp - 1 micro-batches late, else 1)."""
    return schedule_kind(plan.schedule).head_in_flight(plan.pp, plan.micro_batches)


def head_activation_bytes(cfg: ModelConfig, plan: Plan) -> float:
    """Last stage, one micro-batch: ln_f input, output-projection input and the fp32 log-softmax
    over the tp-local vocabulary slice that cross-entropy keeps for backward."""
    s, b, h, t = local_seq_len(plan), plan.micro_batch_size, cfg.d_model, plan.tp
    e = ELEMENT_BYTES[plan.dtype]
    ln = s * b * h * e / (t if plan.sequence_parallel else 1)
    if cfg.llama_like:
        ln *= 2  # RMSNorm keeps its input and the normalised x (see _llama_terms)
    return ln + s * b * h * e + s * b * padded_size(cfg.vocab_size, t) // t * 4


__all__ = ["ELEMENT_BYTES", "local_seq_len", "ring_block_bytes", "paper_layer_activation_bytes", "layer_activation_bytes", "moe_tokens", "moe_activation_bytes", "router_activation_bytes", "mla_activation_bytes", "inflight_microbatches", "head_microbatches", "head_activation_bytes"]
