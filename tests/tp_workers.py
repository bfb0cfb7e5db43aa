"""Worker functions for tests/test_tp.py (spawned by mini3d.launch.launcher, so they live in a module).

Each parity run builds, on every rank, the single-process reference GPT and a tensor-parallel copy of
the same seed, trains both for a few AdamW steps on the same batches, and returns measurements
(differences, comm events); the test file decides what is acceptable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d.config import ModelConfig, Plan
from mini3d.grid import Grid, build_topology
from mini3d.models.transformer import GPT
from mini3d.tp import mappings as M
from mini3d.tp import (apply_tp, boundary_shape, full_grads, full_state_dict, gather_logits,
                       load_full_state_dict, sync_tp_grads)

BATCH, SEQ, STEPS, LR = 2, 16, 3, 1e-3


def _batches(cfg, n, seed=1234):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g, device="cpu"),
             torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g, device="cpu"))
            for _ in range(n)]


def _max_diff(full: dict, ref_model, grads: bool) -> dict[str, float]:
    """Per parameter: max |tp - ref|, and the max |ref| (for relative judgement)."""
    out = {}
    for name, p in ref_model.named_parameters():
        r = p.grad if grads else p.detach()
        out[name] = (float((full[name] - r).abs().max()), float(r.abs().max()))
    return out


def _tp_events(log, run, step):
    """(phase, op, bytes, wire_bytes) of the tp-axis events of one run's step."""
    return [(e["context"]["phase"], e["op"], e["bytes"], e["wire_bytes"]) for e in log.snapshot()
            if e["axis"] == "tp" and e["context"].get("run") == run
            and e["context"].get("step") == step]


def run_parity(topo, cfg: ModelConfig, sp: bool, seed: int = 0) -> dict:
    """Reference vs tensor-parallel GPT over STEPS AdamW steps; returns differences and events."""
    plan = Plan(tp=topo.tp.size, seq_len=SEQ, global_batch=BATCH, sequence_parallel=sp)
    with topo.device:  # explicit: workers run with the default device set to meta (strict mode)
        ref, model = GPT(cfg, seed), GPT(cfg, seed)
    apply_tp(model, topo, plan)
    log, run = topo.log, f"tp{topo.tp.size}-sp{int(sp)}"  # several runs share one topology's log
    log.context = {"run": run, "step": -1, "phase": "check"}
    start = full_state_dict(model, topo)
    bit_equal = all(torch.equal(start[n], p) for n, p in ref.named_parameters())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = {"bit_equal_start": bit_equal, "keys_match": sorted(start) == sorted(
        n for n, _ in ref.named_parameters()), "loss": [], "grad": [], "param": []}
    for step, (x, y) in enumerate(_batches(cfg, STEPS)):
        log.context = {"run": run, "step": step, "phase": "fwd"}
        loss = model(x, y)
        log.context = {"run": run, "step": step, "phase": "bwd"}
        loss.backward()
        log.context = {"run": run, "step": step, "phase": "sync"}
        sync_tp_grads(model, topo)
        log.context = {"run": run, "step": step, "phase": "check"}
        ref_loss = ref(x, y)
        ref_loss.backward()
        out["loss"].append((loss.item(), ref_loss.item()))
        out["grad"].append(_max_diff(full_grads(model, topo), ref, grads=True))
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        out["param"].append(_max_diff(full_state_dict(model, topo), ref, grads=False))
    out["events"] = _tp_events(log, run, 0)
    # checkpoint round trip: a differently seeded sharded model loads the trained full weights
    with topo.device:
        other = apply_tp(GPT(cfg, seed + 1), topo, plan)
    load_full_state_dict(other, topo, {n: p.detach() for n, p in ref.named_parameters()})
    back = full_state_dict(other, topo)
    out["reload_exact"] = all(torch.equal(back[n], p) for n, p in ref.named_parameters())
    out["pipeline"] = _pipeline_check(topo, cfg, plan, seed)
    return out


def _pipeline_check(topo, cfg, plan, seed):
    """Two pipeline stages (layer 0 with the embedding; layer 1 with the head), both sharded over the
    same tp axis, chained by hand as the pipeline runtime would: the boundary activation shape,
    the loss and every gradient must match the whole reference model."""
    with topo.device:
        ref = GPT(cfg, seed)
        s0 = apply_tp(GPT(cfg, seed, layers=[0], first=True, last=False), topo, plan)
        s1 = apply_tp(GPT(cfg, seed, layers=[1], first=False, last=True), topo, plan)
    x, y = _batches(cfg, 1, seed=99)[0]
    h = s0(x)
    shape_ok = tuple(h.shape) == boundary_shape(plan, BATCH, cfg)
    h_in = h.detach().requires_grad_()  # what the next stage would receive
    loss = s1(h_in, y)
    loss.backward()
    h.backward(h_in.grad)  # the gradient the next stage would send back
    sync_tp_grads(s0, topo), sync_tp_grads(s1, topo)
    ref_loss = ref(x, y)
    ref_loss.backward()
    grads = {**full_grads(s0, topo), **full_grads(s1, topo)}
    with torch.no_grad():  # logits without targets: this rank's vocab shard, gathered on request
        logits = gather_logits(s1(s0(x)), topo, cfg.vocab_size)
        logits_diff = float((logits - ref(x)).abs().max())
    return {"shape_ok": shape_ok, "shape": tuple(h.shape), "loss": (loss.item(), ref_loss.item()),
            "grad": _max_diff(grads, ref, grads=True), "logits_diff": logits_diff}


def mapping_checks(axis) -> dict[str, tuple[float, float]]:
    """Every public mapping against its definition: (forward error, backward error) per op.
    Inputs and upstream gradients are scaled by (tp_rank + 1) so sums and placements are visible."""
    g = torch.Generator(device="cpu").manual_seed(7)
    X, G = (torch.randn(2, 8, 8, generator=g, device="cpu") for _ in range(2))
    t, i = axis.size, axis.index
    k = float(i + 1)
    s = float(sum(range(1, t + 1)))  # sum over ranks of (rank + 1)
    last = lambda T: T.chunk(t, -1)  # noqa: E731
    seq = lambda T: T.chunk(t, 1)  # noqa: E731
    scaled = lambda parts: [p * (r + 1) for r, p in enumerate(parts)]  # noqa: E731
    cases = {  # op: (input, expected output, upstream grad, expected input grad)
        "copy_to_tp": (M.copy_to_tp, X * k, X * k, G * k, G * s),
        "reduce_from_tp": (M.reduce_from_tp, X * k, X * s, G * k, G * k),
        "scatter_to_tp": (M.scatter_to_tp, X, last(X)[i], last(G)[i] * k,
                          torch.cat(scaled(last(G)), -1)),
        "gather_from_tp": (M.gather_from_tp, last(X)[i], X, G * k, last(G)[i] * k),
        "gather_from_sequence": (M.gather_from_sequence, seq(X)[i], X, G * k, seq(G)[i] * s),
        "reduce_scatter_to_sequence": (M.reduce_scatter_to_sequence, X * k, seq(X)[i] * s,
                                       seq(G)[i] * k, torch.cat(scaled(seq(G)), 1)),
        "scatter_to_sequence": (M.scatter_to_sequence, X, seq(X)[i], seq(G)[i] * k,
                                torch.cat(scaled(seq(G)), 1)),
    }
    out = {}
    for name, (fn, x, y_exp, up, gx_exp) in cases.items():
        x = x.clone().requires_grad_()
        y = fn(x, axis)
        y.backward(up)
        out[name] = (float((y - y_exp).abs().max()), float((x.grad - gx_exp).abs().max()))
    return out


def tp_job(cfg_dict: dict) -> dict:
    """On 4 ranks: tp=2 (two groups, Grid tp=2 x dp=2) and tp=4, each without and with sequence
    parallelism. Returns {(tp, sp): measurements}."""
    cfg = ModelConfig(**cfg_dict)
    rank = dist.get_rank()
    topos = {2: build_topology(Grid(tp=2, dp=2), rank), 4: build_topology(Grid(tp=4), rank)}
    results = {}
    for tp, topo in topos.items():
        for sp in (False, True):
            results[(tp, sp)] = run_parity(topo, cfg, sp)
    return {"rank": rank, "results": results, "mappings": {tp: mapping_checks(topo.tp)
                                                            for tp, topo in topos.items()}}


def tp1_run(cfg_dict: dict) -> dict:
    """tp=1 through the same code path, in this process (a one-member axis needs no process group)."""
    cfg = ModelConfig(**cfg_dict)
    topo = build_topology(Grid(tp=1), 0, make_groups=False)
    return {sp: run_parity(topo, cfg, sp) for sp in (False, True)}
