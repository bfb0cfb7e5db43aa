"""Step time when every rank is a process on one host's cores (mini3d's own CPU runs).

A GPU per rank makes each rank's speed its own; on a CPU host the ranks share `cores`, and how
fast one computes depends on how many others are computing at that moment. A pipeline rank that
waits for its input or for a gradient gives its core to the others, so the 8 processes of a
tp2 x pp2 x dp2 run on 2 cores are not each 4 times slower all the time: in the pipeline's
warm-up and drain fewer of them are runnable, and the ones that are run faster. A single
slowdown factor per rank cannot say that (it over-predicts a one-core 3D run by about 2.4x: that
rank's idle time is other ranks' CPU time), so the cost model simulates the step:

    rate(R) = 1 / (contention * max(1, R / cores))   alone-speed seconds per second, for each of
                                                     the R processes that are runnable now

(processor sharing: the operating system's fair scheduler splits the cores evenly among the
runnable processes; a blocked one takes none). `contention` (>= 1) is what is left of the
layout's measured busy slowdown (`Hardware.slowdown(world)`, from `mini3d.cost.host_probe` with
the layout's own process count) once the sharing is divided out: cache and memory-bandwidth
contention, context switches and other people's jobs. It slows compute; the cost model passes
communication work already divided by it, since the probe measured the exchanges under that
contention and divided out only the sharing (`mini3d.cost.model.shared_host_step`).

Work, in seconds at alone speed (the cost model's terms with slowdown 1), per pipeline rank: each
compute action of the schedule (F, B, W: compute, per-layer overhead and the tp collectives inside
it, which on a CPU are CPU work too: copies, gloo threads, Python), a receive before every action
whose input comes from another rank and a send after every action whose output goes to one (both
ends of a message spend CPU on it), and after the rank's last action its data-parallel gradient
sync. The tp x cp x dp processes of one pipeline rank run the same program in lockstep, so one
simulated rank stands for all of them: it counts `weights[r]` processes while runnable. After the
last rank finishes, every process runs the step's tail (optimizer, loss reductions) at once.

What is work and what is a wait (`shared_host_step`): communication on a CPU host is CPU work
(gloo's threads, copies, Python) and a blocked wait. With the host probe's numbers
(`Hardware.host_step_cpu_s`, `host_step_wait_s`, `host_msg_cpu_s`, `host_msg_wait_s`, measured
among the layout's processes, so under its contention already) each collective's ring steps are
work and wait, each message end is work and a receive waits; without them every ring step and
message end is `latency_s` of work. A dp gradient sync and a cp ring are work only. Compute pays
the contention, `Hardware.host_cpu_factor` (the CPU seconds of a probe unit run as a step runs
it among the layout's processes, over the same unit alone) or, without a probe, what is left of
`Hardware.slowdown(world)` once the sharing (world / cores) is divided out.

This is a fluid model: between events every runnable process advances at rate(R), and the next
event is the earliest completion. The schedule's dependencies are the pipeline simulator's
(`mini3d.pp.simulator`), so the bubble comes out of the same orders the runtime executes.
"""

from __future__ import annotations

from mini3d.dp.loss import LOSS_BYTES
from mini3d.pp.simulator import Stuck, _dependency

EPS = 1e-12


def rate(runnable: float, cores: int, contention: float = 1.0) -> float:
    """Alone-speed seconds each of `runnable` processes gets done per second on `cores`."""
    return 1.0 / (contention * max(1.0, runnable / cores))


def _programs(schedule, work, recv, send, after, blocked, recv_wait) -> list:
    """Per pipeline rank: [(dependency or None, alone-speed work, blocked wall seconds, key)],
    its compute actions in order (each with its messages' ends) and then its `after` work."""
    p = schedule.p
    after = list(after) if isinstance(after, (list, tuple)) else [after] * p
    programs = []
    for r in range(p):
        prog = []
        for a in schedule.compute(r):
            dep = _dependency(a, schedule.n_stages)
            to = a.stage + 1 if a.op == "F" else a.stage - 1  # where its output goes
            seconds = work[a.op][a.stage]
            remote = dep is not None and schedule.rank_of(dep[1]) != r
            seconds += recv if remote else 0.0
            seconds += send if a.op != "W" and 0 <= to < schedule.n_stages and \
                schedule.rank_of(to) != r else 0.0
            wait = (blocked[a.op][a.stage] if a.op in blocked else 0.0) + (recv_wait if remote else 0.0)
            prog.append((dep, seconds, wait, (a.op, a.stage, a.mb)))
        prog.append((None, after[r], 0.0, None))
        programs.append(prog)
    return programs


class _Ranks:
    """The simulation's state: where each pipeline rank is in its program, and when."""

    def __init__(self, programs):
        p = len(programs)
        self.programs, self.done, self.now = programs, {}, 0.0
        self.step, self.left, self.until = [0] * p, [0.0] * p, [0.0] * p
        self.state = ["idle"] * p  # idle (between steps, or waiting for an input) | run | blocked
        self.busy, self.finish = [0.0] * p, [0.0] * p

    def complete(self, r):
        key = self.programs[r][self.step[r]][3]
        if key is not None:
            self.done[key] = self.now
        self.state[r], self.step[r] = "idle", self.step[r] + 1
        if self.step[r] == len(self.programs[r]):
            self.finish[r] = self.now

    def block(self, r, wait):
        if wait > EPS:
            self.state[r], self.until[r] = "blocked", self.now + wait
        else:
            self.complete(r)

    def advance(self, r):
        """Start rank r's next step when its input exists (zero-length steps complete at once)."""
        while self.step[r] < len(self.programs[r]) and self.state[r] == "idle":
            dep, seconds, wait, _ = self.programs[r][self.step[r]]
            if dep is not None and dep not in self.done:
                return
            if seconds > EPS:
                self.state[r], self.left[r] = "run", seconds
            else:
                self.block(r, wait)

    def settle(self):
        """Finished ranks move on; ranks waiting for an input may now have it."""
        changed = True
        while changed:
            before = len(self.done), self.state.count("idle")
            for r in range(len(self.programs)):
                self.advance(r)
            changed = (len(self.done), self.state.count("idle")) != before


def shared_makespan(schedule, work: dict, weights, cores: int, contention: float = 1.0,
                    recv: float = 0.0, send: float = 0.0, after=0.0,
                    blocked: dict | None = None, recv_wait: float = 0.0) -> dict:
    """Simulate the pipeline part of one step under processor sharing.

    `work`: {"F": [...], "B": [...], "W": [...]} alone-speed seconds per stage (model chunk);
    `recv` / `send`: alone-speed seconds of each end of a cross-rank message (before the action
    that needs its input, after the one that produced it); `after`: per-rank work after its last
    action (scalar or list: its data-parallel gradient sync); `blocked`: like `work`, wall
    seconds each action also waits blocked, taking no core, after its work (`recv_wait` more
    after a receive); `weights`: processes per pipeline rank.
    Returns {"makespan", "busy": per-rank runnable seconds, "finish": per-rank end times}."""
    p = schedule.p
    sim = _Ranks(_programs(schedule, work, recv, send, after, blocked or {}, recv_wait))
    sim.settle()
    state = sim.state
    while "run" in state or "blocked" in state:
        active = [r for r in range(p) if state[r] == "run"]
        speed = rate(sum(weights[r] for r in active), cores, contention)
        dt = min([sim.left[r] / speed for r in active]
                 + [sim.until[r] - sim.now for r in range(p) if state[r] == "blocked"])
        sim.now += max(dt, 0.0)
        for r in range(p):
            if state[r] == "run":
                sim.left[r] -= dt * speed
                sim.busy[r] += dt
                if sim.left[r] <= EPS * max(1.0, sim.now):
                    sim.block(r, sim.programs[r][sim.step[r]][2])
            elif state[r] == "blocked" and sim.until[r] <= sim.now + EPS * max(1.0, sim.now):
                sim.complete(r)
        sim.settle()
    stuck = [f"rank {r} at {sim.programs[r][sim.step[r]][3]}" for r in range(p)
             if sim.step[r] < len(sim.programs[r])]
    if stuck:
        raise Stuck("shared-host simulation: every rank waits for an input; " + ", ".join(stuck))
    return {"makespan": sim.now, "busy": sim.busy, "finish": sim.finish}


def _chunk_costs(cfg, plan, schedule, terms, wait_hw, contention) -> tuple[dict, dict]:
    """Per model chunk (a rank's terms over v): F / B / W work, and the tp collectives' blocked
    waits (`wait_hw.latency_s` per ring step; none without a probe). Communication terms are
    divided by the contention the simulation multiplies back in: the probe measured them under
    it already."""
    from mini3d.cost.comm_time import tp_time

    v = plan.virtual_stages
    work = {"F": [], "B": [], "W": []}
    blocked = {"F": [], "B": [], "W": []}
    for s in range(plan.pp * v):
        r = schedule.rank_of(s)
        k = terms[r]
        w = k["c_bwd"] / 2 if schedule.split else 0.0  # W: the weight-gradient matmuls
        cf, cb = k["t_fwd"] - k["c_fwd"], k["t_bwd"] - k["c_bwd"]  # its communication
        work["F"].append((k["c_fwd"] + cf / contention) / v)
        work["B"].append((k["c_bwd"] - w + cb / contention) / v)
        work["W"].append(w / v)
        wf, wb = (tp_time(cfg, plan, wait_hw, k["layers"], float("inf"), r)[:2]
                  if wait_hw is not None else (0.0, 0.0))
        blocked["F"].append(wf / v)
        blocked["B"].append(wb / v)
        blocked["W"].append(0.0)
    return work, blocked


def shared_host_step(cfg, plan, hw, rank_terms, adam_bytes_per_param: float) -> float:
    """Step seconds of `plan` when all ranks are processes on one host (the cost model's
    `estimate_cost` on a `Hardware.shared_host` passes `rank_terms(hw, stage)`, its per-rank
    terms with slowdown 1, and its optimizer's bytes per parameter): each pipeline
    rank's alone-speed work and waits simulated by
    `shared_makespan` on `hw.gpus_per_node` cores, then the tail every process runs at once
    (optimizer, the loss's reductions). What is work and what is a wait: see the module's
    docstring."""
    import dataclasses

    from mini3d.pp.schedules import make_schedule
    from mini3d.cost.comm_time import dp_time
    from mini3d.cost.params import expert_sharding_degree, sharding_degree

    n, p, v, m = plan.world_size, plan.pp, plan.virtual_stages, plan.micro_batches
    cores = hw.gpus_per_node
    contention = hw.host_cpu_factor or max(1.0, hw.slowdown(n) / max(1.0, n / cores))
    probed = hw.host_step_cpu_s > 0
    cpu_hw = dataclasses.replace(hw, latency_s=hw.host_step_cpu_s) if probed else hw
    terms = [rank_terms(cpu_hw, r) for r in range(p)]
    schedule = make_schedule(plan.schedule, p, m, v)
    wait_hw = dataclasses.replace(hw, latency_s=hw.host_step_wait_s)
    work, blocked = _chunk_costs(cfg, plan, schedule, terms, wait_hw if probed else None,
                                 contention)
    k0 = terms[0]
    wire = k0["msg"] / k0["bw"]["pp"]
    msg_cpu = hw.host_msg_cpu_s if probed else hw.latency_s
    recv, send = (msg_cpu + wire, msg_cpu) if p > 1 else (0.0, 0.0)
    dp_sync = [dp_time(cfg, plan, k["hw"], k["n_params"], k["bw"]["dp"], 0.0, 0.0,
                       k.get("n_expert", 0), k["bw"].get("edp"))[0] / contention for k in terms]
    sim = shared_makespan(schedule, work, [n // p] * p, cores, contention, recv / contention,
                          send / contention, dp_sync, blocked, hw.host_msg_wait_s if probed else 0.0)
    local = max(k["n_params"] - k.get("n_expert", 0) for k in terms) / (
        sharding_degree(plan) if plan.zero >= 1 else 1) + max(k.get("n_expert", 0) for k in terms) / (
        expert_sharding_degree(plan) if plan.zero >= 1 else 1)
    tail = adam_bytes_per_param * local / hw.memory_bw  # memory-bound compute
    comm, waits = 0.0, 0.0
    if p > 1:  # the loss, broadcast from the last stage
        comm, waits = recv + send, hw.host_msg_wait_s if probed else 0.0
    if plan.dp * plan.cp > 1:  # and averaged over the replicas
        d = plan.dp * plan.cp
        comm += cpu_hw.collective_s("all_reduce", d, LOSS_BYTES, k0["bw"]["dp"])
        waits += wait_hw.collective_s("all_reduce", d, LOSS_BYTES, float("inf")) if probed else 0.0
    return sim["makespan"] + (tail + comm / contention) / rate(n, cores, contention) + waits


__all__ = ["rate", "shared_makespan", "shared_host_step"]
