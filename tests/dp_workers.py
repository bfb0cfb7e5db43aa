"""Worker functions for the data-parallel tests (run by `launch`, so they live in a module)."""

import contextlib
import time

import torch
import torch.distributed as dist

from mini3d.config import ModelConfig, Plan
from mini3d.data.corpus import Batches, load_tokens
from mini3d.dp import make_dp, model_state_ledger
from mini3d.grid import Grid, build_topology
from mini3d.models.transformer import GPT

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
    with topo.device:  # explicit: workers run with the default device set to meta (strict mode)
        model = GPT(CFG, SEED)
    plan = Plan(dp=topo.dp.size, zero=stage, dtype=dtype, global_batch=GLOBAL_BATCH, seq_len=SEQ,
                bucket_mb=BUCKET_MB)
    net, opt = make_dp(model, topo.dp, plan, optimizer)
    data, log = batches(), topo.log
    out = {"loss": [], "wire": [], "ops": [], "ledger": [], "grads": [], "params_before": [],
           "peak_grad_bytes": [], "max_bucket_grad_bytes": _max_bucket_grad_bytes(net)}
    for step, m in enumerate(MICRO):
        # test aids (collective gathers), kept out of the step's measured bytes: the weights the
        # step starts from, to compute the float32 reference gradient at exactly these weights
        out["params_before"].append({k: v.float() for k, v in net.full_params().items()})
        net.meter.reset()
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
        net.finish_grad_sync()
        w_mid, ops_mid = _wire(log)
        out["grads"].append({k: v.float() for k, v in net.full_grads().items()})
        w_extra = _wire(log)[0] - w_mid  # the gather above is a test aid, not the step's cost
        opt.step()
        out["peak_grad_bytes"].append(net.meter.peak)
        opt.zero_grad()
        out["meter_now"] = net.meter.now
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


def _max_bucket_grad_bytes(net) -> int:
    """Bytes of the largest bucket (ZeRO-3: unit) in the gradient dtype."""
    groups = net.groups if hasattr(net, "groups") else net.buckets
    return max(g.padded for g in groups) * torch.empty(0, dtype=net.grad_dtype,
                                                       device="cpu").element_size()


def dp_parity(dp, runs):
    """One launch: each (zero stage, dtype) in `runs`, one after the other, on the same dp group."""
    topo = build_topology(Grid(dp=dp), dist.get_rank())
    res = {(s, d): train_stage(topo, s, d) for s, d in runs}
    if topo.dp.index != 0:  # only rank 0 ships the (identical) full tensors back
        for r in res.values():
            r.pop("params"), r.pop("grads"), r.pop("params_before")
    return res


def reference(steps=len(MICRO)):
    """Single process, full global batch, same seed: losses, grads of every step, final params."""
    model = GPT(CFG, SEED)
    opt = optimizer(list(model.parameters()))
    data, losses, grads = batches(), [], []
    for step in range(steps):
        x, y = data.global_batch_at(step)
        loss = model(x, y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_grads_at(params: dict, step: int) -> dict:
    """float32 gradient of step `step`'s global-batch loss at the weights `params` (single process)."""
    model = GPT(CFG, SEED)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    x, y = batches().global_batch_at(step)
    model(x, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}
