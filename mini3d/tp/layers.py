"""Tensor-parallel layers, each built FROM the full reference layer by slicing this tp_rank's shard.

Because the shard is a copy of rows/columns of the very tensor the single-process model holds,
tp=N starts bit-equal to tp=1. Every sharded parameter carries three attributes that say how to put
the full tensor back together (used by `full_state_dict` / `full_grads` and checkpoints):

* `tp_dim`: the dim that is split;
* `tp_index`: LongTensor, the full-tensor indices along `tp_dim` held by tp ranks 0, 1, ... in turn
  (indices of the *padded* full tensor);
* `tp_full_size`: the real (unpadded) size of that dim.

Parameters without `tp_dim` are replicated on every tp rank.

Vocabulary padding: a vocabulary V that tp does not divide is padded to Vp = tp * ceil(V / tp). The
padded embedding rows are never looked up (token ids are < V); the padded output-head rows are zero
and their logits are masked to -inf by the vocab-parallel cross-entropy, so they get zero gradient
and stay zero under AdamW, and the loss equals the unpadded one.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mini3d.wgrad import linear

from mini3d.tp import mappings


def padded_size(n: int, tp: int) -> int:
    """`n` rounded up to a multiple of tp (the padded vocabulary)."""
    return tp * math.ceil(n / tp)


def chunk_index(n: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Indices of tp_rank's contiguous chunk of a dim of size n (padded to a multiple of tp)."""
    per = padded_size(n, tp) // tp
    return torch.arange(tp_rank * per, (tp_rank + 1) * per, device="cpu")


def head_index(q_dim: int, tp: int, tp_rank: int, kv_dim: int | None = None) -> torch.Tensor:
    """Rows of the fused qkv weight (rows [q heads | k heads | v heads]) owned by tp_rank: its heads'
    rows of q, then of k, then of v. Heads are dealt in contiguous groups of n_heads / tp (query
    heads, `q_dim` = n_heads * head_dim wide: d_model unless the head width is explicit) and
    n_kv_heads / tp (key/value heads, `kv_dim` = n_kv_heads * head_dim wide; default q_dim), so
    each rank's query heads read only its own key/value heads."""
    kv_dim = q_dim if kv_dim is None else kv_dim
    q, kv = chunk_index(q_dim, tp, tp_rank), chunk_index(kv_dim, tp, tp_rank)
    return torch.cat([q, kv + q_dim, kv + q_dim + kv_dim])


def _shard(full: torch.Tensor, dim: int, index: list[torch.Tensor], tp_rank: int,
           padded: int) -> nn.Parameter:
    """This rank's slice of `full` along `dim` (zero rows where the index points into padding)."""
    n = full.shape[dim]
    if padded > n:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - n
        full = torch.cat([full, full.new_zeros(pad_shape)], dim)
    p = nn.Parameter(full.detach().index_select(dim, index[tp_rank].to(full.device)).clone())
    p.tp_dim, p.tp_index, p.tp_full_size = dim, torch.cat(index), n
    return p


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: the output features (rows of W) are split over tp.

    Input: the full activation (B, T, C), made so by `f` (copy_to_tp) or, under sequence
    parallelism, gathered from (B, T/tp, C) shards. Output: this rank's features (B, T, out/tp),
    or, with `gather_output`, all of them (B, T, out) gathered along the last dim.
    `index` lists every tp rank's rows of the full weight (default: contiguous chunks)."""

    def __init__(self, full: nn.Linear, axis, index: list[torch.Tensor] | None = None,
                 sequence_parallel: bool = False, gather_output: bool = False):
        super().__init__()
        self.axis, self.sequence_parallel, self.gather_output = axis, sequence_parallel, gather_output
        tp, out = axis.size, full.out_features
        index = index or [chunk_index(out, tp, r) for r in range(tp)]
        padded = padded_size(out, tp)
        self.in_features, self.out_features, self.padded_out = full.in_features, out, padded
        self.weight = _shard(full.weight, 0, index, axis.index, padded)  # (out/tp, in)
        self.bias = _shard(full.bias, 0, index, axis.index, padded) if full.bias is not None else None

    def forward(self, x):
        if self.sequence_parallel:
            x = mappings.gather_from_sequence(x, self.axis)  # (B, T/tp, C) -> (B, T, C)
        else:
            x = mappings.copy_to_tp(x, self.axis)  # f
        y = linear(x, self.weight, self.bias)  # (B, T, out/tp)
        return mappings.gather_from_tp(y, self.axis) if self.gather_output else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}/tp={self.axis.size}, " \
               f"sp={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local W_local^T, + b: the input features (columns of W) are split.

    Input: this rank's features (B, T, in/tp), e.g. a column-parallel output. Output: the sum over
    tp by `g` (all-reduce) to (B, T, C), or under sequence parallelism by a reduce-scatter to this
    rank's (B, T/tp, C). The bias is replicated and added once, after the reduction."""

    def __init__(self, full: nn.Linear, axis, sequence_parallel: bool = False):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel
        tp = axis.size
        if full.in_features % tp:
            raise ValueError(f"tp={tp} does not divide in_features={full.in_features}")
        index = [chunk_index(full.in_features, tp, r) for r in range(tp)]
        self.in_features, self.out_features = full.in_features, full.out_features
        self.weight = _shard(full.weight, 1, index, axis.index, full.in_features)  # (out, in/tp)
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x):
        y = linear(x, self.weight)  # partial sum (B, T, C)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence(y, self.axis)  # (B, T/tp, C)
        else:
            y = mappings.reduce_from_tp(y, self.axis)  # g
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"in={self.in_features}/tp={self.axis.size}, out={self.out_features}, " \
               f"sp={self.sequence_parallel}"


class HeadNormTP(nn.Module):
    """A per-head RMSNorm (qwen3's q_norm / k_norm, one (head_dim,) weight for every head) on a
    rank that holds n_heads / tp of the heads. The weight is replicated, but each rank's gradient
    of it covers only its own heads, so it enters through `f` (copy_to_tp): identity forward,
    gradient summed over tp backward. Under sequence parallelism the trainer already sums every
    replicated parameter's gradient over tp (`sum_replicated_grads`), so the weight is used as is.
    The parameter keeps its name (`attn.q_norm.weight`)."""

    def __init__(self, full: nn.RMSNorm, axis, sequence_parallel: bool = False):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.weight, self.eps = full.weight, full.eps
        self.normalized_shape = tuple(full.normalized_shape)

    def forward(self, x):
        w = self.weight if self.sequence_parallel else mappings.copy_to_tp(self.weight, self.axis)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose (padded) vocabulary rows are split over tp.

    Forward: each rank looks up the ids in its row range [start, end) and writes zeros for the
    others; the partial results are summed over tp by `g` (all-reduce) to (B, T, C), or under
    sequence parallelism reduce-scattered to this rank's (B, T/tp, C)."""

    def __init__(self, full: nn.Embedding, axis, sequence_parallel: bool = False):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel
        tp, V = axis.size, full.num_embeddings
        index = [chunk_index(V, tp, r) for r in range(tp)]
        self.vocab_size, self.padded_vocab = V, padded_size(V, tp)
        self.vocab_start = int(index[axis.index][0])
        self.vocab_end = self.vocab_start + self.padded_vocab // tp
        self.weight = _shard(full.weight, 0, index, axis.index, self.padded_vocab)  # (Vp/tp, C)

    def forward(self, idx):
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence(y, self.axis)
        return mappings.reduce_from_tp(y, self.axis)

    def extra_repr(self):
        return f"vocab={self.vocab_size} (padded {self.padded_vocab}) rows " \
               f"[{self.vocab_start}, {self.vocab_end}), sp={self.sequence_parallel}"


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "HeadNormTP", "VocabParallelEmbedding", "padded_size",
           "chunk_index", "head_index"]
