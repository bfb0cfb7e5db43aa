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
first and the last stage), see `partition.stage_rank`. A transfer between two stages on
the same rank (only when p == 1) needs no action: the runtime hands the tensor over locally.

The compute order comes from the published schedules (GPipe; 1F1B of PipeDream-Flush / Megatron;
Megatron's interleaved 1F1B; looped BFS of Lamy-Poirier 2022; ZB-H1 and ZB-V of Qi et al. 2023). The transfers are then placed by `add_transfers`: it times the
compute order with unit costs, lists every compute and transfer in one global time order, and gives
each rank the projection of that list. Any execution of such projections with blocking send/recv is
deadlock-free, because the global list itself is one valid execution in which every transfer finds
both ends waiting for it (and blocking point-to-point matching is deterministic).
"""

from __future__ import annotations

from ..config import MULTI_CHUNK, schedule_problems  # noqa: F401  (re-exported: the rules live with Plan)
from ..config import SCHEDULES as KINDS  # noqa: F401
from .actions import B, F, W, Action, Schedule, add_transfers, format_grid  # noqa: F401
from .placement import placement_of  # noqa: F401

def in_flight_bound(kind: str, p: int, m: int, v: int, rank: int) -> int:
    """The most micro-batch chunks (forwards not yet backwarded) `rank` holds at once under `kind`:
    GPipe m; looped BFS m v (every chunk forward first); 1F1B min(m, p - rank); ZB-H1 min(m, p) (a
    micro-batch lives until its W, which rank r runs r micro-batches late); interleaved 1F1B its
    warm-up 2 (p - rank - 1) + (v - 1) g plus the one in flight, at most m v, with g = p when p
    divides m (else PyTorch's round m // max(1, m // p)). Each builder promises it
    (`Schedule.in_flight_bound`, verified by `rules.check`), and the memory estimator counts
    activations with it. ZB-V's bound is counted on its schedule (`mini3d.pp.zero_bubble`)."""
    if kind == "gpipe":
        return m
    if kind == "looped-bfs":
        return m * v
    if kind == "zb-h1":
        return min(m, p)
    if kind == "interleaved":
        g = m // max(1, m // p)
        return min(2 * (p - rank - 1) + (v - 1) * g + 1, m * v)
    return min(p - rank, m)


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
    return add_transfers("looped-bfs", p, m, v, orders,
                         tuple(in_flight_bound("looped-bfs", p, m, v, r) for r in range(p)))


def make_schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `kind` (one of KINDS) for p ranks, m micro-batches, v chunks per rank."""
    problems = schedule_problems(kind, p, m, v)
    if problems:
        raise ValueError("; ".join(problems))
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    if kind == "looped-bfs":
        return looped_bfs(p, m, v)
    if kind in ("zb-h1", "zbv"):
        from .zero_bubble import zb_h1, zbv

        return zb_h1(p, m) if kind == "zb-h1" else zbv(p, m)
    return interleaved_1f1b(p, m, v)


__all__ = ["Action", "Schedule", "KINDS", "F", "B", "W", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "looped_bfs", "placement_of", "make_schedule", "schedule_problems", "add_transfers",
           "format_grid", "in_flight_bound", "MULTI_CHUNK"]
