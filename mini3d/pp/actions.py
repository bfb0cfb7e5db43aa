"""The schedule's vocabulary: actions (`F(stage, mb)`, `B`, `W`, sends and receives), the
`Schedule` (per-rank ordered action lists), the transfer placement that turns compute orders into a
deadlock-free program (`add_transfers`) and the grid printout. The schedule builders
(`mini3d.pp.schedules`, `mini3d.pp.zero_bubble`) use these; the runtime, simulator, rule checker
and figures read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .placement import stage_rank

COMPUTE = ("F", "B", "W")


TRANSFERS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_SHORT = {"SEND_F": "sF", "RECV_F": "rF", "SEND_B": "sB", "RECV_B": "rB"}


class Action(NamedTuple):
    """One step of one pipeline rank; `peer` is the other pipeline rank of a transfer."""

    op: str  # F, B, W, SEND_F, RECV_F, SEND_B or RECV_B
    stage: int  # global stage (model chunk) id
    mb: int  # micro-batch index
    peer: int | None = None  # pipeline rank at the other end (transfers only)

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.op}{self.stage}.{self.mb}"
        arrow = ">" if self.op.startswith("SEND") else "<"
        return f"{_SHORT[self.op]}{self.stage}.{self.mb}{arrow}{self.peer}"


def F(stage: int, mb: int) -> Action:
    return Action("F", stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action("B", stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action("W", stage, mb)


@dataclass(frozen=True)
class Schedule:
    """Per-pipeline-rank ordered action lists for p ranks, m micro-batches, v chunks per rank."""

    kind: str
    p: int  # pipeline ranks
    m: int  # micro-batches per step
    v: int  # model chunks (virtual stages) per rank
    actions: tuple  # actions[r] is rank r's tuple of Actions, in execution order
    in_flight_bound: tuple = ()  # promised peak of micro-batches alive (F to last B/W) per rank
    placement: str = "loop"  # "loop": stage s on rank s % p; "v": see partition.stage_rank

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
    from .simulator import time_compute

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
    from .simulator import time_compute

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


__all__ = ["Action", "Schedule", "COMPUTE", "TRANSFERS", "F", "B", "W", "add_transfers", "format_grid"]
