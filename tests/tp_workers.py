"""Worker functions for tests/test_tp.py (spawned by mini3d.launch, so they live in a module).

Each parity run builds, on every rank, the single-process reference GPT and a tensor-parallel copy of
the same seed, trains both for a few AdamW steps on the same batches, and returns measurements
(differences, comm events); the test file decides what is acceptable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d.config import ModelConfig, Plan
from mini3d.grid import Grid, build_topology
from mini3d.model import GPT
from mini3d.tp import apply_tp, boundary_shape, full_grads, full_state_dict, sync_tp_grads

BATCH, SEQ, STEPS, LR = 2, 16, 3, 1e-3


def _batches(cfg, n, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g),
             torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)) for _ in range(n)]


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
    out["pipeline"] = _pipeline_check(topo, cfg, plan, seed)
    return out


def _pipeline_check(topo, cfg, plan, seed):
    """Two pipeline stages (layer 0 with the embedding; layer 1 with the head), both sharded over the
    same tp axis, chained by hand as the pipeline runtime would: the boundary activation shape,
    the loss and every gradient must match the whole reference model."""
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
    return {"shape_ok": shape_ok, "shape": tuple(h.shape), "loss": (loss.item(), ref_loss.item()),
            "grad": _max_diff(grads, ref, grads=True)}


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
    return {"rank": rank, "results": results}


def tp1_run(cfg_dict: dict) -> dict:
    """tp=1 through the same code path, in this process (a one-member axis needs no process group)."""
    cfg = ModelConfig(**cfg_dict)
    topo = build_topology(Grid(tp=1), 0, make_groups=False)
    return {sp: run_parity(topo, cfg, sp) for sp in (False, True)}
