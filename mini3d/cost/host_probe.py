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
PACED_PER_UNIT = 2  # paced units per busy one: their all-reduces' mean needs many (a heavy tail)


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
    for _ in range(PACED_PER_UNIT * repeats if pair is not None else 0):  # as a tp step has them
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
    """{"mean": s, "best": s, "paced": s or None, "all_reduce": s or None, "exchange": s or None}
    over every rank's probe: the mean busy unit, the fastest unit, the mean paced unit, the
    median pair all-reduce, and the exchange: the mean over the pairs' all-reduces of the
    shorter of the two partners' times. The partner that arrived last waited only for the
    exchange itself, not for the other's compute (that skew is the processor sharing the cost
    model simulates); a mean, because the exchanges' heavy tail is part of what a step pays.
    Means of the units too, not medians: an oversubscribed rank's units either run whole or
    wait out other processes' time slices, a two-humped spread whose median can sit on either
    hump, while the mean is the rank's share of the cores."""
    units = [t for r in results for t in r["unit"]]
    reduces = [t for r in results for t in r["all_reduce"]]
    paced = [t for r in results for t in r.get("paced", ())]
    shorter = [min(a, b) for i in range(0, len(results) - 1, 2)
               for a, b in zip(results[i]["all_reduce"], results[i + 1]["all_reduce"])]
    return {"mean": statistics.fmean(units), "best": min(units),
            "paced": statistics.fmean(paced) if paced else None,
            "all_reduce": statistics.median(reduces) if reduces else None,
            "exchange": statistics.fmean(shorter) if shorter else None}


def probed_hardware(hw, world: int, probe: dict, reference_s: float, nbytes: int = PAIR_BYTES):
    """`hw` as the probe saw this host with `world` processes: `host_slowdown` for `world` (the
    mean busy unit, every process runnable, over `reference_s`, the best one-process unit) and,
    with pairs, the alone-speed `latency_s` of one ring step: the probe's exchange, measured
    while `world` processes shared `hw.gpus_per_node` cores, divided by that sharing (world /
    cores, at least 1: the cost model's processor sharing puts it back for however many are
    runnable at each moment of a step), less the wire time, over the all-reduce's 2 ring steps."""
    import dataclasses

    from ..comm import ring_steps, ring_wire_bytes

    s = probe["mean"] / reference_s
    hw = dataclasses.replace(hw, host_slowdown=((world, s),))
    exchange = probe.get("exchange")
    if exchange:
        share = max(1.0, world / hw.gpus_per_node)
        wire_s = ring_wire_bytes("all_reduce", 2, nbytes) / hw.nvlink_bw
        latency = (exchange / share - wire_s) / ring_steps("all_reduce", 2)
        hw = dataclasses.replace(hw, latency_s=max(1e-6, latency))
    return hw


__all__ = ["host_cores", "probe_worker", "probe_unit_s", "summarise", "probed_hardware",
           "PROBE_BATCH", "PAIR_BYTES"]
