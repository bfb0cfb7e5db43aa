"""What a layout's processes cost on this shared host, measured now, in those processes.

mini3d's CPU runs put every rank on one host's cores: the 8 ranks of a tp2 x pp2 x dp2 run share 2
cores, and other people's jobs on a shared machine take their share too. The cost model simulates
that sharing (`mini3d.cost.host_share`); this probe measures what the simulation needs, with the
layout's own process count (never extrapolated from fewer), right next to the measured steps
(`benchmarks.train_runs.probe_then_train` runs it in the same processes, before and after them,
so that it sees the same neighbours' load).

The probe unit is the forward + backward of one small mini3d Block (h=64, 4 x 64 tokens, one
thread, like a rank of the tiny model). After a barrier every process times units three ways:

* back to back, every process busy ("unit": the one-process reference, and the busy slowdown
  `Hardware.host_slowdown`, looked up by `Hardware.slowdown(world)`);
* paced as a tp step is, an all-reduce of a tp activation between rank pairs, through mini3d.comm,
  after each forward and each backward: the units' CPU seconds ("paced_cpu", against the
  reference: `Hardware.host_cpu_factor`), and each all-reduce's wall seconds and CPU seconds;
* a two-stage ping-pong of p2p messages between the pairs: CPU seconds per message end, and each
  message's latency from its issue on one rank to its arrival on the other.

`probed_hardware` turns these into the `Hardware` fields the simulation reads.
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
    """On each launched rank, timed after a barrier so that every rank starts at the same time:

    "unit": seconds of each of `repeats` probe units run back to back (every rank busy at once);
    "paced": the compute seconds of `PACED_PER_UNIT * repeats` more units each followed, after the
    forward and after the backward, by an all-reduce of `nbytes` between rank pairs (2i, 2i+1), as
    tp all-reduces follow a layer's compute; "all_reduce": those all-reduces' wall seconds;
    "ar_cpu": this process' CPU seconds (every thread: gloo's too) per all-reduce, beyond the
    units' own; then the pairs play a two-stage pipeline, each unit's forward output sent to the
    partner, which computes its forward and sends back (`repeats` round trips): "msg_cpu": CPU
    seconds per message end (a send or a receive) beyond the units', "sent" / "received": the
    perf_counter times (one clock for the whole host) each message was issued / arrived.
    Pairs only with an even world size greater than 1."""
    import torch.distributed as dist

    from mini3d.config import ModelConfig
    from mini3d.models.transformer import Block

    torch.set_num_threads(1)
    dev = torch.device("cpu")  # explicit: a launched worker's default device may be meta
    torch.manual_seed(0)
    with dev:
        block = Block(ModelConfig(1, 64, 4, 256, 64))
    x = torch.randn(PROBE_BATCH, 64, 64, device=dev, requires_grad=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    pair, buf = None, torch.ones(max(1, nbytes // 4), device=dev)
    if world > 1 and world % 2 == 0:  # the pairs are a tp axis, and talk through mini3d.comm
        from mini3d import comm  # as a step's collectives do (its checks and event log cost CPU too)
        from mini3d.grid import Grid, build_topology

        pair = build_topology(Grid(tp=2, dp=world // 2), rank, dev).axes["tp"]
        comm.all_reduce(buf, pair)  # connect before timing
    block(x).sum().backward()  # first touch: allocations, autograd caches
    if world > 1:
        dist.barrier()
    units = []
    out = {"unit": units, "all_reduce": [], "paced": []}
    for _ in range(repeats):  # every rank busy at once: its share of the cores
        t0 = time.perf_counter()
        block(x).sum().backward()
        units.append(time.perf_counter() - t0)
    if pair is not None:
        out.update(_paced(block, x, buf, pair, PACED_PER_UNIT * repeats))
        out.update(_ping_pong(block, x, pair, rank, repeats))
    return out


class _Compute:
    """Runs compute, adding up the CPU seconds of this (the main) thread in it: the gloo threads'
    work that runs meanwhile belongs to the messages."""

    def __init__(self):
        self.cpu = 0.0

    def __call__(self, fn):
        c = time.thread_time()
        value = fn()
        self.cpu += time.thread_time() - c
        return value


def _paced(block, x, buf, pair, n: int) -> dict:
    """`n` units, each followed after its forward and after its backward by a pair all-reduce of
    `buf`, as tp all-reduces follow a layer's compute."""
    from mini3d import comm

    compute, reduces, paced = _Compute(), [], []

    def exchange():
        t = time.perf_counter()
        comm.all_reduce(buf, pair)
        reduces.append(time.perf_counter() - t)
        return reduces[-1]

    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        loss = compute(lambda: block(x).sum())
        waited = exchange()
        compute(loss.backward)
        paced.append(time.perf_counter() - t0 - waited)
        exchange()
    return {"all_reduce": reduces, "paced": paced,
            "ar_cpu": (time.process_time() - cpu0 - compute.cpu) / len(reduces),
            "paced_cpu": compute.cpu / len(paced)}  # a unit's CPU seconds, run as a step runs it


def _ping_pong(block, x, pair, rank: int, n: int) -> dict:
    """A two-stage pipeline over the pair, `n` round trips started by the even rank: each
    forward's output is sent to the partner, which computes its forward and sends back."""
    from mini3d import comm

    compute, partner, inp = _Compute(), rank ^ 1, x.detach()
    sent, received, pending = [], [], []
    comm.barrier(pair)
    cpu0 = time.process_time()
    for _ in range(n):
        for turn in ((0, 1) if rank % 2 == 0 else (1, 0)):
            if turn == 0:  # compute, then send the output on (kept alive until it is sent)
                act = compute(lambda: block(inp).detach())
                sent.append(time.perf_counter())
                pending.append((comm.send(act, pair, partner, async_op=True), act))
            else:  # wait for the partner's output: the next input
                inp = torch.empty_like(x, requires_grad=False)
                comm.recv(inp, pair, partner, async_op=True).wait()
                received.append(time.perf_counter())
    for work, _ in pending:
        work.wait()
    return {"msg_cpu": (time.process_time() - cpu0 - compute.cpu) / (len(sent) + len(received)),
            "sent": sent, "received": received}


def probe_unit_s(world: int, repeats: int = 20, timeout: float = 120.0) -> dict:
    """Launch `world` processes running the probe and summarise it (`summarise`)."""
    from mini3d.launch.launcher import launch

    return summarise(launch(probe_worker, world, repeats, device="cpu", timeout=timeout))


def summarise(results: list[dict]) -> dict:
    """Every rank's probe in one dict: "mean" busy unit, "best" (fastest) unit, "paced" mean paced
    unit, "all_reduce" median and "all_reduce_mean" of the pair all-reduces, "exchange", "ar_cpu",
    "msg_cpu" and "msg_latency" (None without pairs).

    The exchange is the mean over the pairs' all-reduces of the shorter of the two partners'
    times: the partner that arrived last waited only for the exchange itself, not for the other's
    compute. The message latency is the mean from a send's issue (on one rank) to its arrival (on
    the partner). Means, not medians, for what a step adds up: the exchanges have a heavy tail,
    and an oversubscribed rank's units either run whole or wait out other processes' time
    slices, a two-humped spread whose median can sit on either hump."""
    units = [t for r in results for t in r["unit"]]
    reduces = [t for r in results for t in r["all_reduce"]]
    paced = [t for r in results for t in r.get("paced", ())]
    pairs = [(results[i], results[i + 1]) for i in range(0, len(results) - 1, 2)
             if results[i].get("all_reduce")]
    shorter = [min(a, b) for x, y in pairs for a, b in zip(x["all_reduce"], y["all_reduce"])]
    latency = [got - sent for x, y in pairs for a, b in ((x, y), (y, x))
               for sent, got in zip(a.get("sent", ()), b.get("received", ()))]
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {"mean": statistics.fmean(units), "best": min(units), "paced": mean(paced),
            "all_reduce": statistics.median(reduces) if reduces else None,
            "all_reduce_mean": mean(reduces), "exchange": mean(shorter),
            "ar_cpu": mean([r["ar_cpu"] for r in results if "ar_cpu" in r]),
            "msg_cpu": mean([r["msg_cpu"] for r in results if "msg_cpu" in r]),
            "paced_cpu": mean([r["paced_cpu"] for r in results if "paced_cpu" in r]),
            "msg_latency": mean(latency)}


def probed_hardware(hw, world: int, probe: dict, reference_s: float, nbytes: int = PAIR_BYTES):
    """`hw` as the probe saw this host with `world` processes.

    `host_slowdown` for `world`: the mean busy unit (every process runnable) over `reference_s`,
    the best one-process unit. With pairs, the communication the cost model's shared-host
    simulation charges (`mini3d.cost.host_share.shared_host_step`):

    * `host_step_cpu_s`: the CPU seconds of an all-reduce (less its copies, which the wire
      bandwidth charges) over its 2 ring steps; `host_msg_cpu_s`: per message end;
    * `host_step_wait_s`: per ring step, what an all-reduce waited beyond its CPU: the exchange
      over the sharing (world / cores, at least 1, which the simulation puts back for however many
      processes are runnable at each moment) less its CPU, plus the partners' lateness (the mean
      all-reduce less the exchange, also over the sharing); `host_msg_wait_s` likewise for a
      message's latency;
    * `latency_s`: CPU and wait of a ring step together (for everything else that reads it)."""
    import dataclasses

    from mini3d.comm import ring_steps, ring_wire_bytes

    s = probe["mean"] / reference_s
    hw = dataclasses.replace(hw, host_slowdown=((world, s),))
    if not probe.get("exchange") or probe.get("ar_cpu") is None:
        return hw
    share = max(1.0, world / hw.gpus_per_node)
    steps = ring_steps("all_reduce", 2)
    wire_s = ring_wire_bytes("all_reduce", 2, nbytes) / hw.nvlink_bw
    step_cpu = max(1e-6, (probe["ar_cpu"] - wire_s) / steps)
    late = max(0.0, probe["all_reduce_mean"] - probe["exchange"]) / share
    step_wait = (max(0.0, probe["exchange"] / share - probe["ar_cpu"]) + late) / steps
    msg_cpu = max(1e-6, probe["msg_cpu"])
    msg_wait = max(0.0, probe["msg_latency"] / share - msg_cpu)
    return dataclasses.replace(hw, latency_s=step_cpu + step_wait, host_step_cpu_s=step_cpu,
                               host_step_wait_s=step_wait, host_msg_cpu_s=msg_cpu,
                               host_msg_wait_s=msg_wait,
                               host_cpu_factor=max(1.0, probe["paced_cpu"] / reference_s))


__all__ = ["host_cores", "probe_worker", "probe_unit_s", "summarise", "probed_hardware",
           "PROBE_BATCH", "PAIR_BYTES"]
