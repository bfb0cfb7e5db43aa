"""Chapter 10 (mixture of experts): the numbers its cells show, each from mini3d's own engines.

    why_experts(moe, dense)        parameters, active parameters and forward matmul FLOPs per
                                   token of two presets (ModelConfig.n_params / active_params)
    routing_runs(coefs, ...)       real `mini3d train --dp 2 --ep 2` runs on CPU, one per aux-loss
                                   coefficient, started together as subprocesses (in the
                                   background by start_routing_runs): their --log-jsonl records
                                   (tokens per expert per step), cached
    capacity_rows(factors, ...)    one MoE layer (mini3d.models.moe) on one fixed batch: the
                                   capacity and the dropped token-slots per capacity factor
    balanced_kept(cfg, tokens)     the share of token-slots a capacity factor keeps when routing
                                   is perfectly balanced (mini3d.models.moe.capacity)
    a2a_rows(cfg, eps, top_ks)     bytes one rank sends per all-to-all and per step
                                   (mini3d.cost.moe: the one owner of that formula)
    ep_vs_tp(cfg, gpus)            parameters and model-state bytes per GPU, and bytes sent per
                                   step, of ep against tp on one node (mini3d.cost.memory,
                                   mini3d.cost.model, mini3d.cost.moe)
    kv_cache_rows(cfg, seq_len)    KV-cache bytes per token and per sequence of full heads, GQA
                                   and MLA's latent (mini3d.cost.kv_cache)
    routing_reach(cfg)             nodes a token reaches with and without node-limited routing,
                                   and the inter-node rows and bytes (mini3d.cost.moe)

The live runs go through the command line, as a learner would type it, so whatever `--ep` does
in the engine (today: dp with the experts replicated, the same numbers by parity) is what the
chapter shows. Nothing here runs in a notebook cell's worker processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile

FWD_FLOPS_PER_PARAM = 2  # one multiply and one add per weight a token passes through


def moe_layer_count(cfg) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


def why_experts(moe_cfg, dense_cfg) -> dict:
    """{name: {params, active_params, fwd_flops_per_token}} for the two models; FLOPs are the
    weight matmuls only (2 per active parameter; attention's scores are left out: they do not
    depend on the experts)."""
    out = {}
    for cfg in (moe_cfg, dense_cfg):
        active = cfg.active_params()
        out[cfg.name] = dict(params=cfg.n_params(), active_params=active,
                             fwd_flops_per_token=FWD_FLOPS_PER_PARAM * active)
    return out


# ---------------------------------------------------------------- live routing runs

ROUTING_RUN = dict(dp=2, ep=2, experts=4, top_k=2, layers=2, steps=12, lr=0.003, seed=0)
_runs: dict = {}


def routing_command(aux_loss_coef: float, log_jsonl: str, **kw) -> list[str]:
    """The `mini3d train` command line of one routing run (ROUTING_RUN's flags, `kw` overriding)."""
    o = dict(ROUTING_RUN, **kw)
    return [sys.executable, "-m", "mini3d", "train", "--dp", str(o["dp"]), "--ep", str(o["ep"]),
            "--experts", str(o["experts"]), "--top-k", str(o["top_k"]), "--layers", str(o["layers"]),
            "--steps", str(o["steps"]), "--lr", str(o["lr"]), "--seed", str(o["seed"]),
            "--aux-loss-coef", str(aux_loss_coef), "--log-jsonl", log_jsonl]


def _env() -> dict:
    """This process's environment with the checkout mini3d came from first on PYTHONPATH (so the
    workers run the same code) and one thread per process (several runs share the cores)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


_pending: dict = {}


def _key(coef: float, kw: dict):
    return (float(coef), tuple(sorted(kw.items())))


def start_routing_runs(coefs=(0.0, 0.1), **kw):
    """Start the `mini3d train` runs of `routing_runs` in the background (those not already done
    or running), so a chapter can do other work while they train."""
    for c in coefs:
        key = _key(c, kw)
        if key in _runs or key in _pending:
            continue
        tmp = tempfile.mkdtemp(prefix="mini3d-moe-")
        path = os.path.join(tmp, "records.jsonl")
        proc = subprocess.Popen(routing_command(c, path, **kw), cwd=tmp, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _pending[key] = (tmp, path, proc)


def routing_runs(coefs=(0.0, 0.1), timeout: float = 600, **kw) -> dict:
    """{coef: [one record per step]} of `mini3d train` runs (ROUTING_RUN, `kw` overriding), all
    running at once (started here unless `start_routing_runs` did); each record has
    `expert_load` (tokens per expert, summed over the MoE layers and the dp ranks), its min / max /
    cv and `dropped_tokens`. Cached per (coef, flags) for the session. A run that fails raises
    RuntimeError with the end of its output."""
    start_routing_runs(coefs, **kw)
    for c in coefs:
        key = _key(c, kw)
        if key in _runs:
            continue
        tmp, path, proc = _pending.pop(key)
        try:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise RuntimeError(f"the run with --aux-loss-coef {c} took over {timeout} s")
            if proc.returncode != 0:
                raise RuntimeError(f"the run with --aux-loss-coef {c} failed (exit "
                                   f"{proc.returncode}):\n{out[-2000:]}")
            with open(path) as f:
                _runs[key] = [json.loads(line) for line in f]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {c: _runs[_key(c, kw)] for c in coefs}


def busiest_share(record: dict) -> float:
    """The busiest expert's share of the step's token-slots (1 / E when perfectly balanced)."""
    load = record["expert_load"]
    return max(load) / sum(load)


def late_share(records: list[dict], last: int = 6) -> float:
    """`busiest_share` averaged over the run's `last` steps (one step's routing is noisy)."""
    tail = records[-last:]
    return sum(busiest_share(r) for r in tail) / len(tail)


# ---------------------------------------------------------------- capacity factor


def _layer(cfg, seed: int):
    import torch

    from mini3d.models.moe import MoE
    from mini3d.models.transformer import ACTIVATIONS, MLP

    torch.manual_seed(seed)
    return MoE(cfg, ACTIVATIONS[cfg.activation], MLP)


def capacity_cfg(n_experts: int = 8, top_k: int = 2, d_model: int = 32):
    from mini3d.models.config import ModelConfig

    return ModelConfig(n_layers=1, d_model=d_model, n_heads=2, vocab_size=64, max_seq_len=64,
                       d_ff=2 * d_model, family="llama", n_experts=n_experts, top_k=top_k,
                       name="moe-capacity")


def capacity_rows(factors=(0.0, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0), tokens: int = 512,
                  skew: float = 1.0, seed: int = 0, cfg=None) -> list[dict]:
    """One MoE layer with fixed weights on one fixed batch of `tokens` tokens, for each capacity
    factor C: the capacity (mini3d.models.moe.capacity), the token-slots each expert was picked
    for, and the dropped slots the layer reports. `skew` shifts every token along one direction,
    so the router favours some experts (real routers are never balanced)."""
    import torch

    cfg = cfg or capacity_cfg()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, cfg.d_model, generator=g)
    x = x + skew * torch.randn(cfg.d_model, generator=g)
    rows = []
    with torch.no_grad():
        for c in factors:
            layer = _layer(dataclasses.replace(cfg, capacity_factor=float(c)), seed)
            layer(x)
            from mini3d.models.moe import capacity

            s = layer.stats
            rows.append(dict(capacity_factor=float(c), capacity=capacity(layer.cfg, tokens),
                             selected=s["selected"].tolist(), dropped=int(s["dropped"]),
                             slots=tokens * cfg.top_k))
    return rows


def balanced_kept(cfg, tokens: int) -> float:
    """The share of token-slots kept when every expert is picked equally often, under cfg's
    capacity factor (1.0 when dropless)."""
    from mini3d.models.moe import capacity

    cap = capacity(cfg, tokens)
    share = tokens * cfg.top_k / cfg.n_experts
    return 1.0 if not cap else min(cap, share) / share


# ---------------------------------------------------------------- all-to-all volume


def a2a_rows(cfg, eps=(1, 2, 4, 8), top_ks=None, tokens: int = 4096, element_bytes: int = 2,
             kept: float = 1.0) -> list[dict]:
    """For each (top_k, ep): bytes one rank sends in one all-to-all and in one step (its `tokens`
    local tokens through every MoE layer, forward and backward), by mini3d.cost.moe."""
    from mini3d.cost.moe import a2a_bytes, a2a_bytes_per_micro_batch

    rows = []
    for k in top_ks or (cfg.top_k,):
        for ep in eps:
            rows.append(dict(top_k=k, ep=ep,
                             one=a2a_bytes(tokens, cfg.d_model, k, ep, element_bytes, kept),
                             step=a2a_bytes_per_micro_batch(tokens, cfg.d_model, k, ep, element_bytes,
                                                            moe_layer_count(cfg), kept)))
    return rows


# ---------------------------------------------------------------- ep against tp


def expert_params(cfg) -> int:
    """Routed-expert parameters of the whole model (what ep splits)."""
    return moe_layer_count(cfg) * cfg.moe_params()["experts"]


def ep_vs_tp(cfg, gpus: int = 8, seq_len: int = 4096, dtype: str = "bf16", gpu: str = "A100-80GB") -> dict:
    """One node of `gpus` GPUs, one sequence of `seq_len` tokens per GPU-group per step:
    {"tp": row, "ep": row}, each with the parameters on one GPU, their model-state bytes (params,
    grads, optimizer; no ZeRO), the bytes one GPU sends per step in the layers (`sent`; tp: the
    estimator's tp term; ep: its ep term, the all-to-alls of mini3d.cost.moe) and in the gradient
    sync (`grad_sync`, the estimator's dp term). tp=gpus splits every dense matrix but keeps each
    routed expert whole on every tp rank (mini3d's tp, like Megatron-Core's default expert-tp of
    1); ep=gpus (dp=gpus) splits only the routed experts and keeps the dense weights whole. The
    global batch is `gpus` sequences either way (tp: all of them through every GPU; ep: one per
    GPU)."""
    from mini3d.config import Plan
    from mini3d.cost.hardware import load_hardware
    from mini3d.cost.memory import estimate_memory, state_bytes
    from mini3d.cost.model import estimate_cost

    hw = load_hardware(gpu)
    common = dict(dtype=dtype, global_batch=gpus, seq_len=seq_len)
    per_param = sum(state_bytes(dtype))
    rows = {}
    for name, plan, what in (("tp", Plan(tp=gpus, sequence_parallel=True, **common), "all-reduce"),
                             ("ep", Plan(dp=gpus, ep=gpus, **common), "all-to-all")):
        states = estimate_memory(cfg, plan).model_states
        sent = estimate_cost(cfg, plan, hw).comm_bytes
        rows[name] = dict(plan=plan, params=states / per_param, model_states=states,
                          sent=float(sent[name]), grad_sync=float(sent["dp"]), what=what)
    return rows


# ---------------------------------------------------------------- DeepSeek-V3: MLA's cache, node-limited routing


def kv_cache_rows(cfg, seq_len: int, kv_heads: int = 8, element_bytes: int = 2) -> list[dict]:
    """Full heads, GQA with `kv_heads` groups and MLA's latent, each with cfg's head widths: the
    numbers one token adds to one layer's cache (`per_layer`), its bytes over all layers
    (`per_token`) and one sequence of `seq_len` tokens (`sequence`), by mini3d.cost.kv_cache."""
    from mini3d.cost.kv_cache import kv_cache_bytes, kv_cache_elements

    labels = {"full": f"full heads ({cfg.n_heads})", "gqa": f"GQA ({kv_heads} groups)", "mla": "MLA latent"}
    return [dict(kind=k, label=label, per_layer=kv_cache_elements(cfg, k, kv_heads),
                 per_token=kv_cache_bytes(cfg, 1, element_bytes, k, kv_heads),
                 sequence=kv_cache_bytes(cfg, seq_len, element_bytes, k, kv_heads))
            for k, label in labels.items()]


def routing_reach(cfg, tokens: int = 4096, element_bytes: int = 2) -> dict:
    """cfg's experts in route_groups groups, one node each: per token, the nodes its top_k reach and
    the rows that cross to other nodes in one all-to-all, with `bytes` for `tokens` tokens
    (mini3d.cost.moe): "every slot" sends each remote token-slot on its own; "per node" sends a
    token once to each remote node it uses (forwarded inside the node), without the group limit;
    "per node, limited" also keeps each token within route_topk_groups groups (node-limited routing)."""
    from mini3d.cost.moe import internode_bytes, nodes_reached

    nodes, E, k = cfg.route_groups, cfg.n_experts, cfg.top_k
    free = nodes_reached(E, k, nodes)
    limited = nodes_reached(E, k, nodes, nodes, cfg.route_topk_groups)
    out = {}
    for name, reach, rows in (("every slot", free, k * (nodes - 1) / nodes), ("per node", free, free["remote"]),
                              ("per node, limited", limited, limited["remote"])):
        out[name] = dict(nodes=reach["mean"], max=reach["max"], rows=rows,
                         bytes=internode_bytes(tokens, cfg.d_model, element_bytes, rows))
    return out


__all__ = ["FWD_FLOPS_PER_PARAM", "kv_cache_rows", "routing_reach", "ROUTING_RUN", "a2a_rows", "balanced_kept", "busiest_share", "late_share",
           "capacity_cfg", "capacity_rows", "ep_vs_tp", "expert_params", "moe_layer_count",
           "routing_command", "routing_runs", "start_routing_runs", "why_experts"]
