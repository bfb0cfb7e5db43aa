"""Memory estimator: bytes per rank, per pipeline stage, in the categories the live ledger uses.

`estimate_memory(cfg, plan, stage=None)` returns a `MemoryEstimate` with `params`, `grads`,
`optimizer`, `activations` and `comm_buffers` bytes for one rank of pipeline stage `stage`
(default: the stage that needs the most memory), its `total` and `fits(capacity_bytes)`.

Parameters are counted exactly from the layout of `mini3d.model.GPT` (either family, through
`ModelConfig.layer_param_count`): the embedding (token table, vocabulary padded to a multiple of tp
and split over tp; gpt2's position table replicated) lives on the first stage, the head (final norm
and a bias-free output matrix, vocabulary-parallel; a tied one shares the embedding unless it sits
on another stage) on the last. Column-parallel layers (qkv with its smaller K/V under grouped-query
attention, MLP fc and llama's gate) split weight and bias over tp; row-parallel ones (attention proj,
MLP proj) split the weight and replicate the bias; norms are replicated.
Layers are split over the pp * virtual_stages model chunks as evenly as possible, the first chunks
taking one extra layer when the split is uneven (`mini3d.pp.partition_layers`, the split the
pipeline builds); chunk c lives on pipeline rank c % pp, or in a V for the zbv schedule
(`mini3d.pp.partition.stage_rank`: rank 0 then holds the head too). The vocabulary is padded by
`mini3d.tp.layers.padded_size`, micro-batches in flight come from
`mini3d.pp.schedules.in_flight_bound`: the functions the engine itself runs.

Model states (bytes per parameter, ZeRO paper accounting): float32 keeps params 4, grads 4 and
Adam moments 8; bf16 keeps bf16 params 2, bf16 grads 2, and 12 in `optimizer` (fp32 master copy 4
+ Adam moments 8). ZeRO-1 divides `optimizer` by dp, ZeRO-2 also `grads`, ZeRO-3 also `params`;
under context parallelism the cp ranks hold the same weights and ZeRO shards over cp x dp.
Gradients are charged in the dtype they are really held in: `plan.grad_dtype` (float32 by default,
so 4 bytes per gradient under bf16 too; 2 with grad_dtype="bf16", the ZeRO paper's accounting).

Context parallelism (cp > 1) splits each sequence: every per-token activation is that of the rank's
s/cp tokens (`local_seq_len`), and ring attention keeps no s x s matrix (`layer_activation_bytes`);
the K/V blocks travelling the ring are counted in `comm_buffer_bytes` (`ring_block_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import ModelConfig, Plan
from ..dp.buckets import transient_grad_bytes
from ..pp.partition import partition_layers, stage_rank
from ..pp.schedules import in_flight_bound, placement_of
from ..tp.layers import padded_size

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers")
GB = 1e9
STATE_BYTES = {"float32": (4, 4, 8), "bf16": (2, 2, 12)}  # (params, grads, optimizer) per param
ELEMENT_BYTES = {"float32": 4, "bf16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank of pipeline stage `stage` holds at its peak, by category."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    n_params: int  # parameters this rank owns before ZeRO sharding (tp-local, this stage)
    inflight: float  # micro-batches whose activations the stage holds at its peak (layer-weighted)
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.comm_buffers

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    def fits(self, capacity_bytes: float) -> bool:
        return self.total <= capacity_bytes

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("stage",) + CATEGORIES}
        d.update(total=self.total, n_params=self.n_params, inflight=self.inflight, detail=self.detail)
        return d

    def summary(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GB:.2f}" for k in CATEGORIES)
        return f"stage {self.stage}: {self.total / GB:.2f} GB per rank ({parts} GB)"


# ----------------------------------------------------------------------------- parameters

def stage_layers(cfg: ModelConfig, plan: Plan, stage: int) -> list[int]:
    """Every layer pipeline rank `stage` holds (all of its virtual chunks)."""
    chunks = partition_layers(cfg.n_layers, plan.pp, plan.virtual_stages)
    where = placement_of(plan.schedule)
    return [i for c, ids in enumerate(chunks) if stage_rank(c, plan.pp, where) == stage
            for i in ids]


def head_rank(plan: Plan) -> int:
    """The pipeline rank that holds the last model chunk (head and loss): pp - 1, or 0 for zbv."""
    return stage_rank(plan.pp * plan.virtual_stages - 1, plan.pp, placement_of(plan.schedule))


def layer_params(cfg: ModelConfig, tp: int) -> int:
    """Parameters of one transformer block on one tp rank (`ModelConfig.layer_param_count`)."""
    return cfg.layer_param_count(tp)


def stage_param_count(cfg: ModelConfig, plan: Plan, stage: int) -> int:
    """Exact parameters on one tp rank of pipeline stage `stage` (before ZeRO sharding). A tied
    head shares the embedding when one rank holds both; with pp > 1 the last stage keeps a copy."""
    h, t = cfg.d_model, plan.tp
    n = len(stage_layers(cfg, plan, stage)) * layer_params(cfg, t)
    table = padded_size(cfg.vocab_size, t) * h // t
    if stage == 0:
        n += table + cfg.position_params()
    if stage == head_rank(plan):
        n += cfg.norm_params() + (0 if cfg.tie_embeddings and head_rank(plan) == 0 else table)
    return n


def sharding_degree(plan: Plan) -> int:
    """Ranks that hold the same parameters and share ZeRO's shards: cp x dp."""
    return plan.dp * plan.cp


def model_state_bytes(n_params: float, dtype: str, dp: int, zero: int,
                      grad_dtype: str | None = None) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per rank for `n_params` parameters under ZeRO-`zero`;
    gradients in `grad_dtype` when given (else the paper's: the parameters' dtype)."""
    p, g, o = STATE_BYTES[dtype]
    if grad_dtype is not None:
        g = ELEMENT_BYTES[grad_dtype]
    shard = lambda per, stage_from: n_params * per / (dp if zero >= stage_from else 1)  # noqa: E731
    return (math.ceil(shard(p, 3)), math.ceil(shard(g, 2)), math.ceil(shard(o, 1)))


# ----------------------------------------------------------------------------- activations

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
                           recompute: str | None = None) -> dict:
    """Bytes one transformer block keeps for backward, one micro-batch, on one tp rank.

    Adapted from Korthikanti et al. 2022 (s*b*h*(34 + 5*a*s/h) at 16 bits), term by term, with
    e = element bytes (2 for bf16, 4 for float32), f = d_ff and tp = t:

    * LayerNorm inputs 4sbh -> 2 * sbh*e (ln1, ln2); replicated over tp unless sequence parallel.
    * qkv input 2sbh and MLP fc input 2sbh -> 2 * sbh*e (the LayerNorm outputs); same tp rule.
    * Q, K (4sbh) and V (2sbh) -> 3 * sbh*e / t (the qkv output, saved by the attention core).
    * softmax 2as^2b + its dropout mask as^2b + dropout output 2as^2b: mini3d has no dropout and
      writes the attention core out (mini3d.model.attention_core), so it keeps the softmax
      probabilities: a*s^2*b*e / t (`plan.attention="explicit"`, the default). A fused kernel
      (`plan.attention="sdpa"`: scaled_dot_product_attention's flash path) keeps only its output
      and the fp32 log-sum-exp (4*a*s*b / t); the output is laid out (b, s, a, h/a), so the
      projection's input below is a view of it, not a second copy (measured: tests/test_attention.py).
      `fused_attention` overrides the plan.
    * attention projection input 2sbh -> sbh*e / t (the core's output, made contiguous).
    * attention and MLP dropout masks (sbh each): absent (no dropout).
    * GELU input 8sbh and MLP projection input 8sbh -> 2 * sbf*e / t (Korthikanti has f = 4h).

    * ring attention (cp > 1, either block math): its float32 output and log-sum-exp,
      4*s*b*h/t + 4*a*s*b/t with s the local s/cp tokens (the output is laid out (b, a, s, h/a), so
      the projection's input is a second tensor); q, k, v are views of the qkv output above.
    Selective recompute drops the attention core term (recomputed from Q, K, V). Full recompute
    keeps only the block input, sbh*e (/ t under sequence parallelism), Korthikanti's 2sbh.
    With e = 2, f = 4h, a math kernel and dropout masks added back, the sum is the paper's
    formula (tested). Returns {"stored": bytes kept per layer per micro-batch, "full": bytes
    the block keeps without recompute (the transient peak while one block is recomputed)}.
    """
    s, b, h, a, f = local_seq_len(plan), plan.micro_batch_size, cfg.d_model, cfg.n_heads, cfg.d_ff
    t, e = plan.tp, ELEMENT_BYTES[plan.dtype]
    if fused_attention is None:
        fused_attention = plan.attention == "sdpa"
    sbh = s * b * h * e
    if cfg.family == "llama":
        rep, qkv, mlp = _llama_terms(cfg, fused_attention)
    else:
        rep, qkv, mlp = 4, 3 * h, 2 * f
    rep = rep * sbh / (t if plan.sequence_parallel else 1)
    core = 4 * a * s * b / t if fused_attention else a * s * s * b * e / t
    if plan.cp > 1:
        core = (4 * s * b * h + 4 * a * s * b) / t
    split = (qkv * s * b * e + sbh + mlp * s * b * e) / t
    full = rep + split + core
    recompute = plan.recompute if recompute is None else recompute
    if recompute == "full":
        stored = sbh / (t if plan.sequence_parallel else 1)
    elif recompute == "selective":
        stored = rep + split
    else:
        stored = full
    return {"stored": stored, "full": full}


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
    """Micro-batches whose activations pipeline rank `stage` holds at its peak, in whole-stage units.

    GPipe runs every forward first: m; looped BFS likewise (m v chunks of 1/v). 1F1B:
    min(m, pp - stage). Interleaved 1F1B (Megatron's order): rank r runs 2*(pp-r-1) + (v-1)*g
    warm-up chunk forwards (g = pp when pp divides m, else PyTorch's round m // max(1, m // pp)),
    plus the one in flight, each chunk being 1/v of the stage, capped at m*v chunks. Rank 0 holds
    (1 + (pp-1)/(pp*v)) * pp micro-batches' worth of its layers (Korthikanti et al. 2022, sec.
    4.2.3). ZB-H1: a micro-batch lives until its W, which rank r runs r micro-batches late:
    min(m, pp) on every rank, 1F1B's peak. ZB-V: the peak of its order, at most 2 pp half chunks.
    All from `mini3d.pp.schedules.in_flight_bound`, what the schedules promise and check() proves."""
    v = plan.virtual_stages
    return in_flight_bound(plan.schedule, plan.pp, plan.micro_batches, v, stage) / v


def head_microbatches(plan: Plan) -> int:
    """Micro-batches whose head activations (log-softmax etc.) the last stage holds at once: all m
    when every forward runs first (GPipe, looped BFS), min(m, pp) for ZB-H1 (the last rank runs its
    W pp - 1 micro-batches late and the graph, head included, stays until W), else 1 (ZB-V runs
    the last chunk's F, B and W back to back on rank 0)."""
    if plan.schedule in ("gpipe", "looped-bfs"):
        return plan.micro_batches
    if plan.schedule == "zb-h1":
        return min(plan.micro_batches, plan.pp)
    return 1


def head_activation_bytes(cfg: ModelConfig, plan: Plan) -> float:
    """Last stage, one micro-batch: ln_f input, output-projection input and the fp32 log-softmax
    over the tp-local vocabulary slice that cross-entropy keeps for backward."""
    s, b, h, t = local_seq_len(plan), plan.micro_batch_size, cfg.d_model, plan.tp
    e = ELEMENT_BYTES[plan.dtype]
    ln = s * b * h * e / (t if plan.sequence_parallel else 1)
    if cfg.family == "llama":
        ln *= 2  # RMSNorm keeps its input and the normalised x (see _llama_terms)
    return ln + s * b * h * e + s * b * padded_size(cfg.vocab_size, t) // t * 4


def comm_buffer_bytes(cfg: ModelConfig, plan: Plan) -> dict:
    """Buffers communication needs besides the tensors above (stated choices, not measurements):
    dp: the gradient buckets alive during backward beyond the persistent gradients
    (`mini3d.dp.buckets.transient_grad_bytes`: ZeRO-2 buckets of bucket_mb, ZeRO-3 one block's
    gradients, each with its reduce-scatter output); ZeRO-3: one block's gathered
    parameters plus the prefetched next; pp: a send and a receive activation buffer;
    sequence parallel: one all-gathered (s, b, h) input; cp: ring attention's backward, the peak
    (the K/V block held and the one arriving, and three float32 dK/dV accumulators: the one being
    summed, the one arriving, the one leaving)."""
    e = ELEMENT_BYTES[plan.dtype]
    sbh = local_seq_len(plan) * plan.micro_batch_size * cfg.d_model * e
    out = {"dp": 0.0, "zero3": 0.0, "pp": 0.0, "tp": 0.0, "cp": 0.0}
    d = sharding_degree(plan)
    if d > 1:
        g = ELEMENT_BYTES[plan.grad_dtype] if plan.dtype == "bf16" else e
        # buckets close at bucket_mb of parameter bytes; their gradients take g bytes an element
        bucket = layer_params(cfg, plan.tp) * g if plan.zero == 3 else plan.bucket_mb * 2**20 * g / e
        out["dp"] = transient_grad_bytes(bucket, d, plan.zero)
    if plan.cp > 1:
        out["cp"] = 2 * ring_block_bytes(cfg, plan) + 3 * ring_block_bytes(cfg, plan, 4)
    if d > 1 and plan.zero == 3:
        out["zero3"] = 2 * layer_params(cfg, plan.tp) * e
    if plan.pp > 1:
        out["pp"] = 2 * sbh / (plan.tp if plan.sequence_parallel else 1)
    if plan.tp > 1 and plan.sequence_parallel:
        out["tp"] = sbh
    return out


# ----------------------------------------------------------------------------- the estimate

def estimate_stage(cfg: ModelConfig, plan: Plan, stage: int,
                   fused_attention: bool | None = None) -> MemoryEstimate:
    """Memory of one rank of pipeline stage `stage`."""
    if not 0 <= stage < plan.pp:
        raise ValueError(f"stage={stage} is outside pp={plan.pp} stages (choose 0..{plan.pp - 1})")
    n = stage_param_count(cfg, plan, stage)
    params, grads, optimizer = model_state_bytes(n, plan.dtype, sharding_degree(plan), plan.zero,
                                                 plan.grad_dtype if plan.dtype == "bf16" else None)
    layers = len(stage_layers(cfg, plan, stage))
    per_layer = layer_activation_bytes(cfg, plan, fused_attention)
    inflight = inflight_microbatches(plan, stage)
    act = inflight * layers * per_layer["stored"]
    if plan.recompute == "full" and layers:
        act += per_layer["full"]  # the block being recomputed during backward
    head = 0.0
    if stage == head_rank(plan):
        head = head_microbatches(plan) * head_activation_bytes(cfg, plan)
    buffers = comm_buffer_bytes(cfg, plan)
    detail = {"layers": layers, "layer_stored_bytes": per_layer["stored"],
              "layer_full_bytes": per_layer["full"], "head_bytes": head,
              "comm_buffers": buffers}
    return MemoryEstimate(stage, params, grads, optimizer, math.ceil(act + head),
                          math.ceil(sum(buffers.values())), n, inflight, detail)


def estimate_all_stages(cfg: ModelConfig, plan: Plan, fused_attention: bool | None = None):
    return [estimate_stage(cfg, plan, s, fused_attention) for s in range(plan.pp)]


def estimate_memory(cfg: ModelConfig, plan: Plan, stage: int | None = None,
                    fused_attention: bool | None = None) -> MemoryEstimate:
    """Memory per rank of stage `stage`, or of the stage that needs the most when `stage` is None."""
    if stage is not None:
        return estimate_stage(cfg, plan, stage, fused_attention)
    return max(estimate_all_stages(cfg, plan, fused_attention), key=lambda e: e.total)


__all__ = ["MemoryEstimate", "CATEGORIES", "estimate_memory", "estimate_stage", "estimate_all_stages",
           "model_state_bytes", "stage_param_count", "stage_layers", "layer_params",
           "layer_activation_bytes", "paper_layer_activation_bytes",
           "inflight_microbatches", "local_seq_len", "ring_block_bytes", "sharding_degree"]
