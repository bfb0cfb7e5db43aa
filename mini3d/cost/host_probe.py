"""How much slower one rank computes when a layout's processes share this host, measured now.

mini3d's CPU runs put every rank on one host's cores: 8 ranks of a tp2 x pp2 x dp2 run on 2 cores
each get about a quarter of a core, and other people's jobs on a shared machine take their share
too. Dividing the world size by the core count misses both the external load and what the
operating system really gives 8 busy processes, so the cost model reads a measured factor instead
(`Hardware.host_slowdown`, looked up by `Hardware.slowdown(world)`):

    slowdown(world) = mean seconds of one probe unit with `world` processes running it at once
                      / best seconds of the same unit on one process (the reference)

The probe unit is the forward + backward of one small mini3d Block (h=64, 4 x 64 tokens, one
thread, like a rank of the tiny model). `world` processes (the layout's own count, never
extrapolated from fewer) meet at a barrier and time units two ways: back to back, every rank busy
("unit", the one-process reference and slowdown), then paced as a training rank is, with an
all-reduce of a tp activation between rank pairs after the forward and after the backward
("paced": the unit's compute time without the waits; "all_reduce": the waits). A training rank
blocks on its partners as the paced probe does, and gives the cores to the others while it waits,
so with pairs the paced units are the slowdown (8 busy ranks on 2 cores overstate what 8 training
ranks see by about two), and the median all-reduce gives `latency_s`. Run it right next to the measured steps
(`benchmarks.train_runs.probe_then_train` runs it in the same processes, before and after them),
so that it sees the same neighbours' load.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

PROBE_BATCH = 4  # micro-batch of the probe unit: PROBE_BATCH x 64 tokens
PAIR_BYTES = PROBE_BATCH * 64 * 64 * 4  # its activation in float32: a tp all-reduce's payload


def host_cores() -> int:
    """Cores this process may run on (its affinity: `taskset -c 0` gives 1), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def probe_worker(repeats: int, nbytes: int = PAIR_BYTES) -> dict:
    """On each launched rank: {"unit": seconds of each of `repeats` probe units run back to back
    (every rank busy at once), "paced": the compute seconds of `repeats` / 2 more units each
    followed, after the forward and after the backward, by an all-reduce of `nbytes` between rank
    pairs (2i, 2i+1), as tp all-reduces follow a layer's compute, "all_reduce": those
    all-reduces' seconds}, timed after a barrier so that every rank starts at the same time.
    Pairs only with an even world size greater than 1."""
    import torch.distributed as dist

    from ..config import ModelConfig
    from ..model import Block

    torch.set_num_threads(1)
    dev = torch.device("cpu")  # explicit: a launched worker's default device may be meta
    torch.manual_seed(0)
    with dev:
        block = Block(ModelConfig(1, 64, 4, 256, 64))
    x = torch.randn(PROBE_BATCH, 64, 64, device=dev, requires_grad=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    pair, buf = None, torch.ones(max(1, nbytes // 4), device=dev)
    if world > 1 and world % 2 == 0:
        groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        pair = groups[dist.get_rank() // 2]
        dist.all_reduce(buf, group=pair)  # connect before timing
    block(x).sum().backward()  # first touch: allocations, autograd caches
    if world > 1:
        dist.barrier()
    units, reduces, paced = [], [], []

    def exchange():  # the pair all-reduce that follows a forward and a backward
        t = time.perf_counter()
        dist.all_reduce(buf, group=pair)
        reduces.append(time.perf_counter() - t)
        return reduces[-1]

    for _ in range(repeats):  # every rank busy at once: its share of the cores
        t0 = time.perf_counter()
        block(x).sum().backward()
        units.append(time.perf_counter() - t0)
    for _ in range(repeats // 2 if pair is not None else 0):  # all-reduces as a tp step has them
        t0 = time.perf_counter()
        out = block(x).sum()
        waited = exchange()
        out.backward()
        paced.append(time.perf_counter() - t0 - waited)
        exchange()
    return {"unit": units, "all_reduce": reduces, "paced": paced}


def probe_unit_s(world: int, repeats: int = 20, timeout: float = 120.0) -> dict:
    """Launch `world` processes running the probe and summarise it (`summarise`)."""
    from ..launch import launch

    return summarise(launch(probe_worker, world, repeats, device="cpu", timeout=timeout))


def summarise(results: list[dict]) -> dict:
    """{"mean": s, "best": s, "paced": s or None, "all_reduce": s or None} over every rank's
    probe: the mean busy unit, the fastest unit, the mean paced unit and the median pair
    all-reduce (a typical one: the few that wait out a whole time slice of the partner are
    the paced units' share of the cores, already in the slowdown). Means, not medians: an oversubscribed rank's
    units either run whole or wait out other processes' time slices, a two-humped spread whose
    median can sit on either hump, while the mean is the rank's share of the cores."""
    units = [t for r in results for t in r["unit"]]
    reduces = [t for r in results for t in r["all_reduce"]]
    paced = [t for r in results for t in r.get("paced", ())]
    return {"mean": statistics.fmean(units), "best": min(units),
            "paced": statistics.fmean(paced) if paced else None,
            "all_reduce": statistics.median(reduces) if reduces else None}


def probed_hardware(hw, world: int, probe: dict, reference_s: float, nbytes: int = PAIR_BYTES):
    """`hw` as the probe saw this host with `world` processes: `host_slowdown` for `world` (the
    mean paced unit, the busy unit when there were no pairs, over `reference_s`, the best
    one-process unit) and, with pairs, the `latency_s` that makes `Hardware.collective_s` of the
    probe's all-reduce, times that slowdown (the cost model's rule for CPU communication), equal
    to its median all-reduce: the in-step cost with this many processes, now."""
    import dataclasses

    from ..comm import ring_steps, ring_wire_bytes

    s = (probe.get("paced") or probe["mean"]) / reference_s
    hw = dataclasses.replace(hw, host_slowdown=((world, s),))
    if probe.get("all_reduce"):
        wire_s = ring_wire_bytes("all_reduce", 2, nbytes) / hw.nvlink_bw
        latency = (probe["all_reduce"] / s - wire_s) / ring_steps("all_reduce", 2)
        hw = dataclasses.replace(hw, latency_s=max(1e-6, latency))
    return hw


__all__ = ["host_cores", "probe_worker", "probe_unit_s", "summarise", "probed_hardware",
           "PROBE_BATCH", "PAIR_BYTES"]
