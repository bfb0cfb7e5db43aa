"""The rank grid: world rank <-> (tp, cp, pp, dp) coordinates, and every process group derived from it.

The grid is built once, from one `torch.arange(world).view(...)`, and every group is read off it, so
the groups cannot disagree with the coordinates. The default order makes tp vary fastest (neighbouring
ranks, i.e. GPUs on one NVLink node, share a tp group), then cp (context parallelism: the ring
attention's K/V exchange every layer, next-fastest), then dp, then pp (stages are farthest apart).
An order string names the axes fastest first; one without cp (the older "tp-dp-pp" form) places cp
right after tp. "tp-dp-cp-pp" puts cp next to dp instead.

Worked example: 8 ranks, tp=2, pp=2, dp=2, order "tp-dp-pp" (cp=1; the view is (pp, dp, cp, tp)):

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

Worked example with context parallelism: 8 ranks, tp=2, cp=2, pp=2, order "tp-cp-dp-pp":

    rank : 0  1  2  3  4  5  6  7
    tp   : 0  1  0  1  0  1  0  1
    cp   : 0  0  1  1  0  0  1  1
    pp   : 0  0  0  0  1  1  1  1

    cp groups        [0, 2] [1, 3] [4, 6] [5, 7]       ring attention's K/V p2p, every layer
    dp_cp groups     [0, 2] [1, 3] [4, 6] [5, 7]       parameter gradients: cp ranks hold the
                                                       same weights, so they sync like dp replicas
    mp groups        [0, 1, 4, 5] [2, 3, 6, 7]         one model replica (tp x pp); the sequence is
                                                       split over cp, so a replica is tp x cp x pp

Worked example with expert parallelism: 8 ranks, tp=2, dp=4, ep=2 (cp=1, pp=1). The ep groups are
carved out of each dp x cp group (sorted by world rank) as dp*cp/ep consecutive runs of ep ranks;
an edp group holds the ranks at the same position of their ep group (the same experts):

    rank : 0  1  2  3  4  5  6  7
    tp   : 0  1  0  1  0  1  0  1
    dp   : 0  0  1  1  2  2  3  3
    ep   : 0  0  1  1  0  0  1  1        (position in the ep group)

    dp groups        [0, 2, 4, 6] [1, 3, 5, 7]      dense gradients, as without ep
    ep groups        [0, 2] [1, 3] [4, 6] [5, 7]      the MoE layers' token all-to-alls; each
                                                       member holds n_experts/ep of the experts
    edp groups       [0, 4] [1, 5] [2, 6] [3, 7]      expert gradients (ranks holding the same
                                                       experts): |edp| = dp*cp/ep

With ep=1 the ep groups are single ranks and edp is dp x cp itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

AXES = ("tp", "cp", "pp", "dp")
DEFAULT_ORDER = "tp-cp-dp-pp"


def _parse_order(order: str) -> tuple[str, ...]:
    names = list(order.split("-"))
    if "cp" not in names and "tp" in names:  # the three-axis form: cp goes right after tp
        names.insert(names.index("tp") + 1, "cp")
    if sorted(names) != sorted(AXES):
        raise ValueError(f"order={order!r} must name tp, cp, pp and dp once each (cp may be left "
                         f"out: it then follows tp), e.g. {DEFAULT_ORDER!r}")
    return tuple(names)


class Grid:
    """Pure description of the rank grid (no process groups): coordinates and group membership."""

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, order: str = DEFAULT_ORDER,
                 cp: int = 1, ep: int = 1):
        self.sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        if ep < 1 or (dp * cp) % ep:
            raise ValueError(f"ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp} (the ep ranks are "
                             f"carved out of dp x cp)")
        self.ep = ep  # not an axis of the view: ep and edp groups are read off the dp x cp groups
        self.order = _parse_order(order)  # fastest-varying axis first
        self.world_size = tp * cp * pp * dp
        slow_to_fast = tuple(reversed(self.order))
        self._dims = slow_to_fast
        self.ranks = torch.arange(self.world_size, device="cpu").view(*(self.sizes[a] for a in slow_to_fast))

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': i, 'pp': j, 'dp': k} of a world rank, and 'cp': c when cp > 1, 'ep': the position
        in its ep group when ep > 1 (so layouts without them report the coordinates they always
        did)."""
        idx = (self.ranks == rank).nonzero()
        if idx.numel() == 0:
            raise ValueError(f"rank {rank} is outside a grid of {self.world_size} ranks")
        out = {a: int(i) for a, i in zip(self._dims, idx[0]) if a != "cp" or self.sizes["cp"] > 1}
        if self.ep > 1:
            out["ep"] = self.group_of(rank, "ep").index(rank)
        return out

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0) -> int:
        c = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        return int(self.ranks[tuple(c[a] for a in self._dims)])

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of one axis, as lists of world ranks ordered by that axis' coordinate.

        Axes: tp, cp, pp, dp; `mp` (tp x pp: the ranks that hold one model replica's weights
        together, at one cp coordinate); `dp_cp` (cp x dp: the ranks holding the same weights, over
        which parameter gradients are summed); `embedding` (first and last stage); `ep` (each dp_cp
        group, by world rank, cut into runs of ep ranks: the MoE all-to-all groups) and `edp` (the
        ranks at one position of their ep groups in one dp_cp group: expert gradients)."""
        if axis in ("ep", "edp"):
            ep, out = self.ep, []
            for g in self._span(("dp", "cp")):
                if axis == "ep":
                    out += [g[i:i + ep] for i in range(0, len(g), ep)]
                else:
                    out += [g[j::ep] for j in range(ep)]
            return sorted(out)
        if axis in AXES:
            return self._span((axis,))
        if axis == "mp":
            return self._span(("tp", "pp"))
        if axis == "dp_cp":
            return self._span(("dp", "cp"))
        if axis == "embedding":
            out = []
            for g in self.groups("pp"):
                ends = [g[0], g[-1]] if len(g) > 1 else [g[0]]
                out.append(ends)
            return out
        raise ValueError(f"unknown axis {axis!r}")

    def _span(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Groups of ranks that differ only in the coordinates of `axes` (members by coordinate for
        one axis, by world rank for several)."""
        dims = [self._dims.index(a) for a in axes]
        size = 1
        for a in axes:
            size *= self.sizes[a]
        moved = self.ranks.movedim(dims, list(range(-len(dims), 0))).reshape(-1, size)
        groups = moved.tolist()
        return sorted(groups) if len(axes) == 1 else sorted(sorted(g) for g in groups)

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
        """A printable rank map; flags tp groups (and notes cp groups) that cross a node boundary.
        The cp axis is shown only when cp > 1, the ep position and the ep / edp groups when ep > 1."""
        s = self.sizes
        shown = tuple(a for a in AXES if a != "cp" or s["cp"] > 1)
        lines = [" ".join(f"{a}={s[a]}" for a in ("tp",) + shown[1:] if a in shown)]
        lines[0] = (f"grid {lines[0]} (world {self.world_size}, order "
                    f"{'-'.join(a for a in self.order if a in shown)}, fastest first)")
        lines.append("rank  " + " ".join(f"{r:>3}" for r in range(self.world_size)))
        if self.ep > 1:
            lines[0] += f", ep={self.ep} out of dp x cp"
        for a in shown + (("ep",) if self.ep > 1 else ()):
            lines.append(f"{a:<5} " + " ".join(f"{self.coords(r)[a]:>3}" for r in range(self.world_size)))
        if gpus_per_node:
            lines.append("node  " + " ".join(f"{r // gpus_per_node:>3}" for r in range(self.world_size)))
        for a in shown + ("mp",) + (("dp_cp",) if s["cp"] > 1 else ()) + \
                (("ep", "edp") if self.ep > 1 else ()):
            lines.append(f"{a} groups: " + " ".join(str(g) for g in self.groups(a)))
        if gpus_per_node:
            lines += self._node_notes(gpus_per_node)
        return "\n".join(lines)

    def _node_notes(self, gpus_per_node: int) -> list[str]:
        out = []
        bad = self.crossing_groups("tp", gpus_per_node)
        if bad:
            out.append(f"WARNING: tp groups {bad} cross a node boundary ({gpus_per_node} GPUs "
                       f"per node): every layer's all-reduce would leave NVLink; make tp <= "
                       f"{gpus_per_node} and keep tp fastest in the order")
        else:
            out.append(f"every tp group stays inside one node ({gpus_per_node} GPUs per node)")
        cp_bad = self.crossing_groups("cp", gpus_per_node) if self.sizes["cp"] > 1 else []
        if cp_bad:
            out.append(f"note: cp groups {cp_bad} cross a node boundary: ring attention's K/V "
                       f"exchange (every layer, forward and backward) runs over the inter-node "
                       f"network and hides behind compute only if a block's attention takes longer "
                       f"than its transfer; keep tp*cp <= {gpus_per_node} to stay inside a node")
        return out


@dataclass
class Axis:
    """One rank's view of one axis: its group, members, and position."""

    name: str  # tp, cp, pp, dp, dp_cp, mp, embedding, ep or edp
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
    def cp(self) -> Axis:
        return self.axes["cp"]

    @property
    def dp_cp(self) -> Axis:
        """The ranks that hold the same parameters (cp x dp): parameter gradients are averaged and
        ZeRO shards over this group. Without context parallelism it is the dp axis itself."""
        return self.axes["dp"] if self.axes["cp"].size == 1 else self.axes["dp_cp"]

    @property
    def ep(self) -> Axis:
        """The expert-parallel group (the MoE layers' all-to-alls); one rank when ep = 1."""
        return self.axes["ep"]

    @property
    def edp(self) -> Axis:
        """The ranks holding the same experts (expert gradients are averaged and ZeRO-sharded over
        it); dp x cp itself when ep = 1."""
        return self.axes["edp"] if self.grid.ep > 1 else self.dp_cp

    @property
    def coords(self) -> dict[str, int]:
        return self.grid.coords(self.rank)


def build_topology(grid: Grid, rank: int, device: torch.device | str = "cpu", log=None,
                   make_groups: bool = True) -> Topology:
    """Create every process group of every axis (collectively, in the same order on all ranks)
    and return this rank's Topology. `make_groups=False` gives a process-free view for tests."""
    import torch.distributed as dist

    from mini3d.comm_log import CommLog

    log = log if log is not None else CommLog(rank)
    topo = Topology(grid, rank, torch.device(device), log=log)
    names = AXES + ("mp", "embedding") + (("dp_cp",) if grid.sizes["cp"] > 1 else ())
    for name in names + ("ep",) + (("edp",) if grid.ep > 1 else ()):  # edp: dp_cp when ep = 1
        mine = None
        for g in grid.groups(name):
            pg = dist.new_group(g) if (make_groups and len(g) > 1) else None
            if rank in g:
                mine = (g, pg)
        g, pg = mine if mine else ([rank], None)
        topo.axes[name] = Axis(name, tuple(g), g.index(rank), pg, log, topo.device)
    if grid.ep == 1:
        topo.axes["edp"] = topo.dp_cp
    # the whole job; group None is torch's default (world) group
    topo.axes["world"] = Axis("world", tuple(range(grid.world_size)), rank, None, log, topo.device)
    return topo
