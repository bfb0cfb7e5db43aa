"""`apply_tp`: turn a reference `mini3d.models.transformer.GPT` (or one pipeline stage of it) into its tp_rank's
shard, in place, plus the helpers a trainer and the parity tests need around it.

What each module becomes (Megatron-LM's layout; `f`/`g` are in mappings.py):

    embed.wte      VocabParallelEmbedding      rows of the padded vocabulary; g after the lookup
    attn.qkv       ColumnParallelLinear        split BY HEADS: each rank's q, k and v head rows
                                               (grouped-query: its q heads' own k/v heads; qwen2's
                                               q/k/v biases split with their rows)
    attn.q_norm    HeadNormTP                  qwen3's per-head norms: weight replicated, its
    attn.k_norm                                gradient summed over tp (each rank: its heads)
    attn.proj      RowParallelLinear           columns of those heads; g after it
    mlp.fc         ColumnParallelLinear        contiguous chunk of d_ff (and llama's mlp.gate)
    mlp.proj       RowParallelLinear           the matching columns; g after it
    head.out       ColumnParallelLinear        rows of the padded vocabulary (no gather)
    head.loss_fn   VocabParallelLoss           cross-entropy without full logits

Norms, position embeddings and row-parallel biases stay replicated, and so does a MoE layer
(mini3d.models.moe: router, routed experts and shared experts whole on every tp rank, Megatron's
expert-tp = 1) unless `plan.expert_tp` splits its experts like the MLP (mini3d.tp.experts). Kept
whole, without sequence parallelism its input, the norm's output, is the same on every tp rank,
so each rank computes the same output, input gradient and parameter gradients: no f/g operator
and no reduction (an f before it would sum tp equal input gradients, tp times too many). The
shared experts then stay whole too, so that the layer has one rule: under sequence parallelism
the layer runs on the rank's T/tp tokens with no collective inside (a split shared expert would
add an all-gather and a reduce-scatter per layer beside routed experts that need none), and its
gradients are partial sums over those tokens, summed over tp with the norms'
(`sum_replicated_grads`); its router losses pool their statistics over tp first
(`mini3d.models.balance.pool_router_stats_over`). A tied head shares the
embedding's shard when one module holds both.

With `plan.sequence_parallel` the activations between the parallel regions are (B, T/tp, C) shards:
the embedding reduce-scatters along the sequence instead of all-reducing, each column-parallel
input all-gathers the sequence (instead of `f`), each row-parallel output reduce-scatters it
(instead of `g`), and the head gathers the sequence before its vocab-parallel matmul. The
replicated parameters then see only T/tp positions on each rank, so their gradients are partial
sums: call `sync_tp_grads(model, topo)` after backward (it is a no-op without sequence
parallelism), or, under a data-parallel wrapper, `sum_replicated_grads` on the dp-synchronised
gradient shards (the trainer does: sums commute, so the dp sync can overlap backward and the tp
sum follow it). Parameter names are unchanged, so `full_state_dict` keys match the reference's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mini3d import comm
from mini3d.models.transformer import tie_weights
from mini3d.tp.cross_entropy import VocabParallelLoss
from mini3d.tp.experts import apply_expert_tp
from mini3d.tp.mappings import copy_to_tp, gather_from_sequence
from mini3d.tp.layers import (ColumnParallelLinear, HeadNormTP, RowParallelLinear, VocabParallelEmbedding,
                              head_index)


class ParallelEmbedding(nn.Module):
    """Token (vocab-parallel) + position embeddings; under sequence parallelism it returns this
    rank's (B, T/tp, C) shard: the token part is reduce-scattered along the sequence and only this
    rank's positions are added."""

    def __init__(self, ref, axis, sequence_parallel: bool):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.wte = VocabParallelEmbedding(ref.wte, axis, sequence_parallel)
        self.wpe = ref.wpe  # replicated (None: rotary positions, applied in attention)
        self.drop = ref.drop

    def forward(self, idx, positions=None):
        x = self.wte(idx)  # (B, T, C) or (B, T/tp, C)
        if self.wpe is None:
            return self.drop(x)
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        if self.sequence_parallel and self.axis.size > 1:
            pos = pos.chunk(self.axis.size)[self.axis.index]
        return self.drop(x + self.wpe(pos))


def _parallelize_mla(attn, axis, cfg, sp: bool):
    """deepseek's latent attention split by heads: the per-head up-projections (q_b, or the full
    q, and kv_b) column-parallel, the output projection row-parallel. The down-projections to the
    latents (q_a, kv_a) and the latents' norms stay replicated: they are small (a latent is a few
    hundred wide against n_heads * head widths) and every head needs the whole latent, so
    splitting them would only add a gather. Without sequence parallelism their gradients come out
    whole on every rank: the latents enter q_b / kv_b through `f` (copy_to_tp), and the shared
    rotary key, which every rank's heads read, through `f` too (`MLA.share_key`).

    Under sequence parallelism (Megatron-Core's MLA does the same) the down-projections and the
    latent norms run on the rank's T/tp tokens, and what is gathered along the sequence is their
    output, the normed latents (q_b / kv_b column-parallel with sequence_parallel: all-gather
    forward, reduce-scatter of the heads' partial gradients backward) and the shared rotary key
    (`share_key`: the same gather), not the d_model-wide input: q_lora_rank + kv_lora_rank +
    qk_rope_dim features a token (2112 for DeepSeek-V3, against 7168) and no down-projection
    computed tp times. q_a, kv_a and the norms are then replicated parameters whose gradients
    cover the rank's tokens only: the trainer sums them over tp with the other sp-replicated
    ones (`sum_replicated_grads`)."""
    tp = axis.size
    for name in ("q", "q_b", "kv_b"):
        if getattr(attn, name) is not None:
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), axis,
                                                     sequence_parallel=sp))
    attn.proj = RowParallelLinear(attn.proj, axis, sequence_parallel=sp)
    if sp:
        attn.share_key = lambda t: gather_from_sequence(t, axis)
    else:
        attn.share_key = lambda t: copy_to_tp(t, axis)
    attn.n_local_heads = attn.n_local_kv_heads = cfg.n_heads // tp


def _parallelize_block(block, axis, cfg, sp: bool, expert_tp: bool = False):
    tp = axis.size
    attn, mlp = block.attn, block.mlp
    if not hasattr(mlp, "fc"):  # a MoE layer: whole (see the module docstring), or expert-tp
        if expert_tp:
            apply_expert_tp(mlp, axis, sp, _parallelize_mlp)
        mlp = None
    if cfg.mla:
        _parallelize_mla(attn, axis, cfg, sp)
        return _parallelize_mlp(mlp, axis, sp)
    heads = [head_index(cfg.q_dim, tp, r, cfg.kv_dim) for r in range(tp)]
    attn.qkv = ColumnParallelLinear(attn.qkv, axis, index=heads, sequence_parallel=sp)
    attn.proj = RowParallelLinear(attn.proj, axis, sequence_parallel=sp)
    if attn.q_norm is not None:
        attn.q_norm, attn.k_norm = (HeadNormTP(n, axis, sp) for n in (attn.q_norm, attn.k_norm))
    attn.n_local_heads, attn.n_local_kv_heads = cfg.n_heads // tp, cfg.n_kv_heads // tp
    _parallelize_mlp(mlp, axis, sp)


def _parallelize_mlp(mlp, axis, sp: bool):
    if mlp is None:  # a MoE layer (_parallelize_block)
        return
    mlp.fc = ColumnParallelLinear(mlp.fc, axis, sequence_parallel=sp)
    if mlp.gate is not None:  # SwiGLU: the gate splits like fc, so silu(gate) * fc stays local
        mlp.gate = ColumnParallelLinear(mlp.gate, axis, sequence_parallel=sp)
    mlp.proj = RowParallelLinear(mlp.proj, axis, sequence_parallel=sp)


def apply_tp(model, topo, plan):
    """Shard `model` (a reference GPT or pipeline stage) over `topo.tp` in place and return it.

    Build the optimizer AFTER this call (the sharded parameters are new tensors). tp=1 runs the
    very same code (every collective on a one-member axis is the identity)."""
    axis, cfg = topo.tp, model.cfg
    problems = [p for p in plan.problems(cfg) if p.startswith(("tp=", "sequence", "expert_tp"))]
    if plan.tp != axis.size:
        problems.append(f"plan.tp={plan.tp} != size of the tp axis {axis.size}")
    if problems:
        raise ValueError("cannot apply tensor parallelism: " + "; ".join(problems))
    sp = bool(plan.sequence_parallel)
    if model.embed is not None:
        model.embed = ParallelEmbedding(model.embed, axis, sp)
    for block in model.blocks.values():
        _parallelize_block(block, axis, cfg, sp, bool(getattr(plan, "expert_tp", False)))
    if model.head is not None:
        out = ColumnParallelLinear(model.head.out, axis, sequence_parallel=sp)
        model.head.out = out
        start = axis.index * (out.padded_out // axis.size)
        model.head.loss_fn = VocabParallelLoss(axis, start, cfg.vocab_size)
    tie_weights(model)  # both ends split the padded vocabulary alike, so one shard serves both
    model.tp_axis, model.sequence_parallel = axis, sp
    return model


def is_tp_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "tp_dim")


def _unshard(t: torch.Tensor, p, axis) -> torch.Tensor:
    """The full tensor of sharded parameter `p` from this rank's shard `t` (its value or grad)."""
    dim = p.tp_dim
    front = t.detach().movedim(dim, 0).contiguous()
    gathered = front.new_empty((axis.size * front.shape[0],) + tuple(front.shape[1:]))
    comm.all_gather(gathered, front, axis)
    full = torch.empty_like(gathered)
    full.index_copy_(0, p.tp_index.to(full.device), gathered)
    return full[:p.tp_full_size].movedim(0, dim).contiguous()


def _full(model, topo, which: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach() if which == "data" else p.grad
        if t is None:
            t = torch.zeros_like(p)
        out[name] = _unshard(t, p, topo.tp) if is_tp_sharded(p) else t.detach().clone()
    return out


def full_state_dict(model, topo) -> dict[str, torch.Tensor]:
    """name -> full parameter tensor (shards gathered over tp, vocab padding dropped), keyed like
    the reference model. Collective: every tp rank must call it."""
    return _full(model, topo, "data")


def full_grads(model, topo) -> dict[str, torch.Tensor]:
    """name -> full gradient (zeros where .grad is None). Call after `sync_tp_grads`.
    Collective: every tp rank must call it."""
    return _full(model, topo, "grad")


def shard_like(p, full: torch.Tensor, topo) -> torch.Tensor:
    """This tp_rank's slice of `full`, a tensor shaped like the full version of parameter `p`
    (its value, or an optimizer moment of it); vocab padding rows become zeros. No communication."""
    if not is_tp_sharded(p):
        return full
    dim, idx = p.tp_dim, p.tp_index.chunk(topo.tp.size)[topo.tp.index].to(full.device)
    n = full.shape[dim]
    if len(p.tp_index) == n:
        return full.index_select(dim, idx)
    # Padding indices (>= n) select row n-1 and are then zeroed: the only allocation is the slice
    # (padding `full` itself would be a second full-size copy, alive next to `full`).
    pad = (idx >= n).nonzero().squeeze(1)
    return full.index_select(dim, idx.clamp(max=n - 1)).index_fill_(dim, pad, 0)


@torch.no_grad()
def materialize_reference(model, topo, seed: int, device) -> None:
    """Give a model built on the meta device (and sharded there by `apply_tp`) its reference initial
    values on `device`: each parameter's tp slice of `mini3d.models.transformer.reference_init`, one full
    parameter in host memory at a time (instead of the whole unsliced stage on every rank).
    The Parameter objects are replaced (meta tensors hold no storage to fill) and keep their marks."""
    from mini3d.models.transformer import reference_init

    done: dict[int, tuple] = {}  # id(meta Parameter) -> (it, kept so ids stay unique; replacement)
    for mod_name, mod in model.named_modules():
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in done:  # a tied head: the embedding's value, not a second full transient
                mod._parameters[key] = done[id(p)][1]
                continue
            shape = list(p.shape)
            if is_tp_sharded(p):
                shape[p.tp_dim] = p.tp_full_size
            name = f"{mod_name}.{key}" if mod_name else key
            full = reference_init(name, tuple(shape), seed, model.cfg)
            new = nn.Parameter(shard_like(p, full, topo).to(device), p.requires_grad)  # a new tensor
            new.__dict__.update(p.__dict__)  # tp_dim, tp_index, tp_full_size
            mod._parameters[key], done[id(p)] = new, (p, new)
            del full  # before the next parameter's value is drawn: one full parameter at a time
        for key, b in list(mod._buffers.items()):  # a MoE layer's expert biases: zero at the start
            if b is not None and b.is_meta:
                mod._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    tie_weights(model)  # a tied head was visited twice above: share one Parameter again


def unshard_like(p, t: torch.Tensor, topo) -> torch.Tensor:
    """Inverse of `shard_like`: the full tensor from this rank's slice `t` (collective over tp)."""
    return _unshard(t, p, topo.tp) if is_tp_sharded(p) else t.detach().clone()


@torch.no_grad()
def load_full_state_dict(model, topo, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `full_state_dict`: copy this tp_rank's slice of each full tensor into the sharded
    model (vocab padding rows become zeros). No communication; names as in the reference."""
    for name, p in model.named_parameters():
        p.copy_(shard_like(p, state[name].to(p.device, p.dtype), topo))


def gather_logits(logits: torch.Tensor, topo, vocab_size: int) -> torch.Tensor:
    """Full (B, T, V) logits from the vocab-sharded ones `head(x)` returns without targets
    (all-gather over tp along the last dim, padding dropped). For evaluation and sampling."""
    from mini3d.tp.mappings import gather_from_tp

    return gather_from_tp(logits, topo.tp)[..., :vocab_size]


def boundary_shape(plan, micro_batch_size: int, cfg) -> tuple[int, int, int]:
    """Per-rank activation shape sent between pipeline stages: (b, s, h), or (b, s/tp, h) under
    sequence parallelism (each tp rank sends only its sequence shard)."""
    s = plan.seq_len // plan.cp  # a cp rank's chunk of the sequence
    s = s // plan.tp if plan.sequence_parallel else s
    return (micro_batch_size, s, cfg.d_model)


__all__ = ["apply_tp", "full_state_dict", "full_grads", "boundary_shape",
           "load_full_state_dict", "gather_logits",
           "ParallelEmbedding", "is_tp_sharded"]
