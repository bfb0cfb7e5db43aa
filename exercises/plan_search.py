"""Exercise plan_search: the fastest layout that fits a memory limit, found by your own search.

Chapter: 09 planning a real run (course/09_planning_a_real_run.ipynb)

Build the planner's core yourself: enumerate the layouts, then every plan of the search space,
keep those whose estimated memory fits, and rank them by estimated step time. Use
`mini3d.cost.memory.estimate_memory` and `mini3d.cost.model.estimate_cost` as helpers,
but not `mini3d.cost.planner` (that is the answer you are rebuilding).
"""

from __future__ import annotations

from mini3d.config import ModelConfig, Plan
from mini3d.cost.model import estimate_cost  # noqa: F401  (your helpers)
from mini3d.cost.memory import estimate_memory  # noqa: F401


def layouts(cfg: ModelConfig, n_gpus: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp * pp * dp == n_gpus, tp dividing both cfg.n_heads and cfg.d_ff,
    and pp <= cfg.n_layers (each stage needs a layer), sorted ascending."""
    raise NotImplementedError("loop tp over the divisors of n_gpus, skip tp that does not divide n_heads or d_ff, then pp over the divisors of n_gpus // tp with pp <= n_layers; dp is what is left")


def candidates(cfg: ModelConfig, n_gpus: int, global_batch: int, seq_len: int,
               dtype: str = "bf16") -> list[Plan]:
    """Every plan of the search space, for each layout whose dp divides global_batch:

    * micro-batch size b: each divisor of global_batch // dp with b <= 16, so that
      micro_batches = global_batch // (dp * b);
    * schedule "1f1b" (virtual_stages 1);
    * zero: 0 when dp == 1; else 0, 1, 2 and 3 when pp == 1, or 0, 1 and 2 when pp > 1;
    * recompute: "none", "selective" and "full";
    * sequence_parallel = (tp > 1 and seq_len % tp == 0); dtype, global_batch, seq_len as given.
    Keep only plans for which `plan.problems(cfg, n_gpus)` is empty (e.g. 1f1b needs m >= pp)."""
    raise NotImplementedError("nested loops over layouts(), micro-batch sizes, zero stages and recompute policies; build Plan(...) and keep it when plan.problems(cfg, n_gpus) == []")


def best_plan(cfg: ModelConfig, n_gpus: int, hw, global_batch: int, seq_len: int,
              memory_limit_bytes: float, dtype: str = "bf16") -> Plan | None:
    """The candidate with the smallest `estimate_cost(cfg, plan, hw, n_gpus).step_time_s` among
    those whose `estimate_memory(cfg, plan).total <= memory_limit_bytes` (the busiest stage).
    None when no candidate fits. Among equally fast plans, any may be returned."""
    raise NotImplementedError("filter candidates() by estimate_memory(cfg, plan).total <= memory_limit_bytes, then take the min of estimate_cost(cfg, plan, hw, n_gpus).step_time_s")
