"""Pipeline schedules as data: pure functions returning per-pipeline-rank ordered action lists.

A `Schedule` holds, for each pipeline rank, the exact order in which that rank runs forwards (F),
backwards (B) and the point-to-point transfers they imply. The runtime executes it, the simulator
times it, the figures draw it, the exercises grade it, and `check()` (rules.py) verifies it.

Stages are global model chunks 0 .. p*v-1; stage s lives on pipeline rank s % p (for v > 1 this is
Megatron's round-robin assignment: rank r holds stages r, r+p, r+2p, ...). Actions:

    F(s, mb)            forward of stage s on micro-batch mb            printed  F1.0
    B(s, mb)            backward of stage s on micro-batch mb           printed  B1.0
    W(s, mb)            weight gradients of stage s on micro-batch mb   printed  W1.0
    SEND_F(s, mb, q)    send stage s's output to rank q (holds s+1)     printed  sF1.0>2
    RECV_F(s, mb, q)    receive stage s's input from rank q (holds s-1) printed  rF1.0<0
    SEND_B(s, mb, q)    send the gradient of stage s's input to q       printed  sB1.0>0
    RECV_B(s, mb, q)    receive the gradient of stage s's output from q printed  rB1.0<2

When a schedule has W actions (the zero-bubble kinds, `zero_bubble.py`), B computes only the gradient
of the stage input (what the upstream stage waits for) and W the weight gradients later; without W,
B is the whole backward. So SEND_F(s) pairs with RECV_F(s+1) and SEND_B(s) with RECV_B(s-1).

Placement: by default stage s lives on rank s % p ("loop"); the V-shaped schedule (zbv) places
chunk c of rank r at stage c p + r for even c and (c + 1) p - 1 - r for odd c ("v": rank 0 holds the
first and the last stage), see `placement.stage_rank`. A transfer between two stages on
the same rank (only when p == 1) needs no action: the runtime hands the tensor over locally.

What a kind is (its chunks per rank, rules, placement, in-flight bounds, bubble) is an object of the
registry, mini3d/schedule_kinds.py, which names its builder here (`BUILDERS`); every bound a builder
promises comes from it and `rules.check` verifies it on the lists.

The compute order comes from the published schedules (GPipe; 1F1B of PipeDream-Flush / Megatron;
Megatron's interleaved 1F1B; looped BFS of Lamy-Poirier 2022; ZB-H1 and ZB-V of Qi et al. 2023). The transfers are then placed by `add_transfers`: it times the
compute order with unit costs, lists every compute and transfer in one global time order, and gives
each rank the projection of that list. Any execution of such projections with blocking send/recv is
deadlock-free, because the global list itself is one valid execution in which every transfer finds
both ends waiting for it (and blocking point-to-point matching is deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

from mini3d.schedule_kinds import MULTI_CHUNK, SCHEDULES as KINDS, schedule_kind, schedule_problems
from mini3d.pp.placement import stage_rank
from mini3d.pp.actions import COMPUTE, TRANSFERS, Action, B, F, W
from mini3d.pp.zero_bubble import zb_h1_orders, zbv_orders


def placement_of(kind: str) -> str:
    """How `kind` places stages on ranks ("loop" or "v", see placement.stage_rank): the registry's
    `ScheduleKind.placement`."""
    return schedule_kind(kind).placement


@dataclass(frozen=True)
class Schedule:
    """Per-pipeline-rank ordered action lists for p ranks, m micro-batches, v chunks per rank."""

    kind: str
    p: int  # pipeline ranks
    m: int  # micro-batches per step
    v: int  # model chunks (virtual stages) per rank
    actions: tuple  # actions[r] is rank r's tuple of Actions, in execution order
    in_flight_bound: tuple = ()  # promised peak of micro-batches alive (F to last B/W) per rank
    placement: str = "loop"  # "loop": stage s on rank s % p; "v": see placement.stage_rank

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    @property
    def split(self) -> bool:
        """True when backwards are split into B (input gradient) and W (weight gradients)."""
        return any(a.op == "W" for acts in self.actions for a in acts)

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.p, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def format_grid(self, transfers: bool = False) -> str:
        return format_grid(self, transfers)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "p": self.p, "m": self.m, "v": self.v,
                "actions": [[str(a) for a in acts] for acts in self.actions],
                "in_flight_bound": list(self.in_flight_bound), "placement": self.placement}


def in_flight_bound(kind: str, p: int, m: int, v: int, rank: int) -> int:
    """The most micro-batch chunks (forward done, last backward action not yet) `rank` holds at
    once under `kind`: the registry's `ScheduleKind.in_flight` (mini3d/schedule_kinds.py). Each
    builder promises it (`Schedule.in_flight_bound`, verified by `rules.check`), and the memory
    estimator counts activations with it."""
    return schedule_kind(kind).in_flight(p, m, v, rank)


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019): every rank holds m activations."""
    orders = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    bounds = tuple(in_flight_bound("gpipe", p, m, 1, r) for r in range(p))
    return add_transfers("gpipe", p, m, 1, orders, bounds)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r runs p-r-1 warm-up forwards, then alternates one forward and
    one backward, then drains the remaining backwards; at most p-r micro-batches are in flight."""
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [F(r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [F(r, warm + i), B(r, i)]
        order += [B(r, i) for i in range(m - warm, m)]
        orders.append(order)
    bounds = tuple(in_flight_bound("1f1b", p, m, 1, r) for r in range(p))
    return add_transfers("1f1b", p, m, 1, orders, bounds)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): rank r holds stages r, r+p, ...;
    micro-batches go through a chunk in rounds of g = m // max(1, m // p) (g = p when p divides
    m, Megatron's case; otherwise PyTorch's relaxation, which needs g to divide m): the k-th
    forward on a rank runs chunk (k // g) % v on micro-batch (k // (g v)) g + k % g, and backwards
    walk the chunks in reverse. Warm-up is 2 (p - r - 1) + (v - 1) g forwards."""
    total, g = m * v, m // max(1, m // p)

    def mb_of(k):
        return (k // (g * v)) * g + k % g

    orders = []
    for r in range(p):
        def fwd(k):
            return F(((k // g) % v) * p + r, mb_of(k))

        def bwd(k):
            return B((v - 1 - (k // g) % v) * p + r, mb_of(k))

        warm = min(2 * (p - r - 1) + (v - 1) * g, total)
        order = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            order += [fwd(warm + i), bwd(i)]
        order += [bwd(k) for k in range(total - warm, total)]
        orders.append(order)
    bounds = tuple(in_flight_bound("interleaved", p, m, v, r) for r in range(p))
    return add_transfers("interleaved", p, m, v, orders, bounds)


def looped_bfs(p: int, m: int, v: int) -> Schedule:
    """Breadth-first looping (Lamy-Poirier 2022), as PyTorch's ScheduleLoopedBFS orders it: rank r
    runs every micro-batch through its chunk 0, then chunk 1, ...; then the backwards, last chunk
    first, micro-batches in reverse order. Like GPipe, all m v chunk activations stay alive."""
    orders = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        order = [F(s, i) for s in stages for i in range(m)]
        order += [B(s, i) for s in reversed(stages) for i in reversed(range(m))]
        orders.append(order)
    bounds = tuple(in_flight_bound("looped-bfs", p, m, v, r) for r in range(p))
    return add_transfers("looped-bfs", p, m, v, orders, bounds)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023) for p ranks, m >= p micro-batches: see `zero_bubble.py`."""
    bounds = tuple(in_flight_bound("zb-h1", p, m, 1, r) for r in range(p))
    return add_transfers("zb-h1", p, m, 1, zb_h1_orders(p, m), bounds)


def zbv(p: int, m: int) -> Schedule:
    """ZB-V, two chunks per rank in a V (stages r and 2p-1-r on rank r): see `zero_bubble.py`."""
    bounds = tuple(in_flight_bound("zbv", p, m, 2, r) for r in range(p))
    return add_transfers("zbv", p, m, 2, zbv_orders(p, m), bounds, placement_of("zbv"))


BUILDERS = {f.__name__: f for f in (gpipe, one_f_one_b, interleaved_1f1b, looped_bfs, zb_h1, zbv)}


def make_schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `kind` (one of KINDS) for p ranks, m micro-batches, v chunks per rank."""
    problems = schedule_problems(kind, p, m, v)
    if problems:
        raise ValueError("; ".join(problems))
    k = schedule_kind(kind)
    build = BUILDERS[k.builder]  # each kind names its builder
    return build(p, m, v) if k.fixed_chunks is None else build(p, m)


def bubble_text(kind: str, p: int, m: int, v: int = 1) -> str:
    """The bubble at unit costs (t_F = 1, t_bwd = 2 per stage, split into B = W = 1), as the dry run
    and the course print it: '(p-1)/(m+p-1) = 3/11 = 27.3%', or, for a kind with no closed form,
    the simulated fraction of the schedule itself."""
    from mini3d.pp.simulator import simulate

    k = schedule_kind(kind)
    value = k.bubble(p, m, v)
    if value is None:
        b = simulate(make_schedule(kind, p, m, v), 1, 2).bubble_fraction
        return f"no closed form, simulated at t_F = 1, t_bwd = 2: {float(b):.1%}"
    costs = " (t_F = t_B = t_W)" if k.split else ""
    return f"{k.form} = {value.numerator}/{value.denominator} = {float(value):.1%}{costs}"


def _unit_costs(orders) -> dict:
    """Every compute action one time unit (B and W too when split): the grid's and the transfer
    placement's clock, as keyword arguments of `simulator.time_compute`."""
    split = any(a.op == "W" for order in orders for a in order)
    return {"t_fwd": 1, "t_bwd": 2 if split else 1, "t_w": 1}


def add_transfers(kind: str, p: int, m: int, v: int, orders: list[list[Action]],
                  bounds: tuple = (), placement: str = "loop") -> Schedule:
    """Insert the sends/receives that per-rank compute orders imply, in a deadlock-free order.

    Every compute action is timed with unit costs (`simulator.time_compute`); a transfer is placed
    in one global list right after the compute that produces its tensor, and each rank keeps its
    own events of that list, in that order (see the module docstring for why this cannot hang)."""
    from mini3d.pp.simulator import time_compute

    n_stages = p * v
    times = time_compute(orders, p, n_stages, t_p2p=0, placement=placement, **_unit_costs(orders))
    events = []  # (time, priority, rank, tiebreak, [(rank, action), ...])
    for r, order in enumerate(orders):
        for i, (a, (start, end)) in enumerate(zip(order, times[r])):
            events.append((start, 1, r, i, [(r, a)]))
            nxt = a.stage + 1 if a.op == "F" else a.stage - 1
            if a.op != "W" and 0 <= nxt < n_stages and stage_rank(nxt, p, placement) != r:
                q = stage_rank(nxt, p, placement)
                send, recv = ("SEND_F", "RECV_F") if a.op == "F" else ("SEND_B", "RECV_B")
                pair = [(r, Action(send, a.stage, a.mb, q)), (q, Action(recv, nxt, a.mb, r))]
                events.append((end, 0, r, i, pair))
    events.sort(key=lambda e: e[:4])
    actions = [[] for _ in range(p)]
    for *_, items in events:
        for r, a in items:
            actions[r].append(a)
    return Schedule(kind, p, m, v, tuple(tuple(a) for a in actions), tuple(bounds), placement)


def format_grid(schedule: Schedule, transfers: bool = False) -> str:
    """Rank-by-step grid. Without transfers, compute actions sit in unit-time columns (F, B and W
    one unit each) so bubbles show as dots; with transfers, each rank's full list in order."""
    from mini3d.pp.simulator import time_compute

    p = schedule.p
    if transfers:
        rows = [[str(a) for a in schedule.actions[r]] for r in range(p)]
    else:
        orders = [schedule.compute(r) for r in range(p)]
        times = time_compute(orders, p, schedule.n_stages, t_p2p=0, placement=schedule.placement,
                             **_unit_costs(orders))
        width = max((int(e) for t in times for _, e in t), default=0)
        rows = [["."] * width for _ in range(p)]
        for r in range(p):
            for a, (s, _) in zip(orders[r], times[r]):
                rows[r][int(s)] = str(a)
    w = max((len(c) for row in rows for c in row), default=1)
    head = f"{schedule.kind} p={schedule.p} m={schedule.m} v={schedule.v}"
    lines = [head] + [f"rank {r}: " + " ".join(c.rjust(w) for c in row) for r, row in enumerate(rows)]
    return "\n".join(lines)


__all__ = ["Action", "Schedule", "KINDS", "F", "B", "W", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "looped_bfs", "zb_h1", "zbv", "placement_of", "MULTI_CHUNK", "COMPUTE", "TRANSFERS", "make_schedule", "schedule_problems", "add_transfers",
           "format_grid", "in_flight_bound", "bubble_text"]
