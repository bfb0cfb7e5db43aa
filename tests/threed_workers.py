"""Worker functions for tests/test_3d.py and tests/test_checkpoint.py (spawned by mini3d.launch.launcher).

`run_layouts(cases)` trains, inside ONE 8-process job, one `mini3d.run.train.Trainer` per case (each a
different tp x pp x dp layout of the same 8 ranks, each with its own process groups) for a few AdamW
steps on the batches `mini3d.data.corpus.Batches` draws, and returns, from every dp_rank-0 process:

* the loss of every step (what the trainer reports, averaged over dp like `mini3d train`);
* the gradient of every step at full shape, keyed by reference name, captured just before the inner
  AdamW step (after the dp reduction and the tp sync) and gathered back over dp and tp;
* the parameters after the last step, gathered with `mini3d.checkpoint.store.gather_full_state`.

The test process computes the single-process reference and decides what is acceptable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d import comm
from mini3d.checkpoint.store import _names, gather_full_state
from mini3d.config import ModelConfig, Plan
from mini3d.data.corpus import Batches, load_tokens
from mini3d.grid import Grid, build_topology
from mini3d.launch.launcher import current_device
from mini3d.tp import unshard_like
from mini3d.run.train import Trainer

LR, WEIGHT_DECAY = 3e-3, 0.1


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32 at least (a bf16 gradient), float64 kept (float64 runs)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _capture_grads(trainer: Trainer) -> list:
    """Make the inner optimizer record each master's gradient shard just before it steps."""
    opt, seen = trainer.optimizer, []
    inner_step = opt.inner.step

    def step(*a, **k):
        seen.append([None if m.grad is None else _wide(m.grad.detach()).clone() for m in opt.masters])
        return inner_step(*a, **k)

    opt.inner.step = step
    return seen


def full_grads(trainer: Trainer, shards: list) -> dict:
    """{reference name: full gradient} from one step's gradient shards (collective over dp, tp;
    expert slices, mini3d.ep, over their edp shard group and then over ep along dim 0)."""
    opt, topo = trainer.optimizer, trainer.topo
    names, out = _names(trainer.chunks), {}
    sharded = opt.wrapper.stage >= 1
    for (group, _, _), shard in zip(opt.shards, shards):
        full = shard
        if sharded:  # ZeRO shards over the group's axis: cp x dp, or edp for expert slices
            full = torch.empty(group.padded, dtype=shard.dtype, device=shard.device)
            comm.all_gather(full, shard.contiguous(), getattr(group, "axis", None) or topo.dp_cp)
        for p, local in group.views(full):
            t = unshard_like(p, local, topo)
            if getattr(p, "ep_expert", False) and topo.axes["ep"].size > 1:
                whole = t.new_empty((topo.axes["ep"].size * t.shape[0],) + tuple(t.shape[1:]))
                comm.all_gather(whole, t.contiguous(), topo.axes["ep"])
                t = whole
            out[names[p]] = t.cpu()
    return out


def run_layouts(cases: list[dict], cfg_dict: dict, steps: int, seed: int) -> list[dict]:
    """Train each case ({"name", "plan": Plan dict}) for `steps` steps; see the module docstring."""
    cfg, rank, out = ModelConfig(**cfg_dict), dist.get_rank(), []
    tokens = load_tokens()
    for case in cases:
        plan = Plan(**case["plan"])
        topo = build_topology(Grid(plan.tp, plan.pp, plan.dp), rank, current_device())
        trainer = Trainer(cfg, plan, topo, seed, LR, WEIGHT_DECAY, case.get("grad_clip", 0.0))
        seen = _capture_grads(trainer)
        batches = Batches(tokens, plan.seq_len, plan.global_batch, seed)
        losses, norms = [], []
        for step in range(steps):
            mbs = batches.micro_batches(step, topo.dp.index, plan.dp, plan.micro_batches)
            losses.append(trainer.mean_loss_over_dp(trainer.step(mbs, step)))
            norms.append(trainer.last_grad_norm)
        grads = [full_grads(trainer, s) for s in seen]
        weights, _, opt_step = gather_full_state(trainer.chunks, trainer.optimizer, topo)
        if topo.dp.index == 0:
            out.append({"name": case["name"], "coords": topo.coords, "losses": losses, "norms": norms,
                        "grads": grads, "weights": weights, "opt_step": opt_step})
        comm.barrier(topo.axes["world"])
    return out


def run_layouts_of(groups: list[tuple[list[dict], dict]], steps: int, seed: int) -> list[list[dict]]:
    """`run_layouts(cases, cfg_dict, ...)` for each (cases, cfg_dict) in turn: layouts of several
    models in one launch."""
    return [run_layouts(cases, cfg_dict, steps, seed) for cases, cfg_dict in groups]


def run_parts(parts: list[tuple], steps: int, seed: int) -> list[list[dict]]:
    """Each part in turn, in the same processes: ("layouts", cases, cfg_dict) is
    `run_layouts(cases, cfg_dict, steps, seed)`, ("cp_layouts", cases, cfg_dict)
    `tests.cp_workers.run_cp_layouts(...)` likewise, ("specs", specs) `run_specs(specs)`."""
    from tests.cp_workers import run_cp_layouts

    out = []
    for kind, *args in parts:
        if kind == "specs":
            out.append(run_specs(*args))
        else:
            out.append((run_layouts if kind == "layouts" else run_cp_layouts)(*args, steps, seed))
    return out


def run_layouts_then_specs(cases: list[dict], cfg_dict: dict, steps: int, seed: int,
                           specs: list[dict]) -> tuple[list[dict], list[dict]]:
    """`run_layouts(cases, ...)`, then `run_specs(specs)`, in the same processes (one launch)."""
    return run_layouts(cases, cfg_dict, steps, seed), run_specs(specs)


def run_specs(specs: list[dict]) -> list[dict]:
    """`mini3d.run.train.train_worker` on each spec in turn, in the same processes (one launch, several
    runs: e.g. a run and its resumption, or two layouts of the same world size)."""
    from mini3d.run.train import train_worker

    return [train_worker(spec) for spec in specs]
