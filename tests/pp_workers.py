"""Functions that the pipeline tests run inside launch() workers (importable on purpose)."""

import torch
import torch.distributed as dist

from mini3d.grid import Grid, build_topology
from mini3d.pp.p2p import PipeP2P
from mini3d.pp.partition import build_stages
from mini3d.pp.runtime import PipelineRuntime
from mini3d.pp.schedules import make_schedule


def pipeline_parity(cfg, seed, kinds, m, v, batches, lr):
    """Train 3 AdamW steps with each schedule in `kinds`; return losses, grads, params and peaks."""
    rank = dist.get_rank()
    p = dist.get_world_size()
    topo = build_topology(Grid(pp=p), rank)
    b, T = batches[0][0][0].shape
    out = {}
    for kind in kinds:
        vk = {"interleaved": v, "looped-bfs": v, "zbv": 2}.get(kind, 1)
        sched = make_schedule(kind, p, m, vk)
        stages = build_stages(cfg, seed, topo.pp.index, p, vk, device=topo.device,
                              placement=sched.placement)
        rt = PipelineRuntime(stages, sched, topo, act_shape=(b, T, cfg.d_model))
        named = [(n, q) for s in stages.values() for n, q in s.named_parameters()]
        opt = torch.optim.AdamW([q for _, q in named], lr=lr)
        topo.log.reset_counters()
        first_event = len(topo.log.events)
        losses, grads, peaks, chunks = [], [], [], []
        for step, mbs in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            res = rt.step(mbs, step)
            losses.append(res.loss)
            grads.append({n: q.grad.clone() for n, q in named})
            peaks.append(res.peak_in_flight)
            chunks.append(res.peak_chunks)
            opt.step()
        events = list(topo.log.events)[first_event:]
        p2p = [e for e in events if e.op in ("send", "recv")]
        out[kind] = {
            "losses": losses, "grads": grads, "peaks": peaks, "peak_chunks": chunks,
            "params": {n: q.detach().clone() for n, q in named},
            "n_send": sum(e.op == "send" for e in p2p), "n_recv": sum(e.op == "recv" for e in p2p),
            "want_send": len(batches) * sum(a.op.startswith("SEND") for a in sched.actions[rank]),
            "contexts_ok": all(e.context.get("action", "")[:2] in ("sF", "rF", "sB", "rB")
                               and e.context.get("step") is not None for e in p2p),
            "p2p_bytes": {e.bytes for e in p2p},
        }
    return out


def exchange_both_ways(n):
    """Both pipeline neighbours send a large tensor to each other at the same step."""
    rank = dist.get_rank()
    topo = build_topology(Grid(pp=2), rank)
    link = PipeP2P(topo.pp, (n,), torch.float32)
    mine = torch.arange(n, dtype=torch.float32, device=topo.device) + 1000.0 * rank
    got = link.exchange(mine, 1 - topo.pp.index)
    want = torch.arange(n, dtype=torch.float32, device=topo.device) + 1000.0 * (1 - rank)
    ok_values = bool(torch.equal(got, want))
    order = [e.op for e in topo.log.events if e.axis == "pp"]
    try:
        link.send(torch.zeros(3, device=topo.device), 1 - topo.pp.index)
        shape_error = None
    except ValueError as e:
        shape_error = str(e)
    return {"ok": ok_values, "order": order, "shape_error": shape_error}


def blocking_sends_and_exchange(n, cfg, m, b, T):
    """`exchange` both ways at once, then the runtime with blocking and non-blocking sends."""
    out = exchange_both_ways(n)
    rank = dist.get_rank()
    topo = build_topology(Grid(pp=2), rank)  # fresh groups: new_group is collective, both call it
    g = torch.Generator(device="cpu").manual_seed(5)
    mbs = [tuple(torch.randint(0, cfg.vocab_size, (b, T), generator=g, device="cpu")
                 for _ in range(2)) for _ in range(m)]
    for kind in ("gpipe", "1f1b"):
        for async_send in (False, True):
            stages = build_stages(cfg, 0, topo.pp.index, 2, device=topo.device)
            rt = PipelineRuntime(stages, make_schedule(kind, 2, m), topo, (b, T, cfg.d_model),
                                 async_send=async_send)
            res = rt.step(mbs)
            grads = [q.grad.clone() for s in stages.values() for q in s.parameters()]
            out[(kind, async_send)] = (res.loss, grads)
    return out
