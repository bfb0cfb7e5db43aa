"""Worker functions for the data-parallel tests (run by `launch`, so they live in a module)."""

import contextlib
import time

import torch
import torch.distributed as dist

from mini3d.config import ModelConfig, Plan
from mini3d.data import Batches, load_tokens
from mini3d.dp import make_dp, model_state_ledger
from mini3d.grid import Grid, build_topology
from mini3d.model import GPT

# d_model=18: a block holds 4122 parameters, not a multiple of 4, so dp=4 shards need padding
CFG = ModelConfig(n_layers=2, d_model=18, n_heads=3, vocab_size=64, max_seq_len=16, name="dp-test")
SEQ, GLOBAL_BATCH, SEED = 16, 8, 7
MICRO = (2, 2, 2, 1)  # micro-batches per step: three accumulating steps, then one plain step
BUCKET_MB = 0.01  # ~10 KiB buckets: several buckets, so overlap and ordering are exercised


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def batches():
    return Batches(load_tokens() % CFG.vocab_size, SEQ, GLOBAL_BATCH, seed=SEED)


def _wire(log):
    return log.wire_bytes_by_axis["dp"], dict(log.count_by_axis_op)


def train_stage(topo, stage, dtype):
    """Run len(MICRO) steps; return what the tests compare (losses, grads, params, bytes, log)."""
    model = GPT(CFG, SEED)
    plan = Plan(dp=topo.dp.size, zero=stage, dtype=dtype, global_batch=GLOBAL_BATCH, seq_len=SEQ,
                bucket_mb=BUCKET_MB)
    net, opt = make_dp(model, topo.dp, plan, optimizer)
    data, log = batches(), topo.log
    out = {"loss": [], "wire": [], "ops": [], "ledger": []}
    for step, m in enumerate(MICRO):
        w0, ops0 = _wire(log)
        first_event = len(log.events)
        mbs = data.micro_batches(step, topo.dp.index, topo.dp.size, m)
        total = 0.0
        for i, (x, y) in enumerate(mbs):
            ctx = net.no_sync() if i < m - 1 else contextlib.nullcontext()
            with ctx:
                loss = net(x, y) / m
                loss.backward()
            total += float(loss.detach())
        backward_end = net.last_hook_time if hasattr(net, "last_hook_time") else time.perf_counter()
        step_events = list(log.events)[first_event:]
        if step == 0:
            net.finish_grad_sync()
            w_mid, ops_mid = _wire(log)
            out["grads"] = {k: v.float() for k, v in net.full_grads().items()}
            w_extra = _wire(log)[0] - w_mid  # the gather above is a test aid, not the step's cost
        else:
            w_extra = 0
        opt.step()
        opt.zero_grad()
        w1, ops1 = _wire(log)
        out["loss"].append(total)
        out["wire"].append(w1 - w0 - w_extra)
        out["ops"].append({f"{a}:{o}": ops1[(a, o)] - ops0.get((a, o), 0) for a, o in ops1})
        out["ledger"].append(model_state_ledger(net, opt))
        if step == 0:
            ar = [e for e in step_events if e.axis == "dp" and e.op in ("all_reduce",
                                                                        "reduce_scatter")]
            out["first_sync_start"] = ar[0].start if ar else None
            out["backward_end"] = backward_end
    out["params"] = {k: v.float() for k, v in net.full_params().items()}
    groups = net.groups if stage == 3 else net.buckets
    out["layout"] = [(g.numel, g.padded) for g in groups]
    out["n_params"] = sum(p.numel() for p in model.parameters())
    return out


def dp_parity(dp, runs):
    """One launch: each (zero stage, dtype) in `runs`, one after the other, on the same dp group."""
    topo = build_topology(Grid(dp=dp), dist.get_rank())
    res = {(s, d): train_stage(topo, s, d) for s, d in runs}
    if topo.dp.index != 0:  # only rank 0 ships the (identical) full tensors back
        for r in res.values():
            r.pop("params"), r.pop("grads")
    return res


def reference(steps=len(MICRO)):
    """Single process, full global batch, same seed: losses, step-0 grads, final params."""
    model = GPT(CFG, SEED)
    opt = optimizer(list(model.parameters()))
    data, losses, grads = batches(), [], None
    for step in range(steps):
        x, y = data.global_batch_at(step)
        loss = model(x, y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}
