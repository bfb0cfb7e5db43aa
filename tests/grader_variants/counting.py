"""Wrong answers to the counting exercises: count_params, memory, rank_grid, grad_norm, plan_search,
a2a_volume."""

from __future__ import annotations

from solutions import a2a_volume as _a2a
from solutions import count_params as _cp
from solutions import grad_norm as _gn
from solutions import memory as _mem
from solutions import plan_search as _ps
from solutions.rank_grid import coords as _coords

from . import variant


def no_position_table(cfg):
    return _cp.count_params(cfg) - cfg.max_seq_len * cfg.d_model


def head_bias(cfg):
    return _cp.count_params(cfg) + cfg.vocab_size


def gpus_rounded_down(n_params, gpu_bytes, bytes_per_param=16):
    return n_params * bytes_per_param // gpu_bytes


def no_master_copy(dtype):
    """bf16 AdamW without the fp32 master weights: optimizer 8 bytes, not 12."""
    per = _mem.bytes_per_param(dtype)
    return {**per, "optimizer": 8} if dtype == "bf16" else per


def paper_bf16_grads(dtype):
    """The ZeRO paper's 2 + 2 + 12: bf16 gradients, where mini3d keeps fp32 ones (18 bytes)."""
    per = _mem.bytes_per_param(dtype)
    return {**per, "grads": 2} if dtype == "bf16" else per


def shards_one_category(n_params, dp, zero, dtype="bf16"):
    """Stage s shards only its own new category, not the ones of the stages below."""
    per = _mem.bytes_per_param(dtype)
    only = {0: None, 1: "optimizer", 2: "grads", 3: "params"}[zero]
    return {k: n_params * b / (dp if k == only else 1) for k, b in per.items()}


def pp_before_dp(rank, tp, pp, dp):
    """pp varying faster than dp (dp slowest), the other common grid order."""
    return {"tp": rank % tp, "pp": (rank // tp) % pp, "dp": rank // (tp * pp)}


def groups_by_stride(tp, pp, dp, axis):
    """Groups built as the reference builds them, but from the pp-before-dp grid order."""
    size, groups = {"tp": tp, "pp": pp, "dp": dp}[axis], {}
    for r in range(tp * pp * dp):
        c = pp_before_dp(r, tp, pp, dp)
        groups.setdefault(tuple(v for a, v in sorted(c.items()) if a != axis), [None] * size)[c[axis]] = r
    return sorted(groups.values())


def every_replica(pieces, zero):
    """Sums every piece: ZeRO-0 dp replicas and replicated tp copies counted again and again."""
    return sum(float(p["grad"].double().square().sum()) for p in pieces) ** 0.5


def shards_as_replicas(pieces, zero):
    """Keeps only dp rank 0's pieces even under ZeRO >= 1, where the dp ranks hold disjoint shards."""
    return _gn.global_grad_norm([p for p in pieces if p["dp"] == 0], 0)


def a2a_once_per_token(tokens, top_k, ep, d_model, element_bytes):
    """Each token counted once, not as its top_k token-slots."""
    return _a2a.a2a_bytes(tokens, 1, ep, d_model, element_bytes)


def a2a_local_counted(tokens, top_k, ep, d_model, element_bytes):
    """Every slot counted as traffic, the 1/ep whose expert is at home too."""
    return tokens * top_k * d_model * element_bytes


def send_local_counted(splits, rank, d_model, element_bytes):
    return sum(splits) * d_model * element_bytes


def undo_forgotten(rows, perm):
    """The combined rows returned in dispatch order."""
    return rows


def permutation_again(rows, perm):
    """The permutation applied a second time instead of inverted."""
    return rows[perm]


def clip_without_eps(norm, max_norm):
    return min(1.0, max_norm / norm)


def no_zero3(cfg, n_gpus, global_batch, seq_len, dtype="bf16"):
    """The search space without ZeRO-3 (allowed when pp == 1)."""
    return [p for p in _ps.candidates(cfg, n_gpus, global_batch, seq_len, dtype) if p.zero != 3]


def ignores_limit(cfg, n_gpus, hw, global_batch, seq_len, memory_limit_bytes, dtype="bf16"):
    """The fastest plan, whether or not it fits."""
    return _ps.best_plan(cfg, n_gpus, hw, global_batch, seq_len, float("inf"), dtype)


WRONG = {
    "count_params": [
        ("no_position_table", variant("count_params", "forgets the position table", count_params=no_position_table)),
        ("head_bias", variant("count_params", "gives the head a bias", count_params=head_bias)),
        ("gpus_rounded_down", variant("count_params", "rounds the GPU count down",
                                      min_gpus_for_model_states=gpus_rounded_down)),
    ],
    "memory": [
        ("no_master_copy", variant("memory", "bf16 without the fp32 master copy", bytes_per_param=no_master_copy)),
        ("paper_bf16_grads", variant("memory", "the ZeRO paper's bf16 gradients (16 bytes, not mini3d's 18)",
                                     bytes_per_param=paper_bf16_grads)),
        ("shards_one_category", variant("memory", "stage s shards only its own category",
                                        zero_bytes_per_rank=shards_one_category)),
    ],
    "rank_grid": [
        ("pp_before_dp", variant("rank_grid", "pp varies faster than dp", coords=pp_before_dp)),
        ("groups_by_stride", variant("rank_grid", "dp groups strided by tp * pp", rank_groups=groups_by_stride)),
    ],
    "grad_norm": [
        ("every_replica", variant("grad_norm", "counts every copy", global_grad_norm=every_replica)),
        ("shards_as_replicas", variant("grad_norm", "drops ZeRO shards of dp ranks > 0",
                                       global_grad_norm=shards_as_replicas)),
        ("clip_without_eps", variant("grad_norm", "clip coefficient without the 1e-6", clip_coefficient=clip_without_eps)),
    ],
    "a2a_volume": [
        ("once_per_token", variant("a2a_volume", "counts a token once, not top_k times",
                                   a2a_bytes=a2a_once_per_token)),
        ("local_counted", variant("a2a_volume", "counts the local 1/ep share as traffic",
                                  a2a_bytes=a2a_local_counted, send_bytes=send_local_counted)),
        ("undo_forgotten", variant("a2a_volume", "forgets to undo the permutation", undo=undo_forgotten)),
        ("permutation_again", variant("a2a_volume", "applies the permutation again", undo=permutation_again)),
    ],
    "plan_search": [
        ("no_zero3", variant("plan_search", "leaves ZeRO-3 out of the search", candidates=no_zero3)),
        ("ignores_limit", variant("plan_search", "ignores the memory limit", best_plan=ignores_limit)),
    ],
}
