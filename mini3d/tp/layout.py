"""Tensor parallelism as plain data (no plotting), for the cost model, the course and the tests.

* `shard_map(cfg, tp)`: which rows / columns of each weight matrix live on which tp rank, computed
  by the same index functions `apply_tp` slices with (so the picture cannot disagree with the code).
* `comm_per_layer(t, b, s, h, sequence_parallel, dtype_bytes)`: the collectives one transformer
  layer issues per micro-batch, forward and backward, with payload and ring wire bytes, in the
  byte conventions of `mini3d.comm` (so they equal what the event log measures).
"""

from __future__ import annotations

from mini3d.comm import ring_wire_bytes
from mini3d.config import ModelConfig
from mini3d.tp.layers import chunk_index, head_index, padded_size


def _ranges(index) -> list[tuple[int, int]]:
    """Compress sorted indices into [start, stop) ranges."""
    out: list[list[int]] = []
    for i in index.tolist():
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [tuple(r) for r in out]


def shard_map(cfg: ModelConfig, tp: int) -> list[dict]:
    """For each weight matrix (blocks.* stands for every layer): its full shape, how it is split,
    and per tp_rank the [start, stop) ranges of rows (dim 0) or columns (dim 1) it holds.

    Vocabulary rows at or past `vocab_size` are padding (zero, never used); they appear in the
    ranges of the last ranks and are reported as `padding_rows`."""
    h, f, V, q = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.q_dim
    Vp = padded_size(V, tp)
    hpr = cfg.n_heads // tp
    specs = [
        ("embed.wte.weight", (V, h), 0, "vocab-parallel rows", lambda r: chunk_index(V, tp, r)),
        ("blocks.*.attn.qkv.weight", (q + 2 * cfg.kv_dim, h), 0,
         "column-parallel by heads (q|k|v rows)", lambda r: head_index(q, tp, r, cfg.kv_dim)),
        ("blocks.*.attn.proj.weight", (h, q), 1, "row-parallel (input columns of its heads)",
         lambda r: chunk_index(q, tp, r)),
        ("blocks.*.mlp.fc.weight", (f, h), 0, "column-parallel", lambda r: chunk_index(f, tp, r)),
    ] + ([("blocks.*.mlp.gate.weight", (f, h), 0, "column-parallel (SwiGLU gate, like fc)",
           lambda r: chunk_index(f, tp, r))] if cfg.llama_like else []) + [
        ("blocks.*.mlp.proj.weight", (h, f), 1, "row-parallel", lambda r: chunk_index(f, tp, r)),
    ] + ([] if cfg.tie_embeddings else [  # a tied head is the embedding's matrix
        ("head.out.weight", (V, h), 0, "column-parallel over the vocabulary",
         lambda r: chunk_index(V, tp, r))])
    out = []
    for name, shape, dim, kind, index_of in specs:
        ranks = []
        for r in range(tp):
            idx = index_of(r)
            entry = {"tp_rank": r, ("rows" if dim == 0 else "cols"): _ranges(idx)}
            if "qkv" in name or "attn.proj" in name:
                entry["heads"] = list(range(r * hpr, (r + 1) * hpr))
            if name in ("embed.wte.weight", "head.out.weight"):
                entry["padding_rows"] = int((idx >= V).sum())
            ranks.append(entry)
        out.append({"name": name, "shape": shape, "dim": dim, "kind": kind,
                    "padded": Vp if name in ("embed.wte.weight", "head.out.weight") else None,
                    "ranks": ranks})
    return out


def comm_per_layer(t: int, b: int, s: int, h: int, sequence_parallel: bool = False,
                   dtype_bytes: int = 4) -> dict:
    """Tensor-parallel collectives of ONE transformer layer for one micro-batch.

    Derivation. Let P = b*s*h*dtype_bytes, the bytes of one full activation (b, s, h).
    Without sequence parallelism, attention and MLP each end in a row-parallel matmul whose partial
    outputs are summed by `g` (forward all-reduce of P), and each begins with a column-parallel
    matmul whose input gradient is summed by `f` (backward all-reduce of P): 2 all-reduces forward,
    2 backward. A ring all-reduce sends 2(t-1)/t * P bytes per rank (reduce-scatter + all-gather).
    With sequence parallelism each all-reduce splits into its two halves, placed where the layout
    changes: forward, an all-gather of the (b, s/t, h) shards before each column-parallel matmul and
    a reduce-scatter after each row-parallel one; backward, the mirror image (a reduce-scatter for
    each forward all-gather and an all-gather for each forward reduce-scatter). That is 4 ops of
    (t-1)/t * P wire bytes each way: the same wire volume as 2 all-reduces, while LayerNorm and
    residual activations shrink by t. `bytes` is the payload as `mini3d.comm` logs it (the full
    tensor, P); wire bytes use its integer arithmetic. With t == 1 nothing is communicated.

    Returns {"forward": [ops], "backward": [ops], "forward_ops", "backward_ops", "forward_bytes",
    "backward_bytes", "forward_wire_bytes", "backward_wire_bytes"}; each op is
    {"op", "count", "bytes" (per op), "wire_bytes" (per op, per rank)}."""
    P = b * s * h * dtype_bytes
    if t == 1:
        fwd, bwd = [], []
    elif sequence_parallel:
        fwd = [{"op": op, "count": 2, "bytes": P, "wire_bytes": ring_wire_bytes(op, t, P)}
               for op in ("all_gather", "reduce_scatter")]
        bwd = [dict(op) for op in fwd]
    else:
        fwd = [{"op": "all_reduce", "count": 2, "bytes": P,
                "wire_bytes": ring_wire_bytes("all_reduce", t, P)}]
        bwd = [dict(op) for op in fwd]
    out = {"forward": fwd, "backward": bwd}
    for phase, ops in (("forward", fwd), ("backward", bwd)):
        out[f"{phase}_ops"] = sum(o["count"] for o in ops)
        out[f"{phase}_bytes"] = sum(o["count"] * o["bytes"] for o in ops)
        out[f"{phase}_wire_bytes"] = sum(o["count"] * o["wire_bytes"] for o in ops)
    return out


__all__ = ["shard_map", "comm_per_layer"]
