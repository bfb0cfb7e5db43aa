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

This is a fluid model: between events every runnable process advances at rate(R), and the next
event is the earliest completion. The schedule's dependencies are the pipeline simulator's
(`mini3d.pp.simulator`), so the bubble comes out of the same orders the runtime executes.
"""

from __future__ import annotations

from ..pp.simulator import Stuck, _dependency

EPS = 1e-12


def rate(runnable: float, cores: int, contention: float = 1.0) -> float:
    """Alone-speed seconds each of `runnable` processes gets done per second on `cores`."""
    return 1.0 / (contention * max(1.0, runnable / cores))


def shared_makespan(schedule, work: dict, weights, cores: int, contention: float = 1.0,
                    recv: float = 0.0, send: float = 0.0, after=0.0,
                    blocked: dict | None = None, recv_wait: float = 0.0) -> dict:
    """Simulate the pipeline part of one step under processor sharing.

    `work`: {"F": [...], "B": [...], "W": [...]} alone-speed seconds per stage (model chunk);
    `recv` / `send`: alone-speed seconds of each end of a cross-rank message (before the action
    that needs its input, after the one that produced it); `after`: per-rank work after its last
    action (scalar or list: its data-parallel gradient sync); `blocked`: like `work`, wall
    seconds each action also spends blocked (taking no core) after its work, `recv_wait` more for
    an action that received its input; `weights`:
    processes per pipeline rank. Returns {"makespan", "busy": per-rank runnable seconds,
    "finish": per-rank end times}."""
    p = schedule.p
    after = list(after) if isinstance(after, (list, tuple)) else [after] * p
    blocked = blocked or {}
    programs = []  # per rank: [(dependency or None, alone-speed work, blocked wall s, key)]
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
    done: dict = {}
    step, left = [0] * p, [0.0] * p
    state = ["idle"] * p  # idle (between steps, or waiting for an input) | run | blocked
    until = [0.0] * p  # end of a blocked wait
    busy, finish = [0.0] * p, [0.0] * p
    now = 0.0

    def complete(r):
        key = programs[r][step[r]][3]
        if key is not None:
            done[key] = now
        state[r], step[r] = "idle", step[r] + 1
        if step[r] == len(programs[r]):
            finish[r] = now

    def advance(r):
        """Start rank r's next step when its input exists (zero-length steps complete at once)."""
        while step[r] < len(programs[r]):
            dep, seconds, wait, _ = programs[r][step[r]]
            if dep is not None and dep not in done:
                return
            if seconds > EPS:
                state[r], left[r] = "run", seconds
                return
            if wait > EPS:
                state[r], until[r] = "blocked", now + wait
                return
            complete(r)

    for r in range(p):
        advance(r)
    while "run" in state or "blocked" in state:
        active = [r for r in range(p) if state[r] == "run"]
        speed = rate(sum(weights[r] for r in active), cores, contention)
        dt = min([left[r] / speed for r in active]
                 + [until[r] - now for r in range(p) if state[r] == "blocked"])
        now += max(dt, 0.0)
        for r in range(p):
            if state[r] == "run":
                left[r] -= dt * speed
                busy[r] += dt
                if left[r] <= EPS * max(1.0, now):
                    wait = programs[r][step[r]][2]
                    if wait > EPS:
                        state[r], until[r] = "blocked", now + wait
                    else:
                        complete(r)
            elif state[r] == "blocked" and until[r] <= now + EPS * max(1.0, now):
                complete(r)
        changed = True
        while changed:  # finished ranks move on; ranks waiting for an input may now have it
            before = len(done), state.count("idle")
            for r in range(p):
                if state[r] == "idle" and step[r] < len(programs[r]):
                    advance(r)
            changed = (len(done), state.count("idle")) != before
    stuck = [f"rank {r} at {programs[r][step[r]][3]}" for r in range(p) if step[r] < len(programs[r])]
    if stuck:
        raise Stuck("shared-host simulation: every rank waits for an input; " + ", ".join(stuck))
    return {"makespan": now, "busy": busy, "finish": finish}


__all__ = ["rate", "shared_makespan"]
