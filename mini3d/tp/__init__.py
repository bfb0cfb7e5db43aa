"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with optional sequence parallelism
(Korthikanti et al. 2022).

    mappings.py       f / g and the sequence all-gather / reduce-scatter, as autograd Functions
    layers.py         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    cross_entropy.py  vocab-parallel cross-entropy (no full logits on any rank)
    parallelize.py    apply_tp(model, topo, plan), full_state_dict, full_grads,
                      boundary_shape, load_full_state_dict, gather_logits
    grads.py          sync_tp_grads, sum_replicated_grads, clip_grad_norm_ (the tp sums, the norm)
    experts.py        apply_expert_tp, TPExperts: MoE experts split over tp (`--expert-tp`)
    layout.py         shard_map, comm_per_layer (what each rank holds and each layer sends, as data)
"""

from mini3d.tp.layout import comm_per_layer, shard_map
from mini3d.tp.cross_entropy import vocab_parallel_cross_entropy
from mini3d.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mini3d.tp.mappings import (copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp,
                                reduce_scatter_to_sequence, scatter_to_sequence, scatter_to_tp)
from mini3d.tp.grads import clip_grad_norm_, sum_replicated_grads, sync_tp_grads
from mini3d.tp.parallelize import (apply_tp, boundary_shape, full_grads, full_state_dict, gather_logits,
                                   load_full_state_dict, shard_like, unshard_like, materialize_reference)

__all__ = ["apply_tp", "sync_tp_grads", "sum_replicated_grads", "materialize_reference", "clip_grad_norm_", "full_state_dict", "full_grads",
           "boundary_shape",
           "load_full_state_dict", "gather_logits", "shard_like", "unshard_like",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "copy_to_tp", "reduce_from_tp", "scatter_to_tp",
           "gather_from_tp", "gather_from_sequence", "reduce_scatter_to_sequence",
           "scatter_to_sequence", "shard_map", "comm_per_layer"]
