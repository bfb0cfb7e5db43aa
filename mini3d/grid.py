"""The rank grid: world rank <-> (tp, pp, dp) coordinates, and every process group derived from it.

The grid is built once, from one `torch.arange(world).view(...)`, and every group is read off it, so
the groups cannot disagree with the coordinates. The default order makes tp vary fastest (neighbouring
ranks, i.e. GPUs on one NVLink node, share a tp group), then dp, then pp (stages are farthest apart).

Worked example: 8 ranks, tp=2, pp=2, dp=2, order "tp-dp-pp" (the view is (pp, dp, tp)):

    rank : 0  1  2  3  4  5  6  7
    tp   : 0  1  0  1  0  1  0  1
    dp   : 0  0  1  1  0  0  1  1
    pp   : 0  0  0  0  1  1  1  1

    tp groups        [0, 1] [2, 3] [4, 5] [6, 7]       all-reduce every layer: keep on NVLink
    dp groups        [0, 2] [1, 3] [4, 6] [5, 7]       gradient all-reduce / ZeRO once per step
    pp groups        [0, 4] [1, 5] [2, 6] [3, 7]       point-to-point between stages
    mp groups        [0, 1, 4, 5] [2, 3, 6, 7]         one full model replica (tp x pp)
    embedding groups [0, 4] [1, 5] [2, 6] [3, 7]       first + last stage (tied embeddings)

With 4 GPUs per node, ranks 0-3 form node 0 and 4-7 node 1: every tp group stays inside a node, and
the pp groups are the ones that cross between nodes. `describe()` prints this map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

AXES = ("tp", "pp", "dp")
DEFAULT_ORDER = "tp-dp-pp"


def _parse_order(order: str) -> tuple[str, ...]:
    names = tuple(order.split("-"))
    if sorted(names) != sorted(AXES):
        raise ValueError(f"order={order!r} must name tp, pp and dp once each, e.g. {DEFAULT_ORDER!r}")
    return names


class Grid:
    """Pure description of the rank grid (no process groups): coordinates and group membership."""

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, order: str = DEFAULT_ORDER):
        self.sizes = {"tp": tp, "pp": pp, "dp": dp}
        self.order = _parse_order(order)  # fastest-varying axis first
        self.world_size = tp * pp * dp
        slow_to_fast = tuple(reversed(self.order))
        self._dims = slow_to_fast
        self.ranks = torch.arange(self.world_size, device="cpu").view(*(self.sizes[a] for a in slow_to_fast))

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': i, 'pp': j, 'dp': k} of a world rank."""
        idx = (self.ranks == rank).nonzero()
        if idx.numel() == 0:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size} ranks")
        return {a: int(i) for a, i in zip(self._dims, idx[0])}

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        c = {"tp": tp, "pp": pp, "dp": dp}
        return int(self.ranks[tuple(c[a] for a in self._dims)])

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of one axis, as lists of world ranks ordered by that axis' coordinate.

        Axes: tp, pp, dp; `mp` (tp x pp: one model replica); `embedding` (first and last stage)."""
        if axis in AXES:
            d = self._dims.index(axis)
            moved = self.ranks.movedim(d, -1).reshape(-1, self.sizes[axis])
            return sorted(moved.tolist())
        if axis == "mp":
            d = self._dims.index("dp")
            moved = self.ranks.movedim(d, 0).reshape(self.sizes["dp"], -1)
            return sorted(sorted(g) for g in moved.tolist())
        if axis == "embedding":
            out = []
            for g in self.groups("pp"):
                ends = [g[0], g[-1]] if len(g) > 1 else [g[0]]
                out.append(ends)
            return out
        raise ValueError(f"unknown axis {axis!r}")

    def group_of(self, rank: int, axis: str) -> list[int]:
        for g in self.groups(axis):
            if rank in g:
                return g
        return [rank]  # e.g. a middle pipeline stage is in no embedding group

    def node_of(self, rank: int, gpus_per_node: int) -> int:
        return rank // gpus_per_node

    def crossing_groups(self, axis: str, gpus_per_node: int) -> list[list[int]]:
        """Groups of `axis` whose members sit on more than one node."""
        return [g for g in self.groups(axis) if len({r // gpus_per_node for r in g}) > 1]

    def describe(self, gpus_per_node: int | None = None) -> str:
        """A printable rank map; flags tp groups that cross a node boundary."""
        s = self.sizes
        lines = [f"grid tp={s['tp']} pp={s['pp']} dp={s['dp']} (world {self.world_size}, "
                 f"order {'-'.join(self.order)}, fastest first)"]
        lines.append("rank  " + " ".join(f"{r:>3}" for r in range(self.world_size)))
        for a in AXES:
            lines.append(f"{a:<5} " + " ".join(f"{self.coords(r)[a]:>3}" for r in range(self.world_size)))
        if gpus_per_node:
            lines.append("node  " + " ".join(f"{r // gpus_per_node:>3}" for r in range(self.world_size)))
        for a in AXES + ("mp",):
            lines.append(f"{a} groups: " + " ".join(str(g) for g in self.groups(a)))
        if gpus_per_node:
            bad = self.crossing_groups("tp", gpus_per_node)
            if bad:
                lines.append(f"WARNING: tp groups {bad} cross a node boundary ({gpus_per_node} GPUs "
                             f"per node): every layer's all-reduce would leave NVLink; make tp <= "
                             f"{gpus_per_node} and keep tp fastest in the order")
            else:
                lines.append(f"every tp group stays inside one node ({gpus_per_node} GPUs per node)")
        return "\n".join(lines)


@dataclass
class Axis:
    """One rank's view of one axis: its group, members, and position."""

    name: str  # tp, pp, dp, mp or embedding
    ranks: tuple[int, ...]  # world ranks of the group, by coordinate along the axis
    index: int  # this rank's position in `ranks`
    group: object = None  # torch ProcessGroup (None when the group has one member)
    log: object = None  # the process' CommLog (see comm.py)
    device: torch.device | None = None  # where this rank's tensors on the axis live (checked by comm)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, offset: int) -> int:
        """World rank `offset` steps along the axis (wrapping), e.g. the next pipeline stage."""
        return self.ranks[(self.index + offset) % self.size]


@dataclass
class Topology:
    """Everything one rank needs to know about the layout; passed explicitly, never global."""

    grid: Grid
    rank: int
    device: torch.device
    axes: dict[str, Axis] = field(default_factory=dict)
    log: object = None

    @property
    def tp(self) -> Axis:
        return self.axes["tp"]

    @property
    def pp(self) -> Axis:
        return self.axes["pp"]

    @property
    def dp(self) -> Axis:
        return self.axes["dp"]

    @property
    def coords(self) -> dict[str, int]:
        return self.grid.coords(self.rank)


def build_topology(grid: Grid, rank: int, device: torch.device | str = "cpu", log=None,
                   make_groups: bool = True) -> Topology:
    """Create every process group of every axis (collectively, in the same order on all ranks)
    and return this rank's Topology. `make_groups=False` gives a process-free view for tests."""
    import torch.distributed as dist

    from .comm import CommLog

    log = log if log is not None else CommLog(rank)
    topo = Topology(grid, rank, torch.device(device), log=log)
    for name in AXES + ("mp", "embedding"):
        mine = None
        for g in grid.groups(name):
            pg = dist.new_group(g) if (make_groups and len(g) > 1) else None
            if rank in g:
                mine = (g, pg)
        g, pg = mine if mine else ([rank], None)
        topo.axes[name] = Axis(name, tuple(g), g.index(rank), pg, log, topo.device)
    # the whole job; group None is torch's default (world) group
    topo.axes["world"] = Axis("world", tuple(range(grid.world_size)), rank, None, log, topo.device)
    return topo
