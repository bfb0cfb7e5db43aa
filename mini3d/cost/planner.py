"""Planner: search the valid layouts of a model on n GPUs, drop those that do not fit, rank the rest.

The search walks tp (dividing n_heads, n_kv_heads and d_ff), pp (at most n_layers), dp = n / (tp * pp) (dividing
the global batch), micro-batch size and count, schedule (1F1B; GPipe; interleaved with 2..8 virtual
stages; the zero-bubble ZB-H1 and, with two chunks per rank, ZB-V), ZeRO stage (0-2, and 3 without pipelining) and recompute (none, selective, full), with
sequence parallelism whenever tp > 1 (it only saves memory in this model), and context parallelism
(cp dividing the GPUs, 2*cp dividing seq_len) for sequences of at least `LONG_SEQUENCE` tokens,
where activations rather than model states decide what fits. For a mixture-of-experts model it
also walks ep (`expert_parallel_degrees`: every divisor of n_experts that divides dp*cp), which
divides the routed experts' states by ep at the price of four all-to-alls per MoE layer and
micro-batch. Every layout passes
`Plan.problems()` first. Survivors are ranked by predicted step time, then by memory.

When nothing fits, the answer is not an exception: `PlanSearch.fits` is False, `smallest` is the
layout with the least memory per rank and `explanation` says by how much it misses; with
`suggest=True` the search is repeated on larger GPU counts (whole nodes) and the first count with
fitting layouts is reported with its best ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mini3d.config import ModelConfig, Plan
from mini3d.cost.memory import CATEGORIES, estimate_memory, gib, model_state_bytes, state_bytes
from mini3d.cost.hardware import Hardware
from mini3d.cost.model import TIME_TERMS, CostEstimate, estimate_cost

# From this many tokens per sequence the search also splits sequences over cp ranks (shorter ones
# fit with tp and recompute alone, and the ring's per-layer exchange would only cost time).
LONG_SEQUENCE = 8192


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def describe(plan: Plan) -> str:
    """Short name of a layout, e.g. 'tp8 pp2 dp1 | 32 x mb1 | 1f1b | zero0 | recompute selective'."""
    sched = plan.schedule + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    cp = (f" cp{plan.cp}" if plan.cp > 1 else "") + (f" ep{plan.ep}" if plan.ep > 1 else "")
    return (f"tp{plan.tp}{cp} pp{plan.pp} dp{plan.dp} | {plan.micro_batches} x mb{plan.micro_batch_size}"
            f" | {sched} | zero{plan.zero} | recompute {plan.recompute}"
            + (" | sp" if plan.sequence_parallel else "")
            + (" | expert-tp" if plan.expert_tp else "")
            + (f" | {plan.attention}" if plan.attention != "explicit" else ""))


def expert_parallel_degrees(cfg: ModelConfig, dp: int, cp: int = 1) -> list[int]:
    """The ep the search tries for `cfg` at this dp x cp: the divisors of n_experts that divide
    dp*cp ([1] for a dense model)."""
    return [e for e in _divisors(cfg.n_experts) if (dp * cp) % e == 0] if cfg.n_experts else [1]


def candidate_plans(cfg: ModelConfig, n_gpus: int, global_batch: int, seq_len: int,
                    dtype: str = "bf16", max_micro_batch: int = 16, attention: str = "explicit"):
    """Every valid Plan of the search space (see the module docstring); with attention="sdpa"
    selective recompute has nothing to save and is left out."""
    policies = ("none", "full") if attention == "sdpa" else ("none", "selective", "full")
    cps = [c for c in _divisors(n_gpus) if seq_len % (2 * c) == 0] if seq_len >= LONG_SEQUENCE else [1]
    for tp, cp in ((tp, cp) for cp in cps for tp in _divisors(n_gpus // cp)):
        if cfg.n_heads % tp or cfg.d_ff % tp or cfg.n_kv_heads % tp:
            continue
        for pp in _divisors(n_gpus // (tp * cp)):
            dp = n_gpus // (tp * cp * pp)
            if pp > cfg.n_layers or global_batch % dp:
                continue
            for b in [b for b in _divisors(global_batch // dp) if b <= max_micro_batch]:
                m = global_batch // (dp * b)
                scheds = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1)] + [
                    ("interleaved", v) for v in range(2, 9) if cfg.n_layers % (pp * v) == 0] + (
                    [("zbv", 2)] if cfg.n_layers % (2 * pp) == 0 else [])
                zeros = (0,) if dp == 1 else ((0, 1, 2, 3) if pp == 1 else (0, 1, 2))
                for sched, v in scheds:
                    for zero, rec, ep in ((z, r, e) for z in zeros for r in policies
                                          for e in expert_parallel_degrees(cfg, dp, cp)):
                        plan = Plan(tp=tp, pp=pp, dp=dp, zero=zero, schedule=sched,
                                    micro_batches=m, virtual_stages=v, recompute=rec,
                                    dtype=dtype, global_batch=global_batch, seq_len=seq_len,
                                    sequence_parallel=tp > 1 and seq_len % (tp * cp) == 0,
                                    attention=attention, cp=cp, ep=ep)
                        if not plan.problems(cfg, n_gpus):
                            yield plan


@dataclass
class PlanSearch:
    """The answer of `search`: the best fitting layouts, or the closest miss."""

    model: ModelConfig
    hardware: Hardware
    n_gpus: int
    candidates: list[CostEstimate]  # fitting layouts, fastest first (top k)
    n_considered: int
    n_fit: int
    smallest: CostEstimate | None  # least memory per rank among all layouts
    explanation: str = ""
    suggestion: "PlanSearch | None" = None  # the same search on more GPUs, when nothing fits
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return bool(self.candidates)

    def as_dict(self) -> dict:
        return {"model": self.model.name, "hardware": self.hardware.name, "n_gpus": self.n_gpus,
                "fits": self.fits, "n_considered": self.n_considered, "n_fit": self.n_fit,
                "candidates": [dict(c.as_dict(), layout=describe(c.plan)) for c in self.candidates],
                "smallest_memory": None if self.smallest is None else
                dict(self.smallest.as_dict(), layout=describe(self.smallest.plan)),
                "explanation": self.explanation, "notes": list(self.notes),
                "suggested_gpus": self.suggestion.n_gpus if self.suggestion else None,
                "suggestion": self.suggestion.as_dict() if self.suggestion else None}


def why_not(est: CostEstimate) -> str:
    """One paragraph, in numbers, on why a layout does not fit (or how much room it leaves)."""
    mem, cap = est.memory, est.capacity_bytes
    parts = sorted(((getattr(mem, k), k) for k in CATEGORIES), reverse=True)
    items = ", ".join(f"{k} {gib(v)}" for v, k in parts if v)
    head = (f"{describe(est.plan)} needs {gib(mem.total)} per rank (stage {mem.stage}: "
            f"{items}) against {gib(cap)} on a {est.hardware}")
    if est.fits:
        return head + f": fits with {gib(cap - mem.total)} to spare."
    p, g, o = state_bytes(est.plan.dtype, est.plan.grad_dtype)
    return (head + f": {gib(mem.total - cap)} too much. This rank holds "
            f"{mem.n_params / 1e9:.2f}e9 parameters at {p}+{g}+{o} = {p + g + o} bytes each before "
            f"ZeRO sharding (dp={est.plan.dp}, zero={est.plan.zero}), i.e. "
            f"{gib(mem.n_params * (p + g + o))} of model states." + _ep_note(est)
            + _cp_hint(est))


def _ep_note(est: CostEstimate) -> str:
    """For a MoE model: how much of the rank's model states are routed experts, and over what."""
    experts = est.memory.detail.get("experts")
    if not experts or not experts["n_params"]:
        return ""
    plan = est.plan
    return (f" Of them {experts['n_params'] / 1e9:.2f}e9 are routed experts "
            f"({gib(experts['total'])} after sharding: {plan.ep} ep rank(s) split the "
            f"experts, ZeRO shards them over the dp*cp/ep = {plan.dp * plan.cp // plan.ep} ranks "
            f"holding the same ones).")


def _cp_hint(est: CostEstimate) -> str:
    """When activations are the largest category: what splitting each sequence over cp ranks
    (context parallelism) would give, with the smallest cp (up to 64) that fits, if any."""
    plan, mem, cap = est.plan, est.memory, est.capacity_bytes
    if max(CATEGORIES, key=lambda k: getattr(mem, k)) != "activations":
        return ""
    text = (f" Activations dominate: they grow with the sequence (s={plan.seq_len}, its attention "
            f"with s^2 unless fused); context parallelism (--cp N) splits each sequence over N "
            f"ranks and divides them by N")
    for cp in (c for c in (2, 4, 8, 16, 32, 64) if c > plan.cp and plan.seq_len % (2 * c) == 0):
        trial = plan.replace(cp=cp, recompute="full" if plan.recompute == "selective" else plan.recompute)
        need = estimate_memory(est.model, trial).total
        if need <= cap:
            return text + (f": with cp={cp} ({trial.world_size} GPUs) this rank needs "
                           f"{gib(need)}.")
    return text + ", but no cp up to 64 alone makes it fit."


def explain(best: CostEstimate, runner_up: CostEstimate | None) -> str:
    """Why `best` beats `runner_up`, term by term, in seconds."""
    text = (f"best: {describe(best.plan)}: {best.step_time_s:.3f} s/step, "
            f"{best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.1%}, "
            f"{gib(best.memory.total)} per rank.")
    if runner_up is None:
        return text + " It is the only layout that fits."
    slower = runner_up.step_time_s / best.step_time_s - 1
    text += (f" runner-up: {describe(runner_up.plan)}: {runner_up.step_time_s:.3f} s/step "
             f"({slower:+.1%}), {gib(runner_up.memory.total)} per rank.")
    deltas = sorted(((runner_up.breakdown[k] - best.breakdown[k], k) for k in TIME_TERMS),
                    key=lambda d: -abs(d[0]))
    words = [f"{k.replace('_', ' ')} {d:+.3f} s ({best.breakdown[k]:.3f} -> "
             f"{runner_up.breakdown[k]:.3f})" for d, k in deltas[:3] if abs(d) > 1e-6]
    if words:
        text += " The runner-up differs in " + "; ".join(words) + "."
    if abs(slower) < 1e-9:
        text += (f" Equal time; the best is ranked first for needing "
                 f"{gib(runner_up.memory.total - best.memory.total, 2)} less memory.")
    return text


def search(cfg: ModelConfig, n_gpus: int, hw: Hardware, global_batch: int,
           seq_len: int | None = None, dtype: str = "bf16", top_k: int = 5,
           max_micro_batch: int = 16, suggest: bool = True, attention: str = "explicit") -> PlanSearch:
    """Rank every valid layout of `cfg` on `n_gpus` GPUs of `hw` by step time; keep the top k."""
    seq_len = seq_len or cfg.max_seq_len
    fitting, smallest, smallest_mem, n = [], None, math.inf, 0
    for plan in candidate_plans(cfg, n_gpus, global_batch, seq_len, dtype, max_micro_batch, attention):
        n += 1
        mem = estimate_memory(cfg, plan)
        if mem.total < smallest_mem:
            smallest, smallest_mem = plan, mem.total
        if mem.fits(hw.memory_bytes):
            fitting.append(estimate_cost(cfg, plan, hw, n_gpus, memory=mem))
    fitting.sort(key=lambda c: (c.step_time_s, c.memory.total))
    small = estimate_cost(cfg, smallest, hw, n_gpus) if smallest is not None else None
    result = PlanSearch(cfg, hw, n_gpus, fitting[:top_k], n, len(fitting), small)
    pure = Plan(dp=n_gpus, global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                micro_batches=max(1, global_batch // n_gpus), attention=attention)
    if not pure.problems(cfg, n_gpus):
        dp_only = estimate_cost(cfg, pure, hw, n_gpus)
        if not dp_only.fits:
            result.notes.append("pure data parallelism does not fit: " + why_not(dp_only))
    if fitting:
        result.explanation = explain(fitting[0], fitting[1] if len(fitting) > 1 else None)
    elif small is None:
        result.explanation = (f"no valid layout of {cfg.name} on {n_gpus} GPUs with global batch "
                              f"{global_batch} and seq_len {seq_len} (check that dp can divide "
                              f"the global batch and tp the heads)")
    else:
        result.explanation = (f"no layout of {cfg.name} fits {n_gpus} x {hw.name} "
                              f"({gib(hw.memory_bytes)} each) among {n} valid layouts. "
                              f"Smallest memory found: " + why_not(small))
        if suggest:
            result.suggestion = _suggest(cfg, n_gpus, hw, global_batch, seq_len, dtype, top_k,
                                         max_micro_batch, attention)
            if result.suggestion is not None:
                s = result.suggestion
                result.explanation += (f" With {s.n_gpus} GPUs {s.n_fit} layouts fit; the fastest "
                                       f"is {describe(s.candidates[0].plan)} at "
                                       f"{s.candidates[0].step_time_s:.2f} s/step.")
    return result


def _suggest(cfg, n_gpus, hw, global_batch, seq_len, dtype, top_k, max_micro_batch, attention):
    """The same search on the smallest larger GPU count (whole nodes) where something fits.
    Model states alone need state_bytes * n_params / capacity GPUs: start there."""
    states = sum(model_state_bytes(cfg.n_params(), dtype, dp=1, zero=0))
    lower = max(n_gpus + 1, math.ceil(states / hw.memory_bytes))
    node = hw.gpus_per_node
    first = -(-lower // node) * node
    for count in sorted({first, first + node, 2 * first, 4 * first}):
        found = search(cfg, count, hw, global_batch, seq_len, dtype, top_k, max_micro_batch,
                       suggest=False, attention=attention)
        if found.fits:
            return found
    return None


__all__ = ["search", "PlanSearch", "candidate_plans", "expert_parallel_degrees", "describe", "explain", "why_not"]
