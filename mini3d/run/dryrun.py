"""`mini3d train --dry-run`: check a plan end to end without starting a single process.

1. validate the plan (the caller exits 2 with the reasons when it is broken);
2. print the rank map (`Grid.describe`, node boundaries with `--gpus-per-node`);
3. record one step's communication from the real step: for every rank of a reduced grid (tp and
   dp capped at 2, every pipeline rank), build that rank's real `Trainer` on torch's "fake" process
   group (every collective and transfer returns at once, nothing is sent) and run
   `Trainer.step` and `Trainer.mean_loss_over_dp`, as `train_worker` does. The traced comm layer
   (`mini3d.comm`) records each op when it is issued and when it is waited for, so the program
   holds whatever the real code issues: tp and sequence-parallel collectives, ZeRO gathers and
   reduce-scatters, gradient clipping, the pipeline's transfers for the schedule, the loss
   broadcast and the loss mean;
4. run the recorded programs under NCCL's ordering rules (`mini3d.diagnose.rendezvous`: streams
   per pair and per communicator in issue order, a send waiting for its receive, batches as units,
   pair communicators joined on first use): if every rank's program ends, no rank of one step
   waits forever under those rules (nor under gloo's, which are looser);
5. print the memory estimate per pipeline stage (`mini3d.cost.memory`), the bubble, and the bytes
   one rank sends per step on each axis by the cost model (`mini3d.cost.model.estimate_cost`;
   expert parallelism's all-to-alls by `mini3d.cost.comm_time.ep_wire_bytes`, the volume of
   `mini3d.cost.moe`), with the ep axis's groups when ep > 1.

With ep > 1 the recorded grid keeps the whole ep group (dp is raised from the cap until ep divides dp x cp); the fake group
moves no data, so each rank takes its peers' expert counts to be its own (mini3d.ep.dispatch): the
order and groups of the all-to-alls are the real ones, their sizes are not.

Every tp group and every dp replica runs the same program, so two members show every cross-group
interaction that more would. A model above `RECORD_MAX_PARAMS` is recorded on a narrow copy
(same layers, heads, plan and schedule; small hidden size, vocabulary and sequence): message sizes
and the number of gradient buckets then differ from the real run, the order and the groups do not.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from mini3d.comm import COLLECTIVES
from mini3d.comm_log import CommLog
from mini3d.grid import Grid, build_topology

CAP = 2  # tp and dp members kept for the recording (see the module docstring)
RECORD_MAX_PARAMS = 20e6  # larger models are recorded on a narrow copy


class RecordingLog(CommLog):
    """A CommLog that also keeps, while `recording`, every op's issue and wait in program order."""

    def __init__(self, rank: int):
        super().__init__(rank, capacity=1 << 20)
        self.recording = False
        self.program: list[tuple] = []  # ("issue" | "wait", event id, Event)

    def begin(self, *args, **kwargs):
        eid, ev = super().begin(*args, **kwargs)
        if self.recording:
            self.program.append(("issue", eid, ev))
        return eid, ev

    def end(self, eid, ev):
        super().end(eid, ev)
        if self.recording:
            self.program.append(("wait", eid, ev))


@contextlib.contextmanager
def fake_process_group(rank: int, world: int):
    """This process as `rank` of `world` on torch's fake backend (the one torch's own tests use to
    run collectives without peers; there is no public equivalent)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("the dry run records on its own process group: call it before "
                           "init_process_group")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def record_rank(cfg, plan, rank: int, grad_clip: float = 0.0) -> list[tuple]:
    """One optimizer step of `rank` (of the plan's own grid), run by the real Trainer on a fake
    process group: its ordered ("issue" | "wait", event id, event dict) entries."""
    from mini3d.cp import chunk_micro_batches
    from mini3d.run.train import Trainer

    grid = Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp, ep=plan.ep)
    with fake_process_group(rank, grid.world_size):
        log = RecordingLog(rank)
        topo = build_topology(grid, rank, "cpu", log=log)
        trainer = Trainer(cfg, plan, topo, seed=0, lr=1e-3, grad_clip=grad_clip)
        tokens = torch.zeros(plan.micro_batch_size, plan.seq_len, dtype=torch.long)
        mbs = [(tokens, tokens)] * plan.micro_batches
        mbs = chunk_micro_batches(mbs, plan.cp, topo.cp.index)  # as train_worker feeds the step
        log.context = {"step": 0}
        log.recording = True
        loss = trainer.step(mbs, 0)
        trainer.mean_loss_over_dp(loss)
        log.recording = False
        waited = {eid for what, eid, _ in log.program if what == "wait"}
        late = [("wait", eid, ev) for what, eid, ev in log.program  # still pending: waited at exit
                if what == "issue" and eid not in waited]
    return [(what, eid, ev.as_dict()) for what, eid, ev in log.program + late]


def as_op(ev: dict) -> tuple:
    """An event as the rendezvous simulator's (kind, key, label[, batch])."""
    label = " ".join(str(x) for x in (ev["op"], ev["context"].get("action", ""), f"#{ev['seq']}") if x)
    if ev["op"] in COLLECTIVES:
        return ("coll", (ev["axis"], tuple(ev["group"])), label)
    return (ev["op"], ev["peer"], label, ev.get("batch"))


def recording_setup(cfg, plan) -> tuple:
    """(model, plan) the step is recorded with: tp and dp capped at CAP (dp kept large enough that
    ep still divides dp x cp: every ep group is recorded whole); above RECORD_MAX_PARAMS a narrow
    copy of the model (expert width too) and short sequences (see the module docstring)."""
    t, d = min(plan.tp, CAP), min(plan.dp, CAP)
    while (d * plan.cp) % plan.ep:
        d += 1  # ends at plan.dp at the latest: Plan.problems checked that ep divides dp*cp
    small = plan.replace(tp=t, dp=d, global_batch=plan.micro_batch_size * plan.micro_batches * d)
    if cfg.n_params() <= RECORD_MAX_PARAMS:
        return cfg, small
    seq = 4 * t * plan.cp  # 2*cp zig-zag chunks of 2t tokens: each cp rank's 4t split over tp
    narrow = dataclasses.replace(cfg, d_model=4 * cfg.n_heads, d_ff=16 * cfg.n_heads,
                                 moe_ffn=16 * cfg.n_heads if cfg.moe_ffn else 0,
                                 vocab_size=64 * t, max_seq_len=seq, name=f"{cfg.name} (narrow)")
    return narrow, small.replace(seq_len=seq)


def record_programs(cfg, plan, grad_clip: float = 0.0) -> tuple[list[list[tuple]], Grid]:
    """Every rank's recorded program (simulator form) on the recording grid, and that grid."""
    cfg, plan = recording_setup(cfg, plan)
    grid = Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp, ep=plan.ep)
    progs = [[(what, eid, as_op(ev)) for what, eid, ev in record_rank(cfg, plan, r, grad_clip)]
             for r in range(grid.world_size)]
    return progs, grid


def schedule_note(plan) -> str:
    """The schedule's own rule check (`mini3d.pp.rules.check`), as one line."""
    if plan.pp == 1:
        return "pp=1: no pipeline transfers"
    from mini3d.pp.rules import check
    from mini3d.pp.schedules import make_schedule

    result = check(make_schedule(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages))
    return f"schedule {plan.schedule}: mini3d.pp.rules.check " + (
        "passed" if result.ok else "FAILED: " + "; ".join(result.problems))


def memory_lines(cfg, plan) -> list[str]:
    from mini3d.cost.memory import CATEGORIES, estimate_memory

    def size(n):
        return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 2**20:,.1f} MiB"

    lines = []
    for s in range(plan.pp):
        e = estimate_memory(cfg, plan, s)
        parts = ", ".join(f"{c} {size(getattr(e, c))}" for c in CATEGORIES)
        lines.append(f"memory per rank, stage {s} (estimate): {size(e.total)} ({parts}; "
                     f"gradients at their peak {size(e.peak_grad_bytes)}, with the buckets in flight)")
    return lines


def bubble_line(plan) -> str:
    """The bubble at unit costs (`mini3d.pp.schedules.bubble_text`: the closed form, or simulated)."""
    from mini3d.pp.schedules import bubble_text

    text = bubble_text(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)
    return f"pipeline bubble ({plan.schedule}): {text}"


def communication_line(cfg, plan, progs, grid: Grid) -> tuple[int, str]:
    """(status, line): run the recorded programs (`record_programs`) under NCCL's ordering rules."""
    from mini3d.diagnose.rendezvous import simulate

    hang = simulate(progs, grid)
    if hang:
        return 1, f"communication: {hang}"
    n = sum(1 for p in progs for what, _, _ in p if what == "issue")
    t, d = grid.sizes["tp"], grid.sizes["dp"]
    rec, rplan = recording_setup(cfg, plan)
    on = "" if rec is cfg else (f", run on a narrow copy (d_model={rec.d_model}, vocab_size="
                                f"{rec.vocab_size}, seq_len={rplan.seq_len}: same order and groups, "
                                f"smaller messages)")
    cp = f"cp={plan.cp} " if plan.cp > 1 else ""
    ep = f" ep={plan.ep}" if plan.ep > 1 else ""
    return 0, (f"communication: deadlock-free: the real step's {n} ops, recorded on a tp={t} "
               f"{cp}pp={plan.pp} dp={d}{ep} slice{on} (every tp/dp member runs the same program), "
               f"all complete under NCCL's ordering rules (each pair's and each group's ops in issue "
               f"order, a send only once its receive is at the head of the peer's stream, pair "
               f"communicators joined on first use)")


def ep_groups(grid: Grid, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, expert-data-parallel groups) of `grid`: an ep group is ep consecutive members
    of a dp x cp group (world-rank order: cp fastest, then dp), the expert-data-parallel group
    every ep-th member (the ranks holding the same experts)."""
    return grid.groups("ep"), grid.groups("edp")


def recorded_all_to_alls(progs, grid: Grid) -> list[int]:
    """All-to-alls one rank of each pipeline stage issued in the recorded step (every member of a
    stage issues the same ones)."""
    first = grid.groups("pp")[0]  # its s-th member is on stage s
    return [sum(1 for what, _, op in progs[r] if what == "issue" and op[2].startswith("all_to_all"))
            for r in first]


def ep_lines(cfg, plan, grid: Grid, progs=None, rec_grid: Grid | None = None) -> list[str]:
    """The ep axis: its groups, the experts per rank, and per pipeline stage the all-to-alls of
    one step (counted in the recorded programs `progs`, when given) and the bytes they send, by
    the cost model's `ep_wire_bytes` (the volume of `mini3d.cost.moe`; dropless, balanced
    routing: an upper bound with a capacity factor)."""
    if plan.ep == 1 or not cfg.n_experts:
        return []
    from mini3d.cost.activations import ELEMENT_BYTES, moe_tokens
    from mini3d.cost.comm_time import ep_wire_bytes, moe_stage_layers
    from mini3d.cost.moe import experts_per_rank

    groups, edp = ep_groups(grid, plan.ep)
    show = lambda gs: " ".join(str(g) for g in gs[:8]) + (" ..." if len(gs) > 8 else "")  # noqa: E731
    counts = recorded_all_to_alls(progs, rec_grid) if progs else [None] * plan.pp
    stages = []
    for s in range(plan.pp):
        sent = plan.micro_batches * ep_wire_bytes(cfg, plan, s)
        ops = f"{counts[s]} all-to-alls on the ep group, " if counts[s] is not None else ""
        stages.append(("" if plan.pp == 1 else f"stage {s}: ") + f"{ops}sending {sent / 2**20:,.2f} "
                      f"MiB ({sent:,.0f} B, {moe_stage_layers(cfg, plan, s)} MoE layers)")
    tokens = moe_tokens(plan)
    return [f"ep groups (ep={plan.ep}, {experts_per_rank(cfg.n_experts, plan.ep)} of "
            f"{cfg.n_experts} experts per rank): {show(groups)}",
            f"expert-data-parallel groups (the ranks holding the same experts, dp*cp/ep = "
            f"{len(edp[0])}): {show(edp)}",
            "expert parallelism per rank and step (recorded: per MoE layer and micro-batch the "
            "counts exchange, dispatch and combine forward, their gradients backward, the "
            "forward's again under full recompute): " + "; ".join(stages) + " under balanced "
            f"routing ({tokens:g} tokens x top_k={cfg.top_k} x (ep-1)/ep x d_model={cfg.d_model} x "
            f"{ELEMENT_BYTES[plan.dtype]} B per all-to-all x {plan.micro_batches} micro-batches: "
            f"mini3d.cost.comm_time.ep_wire_bytes)"]


def bytes_line(cfg, plan) -> str:
    """Bytes one rank sends per step on each axis, by the cost model (hardware-independent)."""
    from mini3d.cost.hardware import PRESETS
    from mini3d.cost.model import estimate_cost

    sent = estimate_cost(cfg, plan, PRESETS["A100-80GB"]).comm_bytes
    return ("bytes sent per rank per step (cost model, busiest stage): "
            + ", ".join(f"{a} {b:,.0f} B" for a, b in sent.items()))


def dry_run(cfg, plan, gpus_per_node: int | None = None, out=print, grad_clip: float = 0.0) -> int:
    """Print the map, the recorded step's verdict, memory and bubble for a validated plan; 0 or 1."""
    grid = Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp, ep=plan.ep)
    cp = f"cp={plan.cp} " if plan.cp > 1 else ""
    ep = f" ep={plan.ep} (of dp x cp)" if plan.ep > 1 else ""
    out(f"dry run: {cfg.name} ({cfg.n_params() / 1e6:,.1f} M parameters) on tp={plan.tp} "
        f"{cp}pp={plan.pp} dp={plan.dp}{ep} ({plan.world_size} ranks); plan is valid")
    out(grid.describe(gpus_per_node))
    out(schedule_note(plan))
    progs, rec_grid = record_programs(cfg, plan, grad_clip)
    status, line = communication_line(cfg, plan, progs, rec_grid)
    out(line)
    for line in ep_lines(cfg, plan, grid, progs, rec_grid):
        out(line)
    for line in memory_lines(cfg, plan):
        out(line)
    out(bubble_line(plan))
    out(bytes_line(cfg, plan))
    out("nothing was started (dry run)")
    return status


__all__ = ["dry_run", "ep_groups", "ep_lines", "recorded_all_to_alls", "bytes_line", "record_rank", "record_programs", "recording_setup", "RecordingLog",
           "fake_process_group"]
