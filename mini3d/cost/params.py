"""Where the parameters live: how many one rank holds, per pipeline stage, and over how many
ranks ZeRO shards them (the memory estimator's, the time model's and the dry run's one count).

Parameters are counted exactly from the layout of `mini3d.models.transformer.GPT` (either family,
through `ModelConfig.layer_param_count`): the embedding (token table, vocabulary padded to a
multiple of tp and split over tp; gpt2's position table replicated) lives on the first stage, the
head (final norm and a bias-free output matrix, vocabulary-parallel; a tied one shares the
embedding unless it sits on another stage) on the last. Column-parallel layers (qkv with its
smaller K/V under grouped-query attention, MLP fc and llama's gate) split weight and bias over tp;
row-parallel ones (attention proj, MLP proj) split the weight and replicate the bias; norms are
replicated. Layers are split over the pp * virtual_stages model chunks as evenly as possible, the
first chunks taking one extra layer when the split is uneven (`mini3d.pp.partition_layers`, the
split the pipeline builds); chunk c lives on pipeline rank c % pp, or in a V for the zbv schedule
(`mini3d.pp.placement.stage_rank`: rank 0 then holds the head too). The vocabulary is padded by
`mini3d.tp.layers.padded_size`: the functions the engine itself runs.

Mixture of experts: a MoE layer's router and shared experts count as dense weights; its routed
experts are held E / ep per rank (`mini3d.cost.moe.experts_per_rank`), whole on every tp rank,
or split over tp with the shared experts under `plan.expert_tp` (`ModelConfig.moe_params`). Dense parameters are shared (ZeRO) over the dp x cp ranks
(`sharding_degree`), experts over the expert-data-parallel group of dp*cp / ep ranks
(`expert_sharding_degree`).
"""

from __future__ import annotations

import functools

from mini3d.config import ModelConfig, Plan
from mini3d.pp.partition import local_specs
from mini3d.pp.placement import stage_rank
from mini3d.schedule_kinds import schedule_kind
from mini3d.tp.layers import padded_size


# ----------------------------------------------------------------------------- parameters

def stage_chunks(cfg: ModelConfig, plan: Plan, stage: int) -> list:
    """The model chunks (`mini3d.pp.partition.StageSpec`) pipeline rank `stage` holds, placed as
    the plan's schedule kind places them: the partition the pipeline builds."""
    return list(_chunks(stage, cfg.n_layers, plan.pp, plan.virtual_stages,
                        schedule_kind(plan.schedule).placement))


@functools.lru_cache(maxsize=4096)  # the planner asks again for every layout of one (pp, v)
def _chunks(stage: int, n_layers: int, pp: int, v: int, where: str) -> tuple:
    return tuple(local_specs(stage, n_layers, pp, v, placement=where))


def stage_layers(cfg: ModelConfig, plan: Plan, stage: int) -> list[int]:
    """Every layer pipeline rank `stage` holds (all of its virtual chunks)."""
    return [i for spec in stage_chunks(cfg, plan, stage) for i in spec.layers]


def head_rank(plan: Plan) -> int:
    """The pipeline rank that holds the last model chunk (head and loss): pp - 1, or 0 for zbv."""
    where = schedule_kind(plan.schedule).placement
    return stage_rank(plan.pp * plan.virtual_stages - 1, plan.pp, where)


@functools.lru_cache(maxsize=65536)  # ModelConfig is frozen: the planner's layouts share its blocks
def layer_params(cfg: ModelConfig, tp: int, layer: int | None = None, ep: int = 1,
                 expert_tp: bool = False) -> int:
    """Parameters of one transformer block on one tp rank (`ModelConfig.layer_param_count`; a MoE
    `layer` counts the E / ep experts of one ep rank, split over tp with `expert_tp`, or its
    largest block when `layer` is None for a MoE model)."""
    if layer is None and cfg.n_experts:
        return max(cfg.layer_param_count(tp, i, ep=ep, expert_tp=expert_tp)
                   for i in cfg.block_kinds())
    return cfg.layer_param_count(tp, layer, ep=ep, expert_tp=expert_tp)


@functools.lru_cache(maxsize=4096)
def _sum_layer_params(cfg: ModelConfig, tp: int, ep: int, expert_tp: bool, layers: tuple) -> int:
    return sum(layer_params(cfg, tp, i, ep, expert_tp) for i in layers)


def stage_expert_count(cfg: ModelConfig, plan: Plan, stage: int) -> int:
    """Routed-expert parameters one rank of pipeline stage `stage` holds (part of
    `stage_param_count`): experts_per_rank(E, ep) experts in each of its MoE layers, whole or
    (`plan.expert_tp`) their F/tp slices."""
    per_layer = cfg.moe_params(plan.tp, ep=plan.ep, expert_tp=plan.expert_tp)["experts"] \
        if cfg.n_experts else 0
    return per_layer * sum(cfg.is_moe_layer(i) for i in stage_layers(cfg, plan, stage))


def stage_param_count(cfg: ModelConfig, plan: Plan, stage: int) -> int:
    """Exact parameters on one tp rank of pipeline stage `stage` (before ZeRO sharding): its
    chunks' blocks, the embedding where a chunk is `first`, the head where one is `last` (the
    partition's StageSpec says). A tied head shares the embedding when one rank holds both; with
    pp > 1 the last stage keeps a copy."""
    chunks = stage_chunks(cfg, plan, stage)
    first, last = any(c.first for c in chunks), any(c.last for c in chunks)
    n = _sum_layer_params(cfg, plan.tp, plan.ep, plan.expert_tp,
                          tuple(i for c in chunks for i in c.layers))
    table = padded_size(cfg.vocab_size, plan.tp) * cfg.d_model // plan.tp
    if first:
        n += table + cfg.position_params()
    if last:
        n += cfg.norm_params() + (0 if cfg.tie_embeddings and first else table)
    return n


def sharding_degree(plan: Plan) -> int:
    """Ranks that hold the same (dense) parameters and share ZeRO's shards: cp x dp."""
    return plan.dp * plan.cp


def expert_sharding_degree(plan: Plan) -> int:
    """Ranks that hold the same routed experts, reduce their gradients and share ZeRO's shards of
    them: the expert-data-parallel group, dp*cp / ep (= sharding_degree without ep)."""
    return plan.dp * plan.cp // plan.ep


ACTIVE_PARAMS_COUNT = ("the token embedding and the output head, every layer's attention and "
                       "norms, the dense layers' MLPs, and per MoE layer the router, the top_k "
                       "routed experts and the shared experts")


def active_params_convention(cfg: ModelConfig) -> str:
    """What `ModelConfig.active_params` counts, with the number, and the same count without the
    input embedding (a table lookup, no matmul: how DeepSeek's model cards count "activated",
    e.g. DeepSeek-V3's 37B against mini3d's 37.55e9, 36.63e9 without it). A tied table is also
    the head's matmul, so nothing is left out for it. `mini3d estimate` prints this for MoE models."""
    active = cfg.active_params()
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return (f"active_params {active / 1e9:.2f}e9 counts {ACTIVE_PARAMS_COUNT}; without the input "
            f"embedding (a lookup, as DeepSeek's cards count 'activated'): {(active - lookup) / 1e9:.2f}e9")
