"""Accelerator presets for the cost model, and hardware descriptions loaded from user JSON.

Bandwidths are per GPU and per direction, in bytes/s, as a ring collective sees them ("bus
bandwidth"): NVLink 3 gives an A100 600 GB/s both ways, so 300e9 here; a DGX A100 has one 200 Gb/s
HDR InfiniBand port per GPU, 25e9 here; H100/H200 systems one 400 Gb/s NDR port per GPU, 50e9.
FLOP/s are the dense (no sparsity) bf16 tensor-core peaks from the vendor data sheets.

Collectives (`Hardware.collective_s`) follow what NCCL does, not one flat ring: a group inside one
node runs a ring over NVLink; a group spanning nodes runs a ring whose inter-node hops each pay
`internode_latency_s`, or, for an all-reduce, NCCL's double binary tree (latency 2((k-1) intra +
ceil(log2 nodes) inter hops), the full buffer up and down), whichever is faster for that message
size and group size (NCCL's tuner chooses the same way). Its bandwidth across nodes is that of
the NICs of the group's members in a node (NCCL runs one ring per NIC: k members per node use k
rails), `link_bandwidths` in `mini3d.cost.model`. A shared host (gloo on a CPU) keeps the flat
ring: gloo has no tree. An all-to-all (expert parallelism's dispatch and combine) is timed as
a pairwise exchange (`all_to_all_s`).

`eff_max` and `eff_half_width` optionally override the cost model's calibrated compute efficiency
(`mini3d.cost.model.Efficiency`, fitted on two A100 rows); `mini3d calibrate` writes them for a
measured machine. The H100 / H200 presets carry `H100_EFF_MAX`: the fraction of the 989 TFLOP/s
peak that torchtitan's published eager FSDP run of Llama 3.1 8B on 8 H100s reaches (5,762 tokens/s
per GPU, `mini3d.cost.published`; its 128-GPU row is then predicted, not fitted). It is about half
the A100's: an H100 needs larger matmuls and faster non-matmul work to stay busy (chapter 09's
roofline), and torchtitan's H100s ran at 500 W. Without it the model predicted 66% MFU there.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from mini3d.comm import ring_steps, ring_wire_bytes

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and the links between them."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s per GPU (float32 runs use `peak_flops_fp32`)
    memory_bytes: float  # HBM capacity per GPU
    memory_bw: float  # HBM bytes/s per GPU
    nvlink_bw: float  # intra-node bytes/s per GPU per direction
    internode_bw: float  # inter-node bytes/s per GPU per direction
    gpus_per_node: int = 8
    latency_s: float = 1.5e-6  # one message (one ring step, or one p2p transfer); see collective_s
    internode_latency_s: float = 5e-6  # one ring step or tree hop through the network (NCCL: ~5 us)
    peak_flops_fp32: float | None = None  # None: same as peak_flops (a CPU); GPUs: TF32-free fp32
    eff_max: float | None = None  # compute-efficiency override (None: calibrated A100 values)
    eff_half_width: float | None = None
    shared_host: bool = False  # all ranks share one host's cores (mini3d on a CPU)
    layer_overhead_s: float = 0.0  # fixed cost per layer, micro-batch, forward+backward (kernel launches)
    token_overhead_s: float = 0.0  # per token and layer, fwd+bwd, beyond the matmul FLOPs (CPU only)
    host_slowdown: tuple = ()  # ((world size, measured factor), ...) on a shared host (host_probe)
    # Shared host, measured by `mini3d.cost.host_probe` with the layout's processes (0: use
    # latency_s): CPU seconds (every thread) of one collective ring step on each member and of
    # one end of a p2p message, and the wall seconds each also waits blocked, taking no core.
    host_step_cpu_s: float = 0.0
    host_step_wait_s: float = 0.0
    host_msg_cpu_s: float = 0.0
    host_msg_wait_s: float = 0.0
    host_cpu_factor: float = 0.0  # CPU seconds of compute under the layout's contention / alone

    def flops(self, dtype: str) -> float:
        if dtype == "float32" and self.peak_flops_fp32:
            return self.peak_flops_fp32
        return self.peak_flops

    def slowdown(self, world: int) -> float:
        """How many times slower each of `world` ranks computes and communicates than one alone
        (CPU work: copies, gloo threads and Python too): the factor measured for this world size
        by `mini3d.cost.host_probe` when there is one, else world / cores on a shared host
        (never below 1), else 1 (a GPU per rank)."""
        measured = dict(self.host_slowdown)
        if world in measured:
            return float(measured[world])
        return max(1.0, world / self.gpus_per_node) if self.shared_host else 1.0

    def collective_s(self, op: str, n: int, nbytes: float, bandwidth: float,
                     per_node: int | None = None) -> float:
        """Seconds of one `op` ("all_reduce", "all_gather", "reduce_scatter", "send", and
        "all_to_all": `all_to_all_s`) of a full
        tensor of `nbytes` over n members on links of `bandwidth` bytes/s, `per_node` of them in
        each node (None: all in one node): a ring, `latency_s` per step (`internode_latency_s`
        across nodes) plus its wire bytes over `bandwidth` (`mini3d.comm.ring_steps`,
        `ring_wire_bytes`); across nodes an all-reduce takes NCCL's tree (`tree_allreduce_s`)
        when that is faster, as NCCL's tuner does."""
        if n <= 1 and op != "send":
            return 0.0
        if op == "all_to_all":
            return self.all_to_all_s(n, nbytes, bandwidth, per_node)
        spans = per_node is not None and n > per_node and not self.shared_host
        step = self.internode_latency_s if spans else self.latency_s
        ring = ring_steps(op, n) * step + ring_wire_bytes(op, n, nbytes) / bandwidth
        if spans and op == "all_reduce":
            return min(ring, self.tree_allreduce_s(n, nbytes, bandwidth, per_node))
        return ring

    def all_to_all_s(self, n: int, nbytes: float, bandwidth: float,
                     per_node: int | None = None) -> float:
        """Seconds of one all-to-all of a `nbytes` buffer (nbytes / n for each member, its own
        share included) over n members, timed as the pairwise exchange: n - 1 rounds, in round i
        every member sends its block for member + i and receives the one from member - i, one
        latency each (`internode_latency_s` once the group spans nodes); each member sends
        (n - 1) / n of its buffer. Inside a node that goes over `bandwidth`; across nodes the
        blocks for the other nodes' (n - per_node) members leave through the member's own NIC
        (`internode_bw`: an all-to-all has no ring to spread over the node's rails) while the
        (per_node - 1) others go over NVLink, at once: the slower of the two. (NCCL posts all
        the sends and receives at once; its latency is then nearer one round than n - 1, so at
        small messages this is pessimistic.)"""
        if n <= 1:
            return 0.0
        block = nbytes / n
        if per_node is None or n <= per_node or self.shared_host:
            return (n - 1) * self.latency_s + (n - 1) * block / bandwidth
        wire = max((n - per_node) * block / self.internode_bw,
                   (per_node - 1) * block / self.nvlink_bw)
        return (n - 1) * self.internode_latency_s + wire

    def tree_allreduce_s(self, n: int, nbytes: float, bandwidth: float, per_node: int) -> float:
        """NCCL's tree all-reduce over n ranks, `per_node` in each node: a chain inside the node
        and a (double) binary tree between nodes, reduced up then broadcast down, so the latency
        is 2((per_node - 1) intra + ceil(log2 nodes) inter) hops and every rank moves the full
        buffer twice (pipelined), 2 * nbytes over `bandwidth`."""
        nodes = math.ceil(n / max(1, per_node))
        hops = (per_node - 1) * self.latency_s + math.ceil(math.log2(max(2, nodes))) * self.internode_latency_s
        return 2 * hops + 2 * nbytes / bandwidth

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


H100_EFF_MAX = 0.367  # fitted: mini3d.cost.published.fit_h100_efficiency() (half width: A100's)

PRESETS: dict[str, Hardware] = {
    "A100-40GB": Hardware("A100-40GB", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9, 8,
                          peak_flops_fp32=19.5e12),
    "A100-80GB": Hardware("A100-80GB", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, 8,
                          peak_flops_fp32=19.5e12),
    "H100-80GB": Hardware("H100-80GB", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, 8,
                          peak_flops_fp32=67e12, eff_max=H100_EFF_MAX, eff_half_width=243.8),
    "H200-141GB": Hardware("H200-141GB", 989e12, 141e9, 4.8e12, 450e9, 50e9, 8,
                           peak_flops_fp32=67e12, eff_max=H100_EFF_MAX, eff_half_width=243.8),
}


def hardware_from_dict(d: dict) -> Hardware:
    names = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown hardware fields {unknown} (known: {sorted(names)})")
    missing = [f.name for f in dataclasses.fields(Hardware)
               if f.default is dataclasses.MISSING and f.name not in d]
    if missing:
        raise ValueError(f"hardware description lacks {missing}")
    d = {**d, "host_slowdown": tuple(tuple(p) for p in d.get("host_slowdown", ()))}  # JSON lists
    hw = Hardware(**d)
    bad = [f"{k}={getattr(hw, k)}" for k in ("peak_flops", "memory_bytes", "memory_bw", "nvlink_bw",
                                            "internode_bw", "gpus_per_node")
           if not getattr(hw, k) > 0]
    if bad:
        raise ValueError(f"hardware values must be > 0: {', '.join(bad)}")
    return hw


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name (A100-40GB, A100-80GB, H100-80GB, H200-141GB) or a JSON file path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json"):
        with open(name_or_path) as f:
            return hardware_from_dict(json.load(f))
    raise ValueError(f"gpu={name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                     f"nor a .json file")


def save_hardware(hw: Hardware, path: str) -> None:
    with open(path, "w") as f:
        json.dump(hw.to_dict(), f, indent=2)
        f.write("\n")
