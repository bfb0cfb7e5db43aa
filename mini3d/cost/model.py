"""Analytic step-time model of a GPT under a Plan on a cluster of identical accelerators.

FLOPs per token, model and hardware FLOPs: `mini3d.cost.flops` (the convention: `FLOPS_CONVENTION`).

Step time, on the busiest pipeline rank:

* compute: FLOPs / (peak * efficiency), with the efficiency model `Efficiency`:
  eff(w) = eff_max * w / (w + half_width), w = min(d_model / tp, tokens per micro-batch), the
  narrowest matmul dimension a GPU sees. Small per-GPU matmuls run further from peak. The two
  constants are fitted on two rows of Korthikanti et al. (`calibration.py`); the H100 presets'
  eff_max on one torchtitan row (`hardware.H100_EFF_MAX`); every other published row
  (`mini3d.cost.published`) is a prediction. Written-out attention (`attention="explicit"`) also
  moves its s x s scores through HBM (`traffic.score_traffic_s`), flash attention does not.
* expert parallelism (ep > 1): per MoE layer and micro-batch four all-to-alls of the rank's
  routed rows (dispatch and combine, forward and backward; `mini3d.cost.comm_time.ep_time`, the
  volume from `mini3d.cost.moe`) on the ep group's links (inside a node while tp*ep <=
  gpus_per_node), not overlapped with compute (Megatron-Core's default). Expert gradients reduce
  over the dp*cp/ep ranks holding the same experts, dense ones over dp*cp (`dp_time`). Each tp
  rank routes all its tokens (1/tp of them under sequence parallelism) to whole experts
  (`activations.moe_tokens`).
* tensor parallelism: per layer and micro-batch, two all-reduces forward and two backward (two
  more with full recompute), or the equal-volume all-gather / reduce-scatter pairs under sequence
  parallelism, each moving 2(t-1)/t * s*b*h*e bytes per rank at NVLink speed, or at the inter-node
  speed when a tp group spans nodes. Not overlapped with compute (as in Megatron-LM 2022). The
  vocabulary-parallel ends add, per micro-batch, one such op forward on the first stage (the
  embedding's partial lookups summed) and one backward on the last (the head's input gradient),
  and two small all-reduces forward on the last (the cross-entropy's max and sums, 3 * s*b*4 bytes).
* pipeline: (per micro-batch forward + backward) * m / (1 - bubble), the bubble fraction from the
  schedule simulator (`bubble_fraction`); plus p2p messages of s*b*h*e (/ t under sequence
  parallelism) twice per chunk and micro-batch on the critical path: 2 * (v*m + p - 1) messages.
* shared host (mini3d's own CPU runs, `Hardware.shared_host`): every rank is a process on one
  host's cores, and how fast one runs depends on how many others are runnable at that moment, so
  the step is simulated (`shared_host_step`, `mini3d.cost.host_share`): each pipeline rank's
  alone-speed work (compute, per-layer overhead, and communication, which there is CPU work:
  copies, gloo threads, Python) runs under processor sharing of the cores, the schedule's
  dependencies deciding who waits; compute also pays the contention left in
  `Hardware.slowdown(world)` (measured by `mini3d.cost.host_probe` with that many processes, else
  world / cores) once the sharing is divided out. The per-rank terms above, with that slowdown,
  stay in the breakdown; `host_sharing` is what the simulation adds to (or takes from) their sum.
  GPU presets are not shared hosts.
* context parallelism (cp > 1): every per-token cost is that of the rank's s/cp tokens (attention
  FLOPs per token still cover the full s); ring attention sends, per layer and micro-batch, cp-1
  K/V blocks forward and cp-1 backward plus cp float32 dK/dV accumulators (`ring_block_bytes`;
  forward again under full recompute). Each hop overlaps the attention of the block in hand (1/cp
  of the layer's attention core, twice that in backward): only max(0, transfer - compute) per hop
  is exposed, plus the last accumulator hop home. The cp groups sit inside a node while
  tp*cp <= gpus_per_node (order tp-cp-dp-pp).
* data parallelism: gradient all-reduce (ZeRO-0) or reduce-scatter + parameter all-gather
  (ZeRO-1/2) moving 2(d-1)/d * the stage's gradient bytes over the d = cp x dp ranks that hold
  the same weights, in buckets of `plan.bucket_mb` (DDP's 25 MiB by default) issued one after
  another as the backward produces them; the gradient part overlaps with the
  last micro-batch's backward (exposed: what does not fit, at least one bucket), the parameter
  all-gather after the optimizer step is exposed. ZeRO-3 gathers parameters twice per micro-batch,
  overlapped with all compute.
* every collective and p2p message costs `Hardware.collective_s`: its ring wire bytes over the
  link's bandwidth plus one latency per sequential ring step (2(n-1) for an all-reduce over n
  ranks, n-1 for an all-gather or reduce-scatter, 1 for a send), a network latency per step once
  the group spans nodes, where an all-reduce takes NCCL's tree when that is faster; a group
  spanning nodes gets the NICs of its members in a node (`link_bandwidths`). tp collectives per
  layer come from `mini3d.tp.comm_per_layer`, the same list the real layers issue.
* fixed overhead: `Hardware.layer_overhead_s` per layer and micro-batch, plus
  `Hardware.token_overhead_s` per layer and token of the micro-batch, divided by tp (0 for the GPU
  presets; measured by `mini3d calibrate` on a CPU, where tiny layers are dominated by per-op costs
  and by memory-bound softmax / GELU / LayerNorm work that the matmul FLOPs do not count; tp
  splits the heads and the MLP hidden dim that most of it runs over).
* optimizer: Adam is memory-bound: 28 bytes read or written per local parameter at HBM speed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from mini3d.config import ModelConfig, Plan, PlanError
from mini3d.pp.schedules import make_schedule
from mini3d.pp.simulator import bubble_formula, simulate
from mini3d.cost.comm_time import cp_time, dp_time, ep_time, members_per_node, tp_time
from mini3d.cost.flops import FLOPS_CONVENTION, flops_per_token, hardware_flops, layers_flops, model_flops
from mini3d.cost.efficiency import CALIBRATED, Efficiency, efficiency_for
from mini3d.cost.hardware import Hardware
from mini3d.cost.activations import ELEMENT_BYTES, local_seq_len
from mini3d.cost.traffic import elementwise_traffic_s, score_traffic_s
from mini3d.cost.host_share import shared_host_step
from mini3d.cost.memory import MemoryEstimate, estimate_memory
from mini3d.cost.params import (expert_sharding_degree, head_rank, sharding_degree,
                                stage_expert_count, stage_layers, stage_param_count)

ADAM_BYTES_PER_PARAM = 28  # read grad + read/write master, m, v (+ write the bf16 copy)


@dataclass
class CostEstimate:
    """What one training step of `plan` costs on `n_gpus` GPUs of `hardware`."""

    model: ModelConfig
    plan: Plan
    hardware: str
    n_gpus: int
    step_time_s: float
    tokens_per_s: float
    model_flops: float  # per step, all GPUs
    hardware_flops: float  # model FLOPs + recomputation
    tflops_per_gpu: float  # model FLOP/s per GPU / 1e12
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    bubble_fraction: float
    comm_bytes: dict  # wire bytes one rank sends per step, per axis
    breakdown: dict  # seconds: TIME_TERMS (+ BREAKDOWN_DETAILS)
    memory: MemoryEstimate
    capacity_bytes: float
    fits: bool = field(init=False)

    def __post_init__(self):
        self.fits = self.memory.fits(self.capacity_bytes)

    def as_dict(self) -> dict:
        """The machine-readable estimate printed by `mini3d estimate --json`."""
        mem = {k: getattr(self.memory, k) for k in ("params", "grads", "optimizer", "activations",
                                                    "comm_buffers")}
        mem.update(total=self.memory.total, stage=self.memory.stage,
                   peak_grad_bytes=self.memory.peak_grad_bytes)  # grads + dp buckets in flight
        if "experts" in self.memory.detail:  # the routed experts' share of params/grads/optimizer
            mem["experts"] = dict(self.memory.detail["experts"])
        return {"model": self.model.name, "params": self.model.n_params(),
                "active_params": self.model.active_params(),  # what one token uses (MoE)
                "family": self.model.family, "plan": self.plan.to_dict(), "hardware": self.hardware,
                "n_gpus": self.n_gpus, "memory_per_rank_bytes": mem,
                "capacity_bytes": self.capacity_bytes, "fits": self.fits,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "hfu": self.hfu, "flops_convention": FLOPS_CONVENTION, "bubble_fraction": self.bubble_fraction,
                "comm_bytes_per_rank": dict(self.comm_bytes), "breakdown_s": dict(self.breakdown)}


@functools.lru_cache(maxsize=4096)
def bubble_fraction(kind: str, p: int, m: int, v: int = 1, bwd_ratio: float = 2.0) -> float:
    """Bubble fraction from the pipeline simulator (uniform stages, p2p costed separately); for
    uniform stages it equals the closed form `mini3d.pp.simulator.bubble_formula` (tested)."""
    if p == 1:
        return 0.0
    return float(simulate(_schedule(kind, p, m, v), 1.0, bwd_ratio, 0.0).bubble_fraction)


@functools.lru_cache(maxsize=256)  # simulate only reads it; the planner asks per backward ratio
def _schedule(kind: str, p: int, m: int, v: int):
    return make_schedule(kind, p, m, v)


def link_bandwidths(plan: Plan, hw: Hardware) -> dict:
    """Per-axis bus bandwidth per rank. Rank order is tp fastest, then cp, dp, pp (mini3d.grid),
    so a tp group stays in a node while tp <= gpus_per_node, a cp group while tp*cp <=
    gpus_per_node, a dp (cp x dp) group while tp*cp*dp <= gpus_per_node, pp while the world does.
    Inside a node: NVLink. A group that spans nodes has k members per node (`members_per_node`),
    each with its own NIC of `internode_bw`: NCCL runs a ring per NIC, so the group's bus
    bandwidth is k x internode_bw, at most NVLink's (pure dp over DGX A100s: 8 x 25 = 200 GB/s,
    what nccl-tests report; tp=8 x dp: one member per node, 25 GB/s). A pp message uses one NIC.
    A shared host (gloo on one CPU) has one link speed."""
    k = members_per_node(plan, hw)
    return {a: hw.nvlink_bw if n is None else min(hw.nvlink_bw, (1 if hw.shared_host else n) * hw.internode_bw)
            for a, n in k.items()}


def _busiest_rank(cfg: ModelConfig, plan: Plan) -> tuple[int, int]:
    """(stage, layers) of the pipeline rank with the most forward FLOPs per micro-batch."""
    f = flops_per_token(cfg, plan.seq_len)
    work = [(layers_flops(cfg, plan.seq_len, stage_layers(cfg, plan, r), f)
             + (f["head"] if r == head_rank(plan) else 0), r) for r in range(plan.pp)]
    r = max(work)[1]
    return r, len(stage_layers(cfg, plan, r))


def _rank_terms(cfg: ModelConfig, plan: Plan, hw: Hardware, eff: Efficiency, stage: int,
                slowdown: float) -> dict:
    """Per-micro-batch seconds of pipeline rank `stage` with every rank `slowdown` times slower:
    compute (c_fwd, c_bwd, with the per-layer overhead), tp and cp communication, and the
    hardware with its links slowed likewise (`hw`, `bw`)."""
    e, t = ELEMENT_BYTES[plan.dtype], plan.tp
    held = stage_layers(cfg, plan, stage)
    layers = len(held)
    f = flops_per_token(cfg, plan.seq_len)
    tokens_mb = plan.micro_batch_size * local_seq_len(plan)  # this rank's tokens
    body = layers_flops(cfg, plan.seq_len, held, f)
    fwd = (body + (f["head"] if stage == head_rank(plan) else 0)) * tokens_mb / t
    extra = {"none": 0, "selective": layers * f["attention"], "full": body}[plan.recompute]
    width = min(cfg.d_model / t, tokens_mb)
    rate = hw.flops(plan.dtype) * eff.at(width) / slowdown
    c_fwd, c_bwd = fwd / rate, (2 * fwd + extra * tokens_mb / t) / rate
    per_layer = hw.layer_overhead_s + hw.token_overhead_s * tokens_mb / t
    overhead = layers * per_layer * slowdown  # 1/3 forward, 2/3 backward
    c_fwd, c_bwd = c_fwd + overhead / 3, c_bwd + 2 * overhead / 3
    scores = score_traffic_s(cfg, plan, hw, layers, tokens_mb)
    elementwise = elementwise_traffic_s(cfg, plan, hw, layers, tokens_mb)
    c_fwd = c_fwd + scores["fwd"] + elementwise["fwd"]
    c_bwd = c_bwd + scores["bwd"] + elementwise["bwd"]
    if slowdown != 1:  # on a shared host communication is CPU work too (copies, gloo, Python)
        hw = dataclasses.replace(hw, latency_s=hw.latency_s * slowdown)
    bw = {a: b / slowdown for a, b in link_bandwidths(plan, hw).items()}
    tp_fwd, tp_bwd, tp_wire = tp_time(cfg, plan, hw, layers, bw["tp"], stage)
    ring = cp_time(cfg, plan, hw, layers, bw["cp"], f["attention"] * tokens_mb / t / plan.cp / rate)
    a2a = ep_time(cfg, plan, hw, stage, bw["ep"])
    msg = tokens_mb * cfg.d_model * e / (t if plan.sequence_parallel else 1)
    return {"layers": layers, "c_fwd": c_fwd, "c_bwd": c_bwd, "tp_fwd": tp_fwd, "tp_bwd": tp_bwd,
            "tp_wire": tp_wire, "ring": ring, "ep": a2a,
            "t_fwd": c_fwd + tp_fwd + ring["fwd"] + a2a["fwd"],
            "t_bwd": c_bwd + tp_bwd + ring["bwd"] + a2a["bwd"], "scores": scores["fwd"] + scores["bwd"],
            "elementwise": elementwise["fwd"] + elementwise["bwd"],
            "width": width, "msg": msg, "hw": hw, "bw": bw,
            "n_params": stage_param_count(cfg, plan, stage),
            "n_expert": stage_expert_count(cfg, plan, stage)}


def optimizer_params(plan: Plan, terms: dict) -> float:
    """Parameters one rank's optimizer updates: its dense ones / (dp*cp) and its experts /
    (dp*cp/ep) under ZeRO-1 and above, all of them without ZeRO."""
    if plan.zero < 1:
        return terms["n_params"]
    return ((terms["n_params"] - terms["n_expert"]) / sharding_degree(plan)
            + terms["n_expert"] / expert_sharding_degree(plan))


# The breakdown's step-time terms, in the charts' order: they add up to step_time_s (+ host_sharing)
TIME_TERMS = ("compute", "tp_comm", "cp_comm", "ep_comm", "bubble", "pp_comm", "dp_exposed", "optimizer")
BREAKDOWN_DETAILS = ("attention_scores", "elementwise", "dp_total", "cp_total", "efficiency", "host_sharing")  # of them


def estimate_cost(cfg: ModelConfig, plan: Plan, hw: Hardware, n_gpus: int | None = None,
                  eff: Efficiency | None = None, memory: MemoryEstimate | None = None) -> CostEstimate:
    """Step time, throughput, utilisation, communication and memory of `plan` (validated first;
    `memory`: its `estimate_memory`, when the caller has it already, as the planner does)."""
    plan.validate(cfg, n_gpus)
    n = plan.world_size
    eff = efficiency_for(hw, eff)
    m, v, p = plan.micro_batches, plan.virtual_stages, plan.pp
    stage, _ = _busiest_rank(cfg, plan)
    slowdown = hw.slowdown(n)
    k = _rank_terms(cfg, plan, hw, eff, stage, slowdown)
    c_fwd, c_bwd, t_fwd, t_bwd, ring, bw = (k[x] for x in ("c_fwd", "c_bwd", "t_fwd", "t_bwd",
                                                           "ring", "bw"))
    bubble = bubble_fraction(plan.schedule, p, m, v, round(t_bwd / t_fwd, 3) if t_fwd else 2.0)
    pipeline = m * (t_fwd + t_bwd) / (1 - bubble)
    pp_s = 2 * (v * m + p - 1) * k["hw"].collective_s("send", 2, k["msg"], bw["pp"],
                                                       members_per_node(plan, hw)["pp"]) if p > 1 else 0.0
    pp_wire = 2 * v * m * k["msg"] if p > 1 else 0.0
    dp_total, dp_exposed, dp_wire = dp_time(cfg, plan, k["hw"], k["n_params"], bw["dp"], t_bwd,
                                             m * (t_fwd + t_bwd), k["n_expert"], bw["edp"])
    opt_s = ADAM_BYTES_PER_PARAM * optimizer_params(plan, k) / hw.memory_bw * slowdown
    step = pipeline + pp_s + dp_exposed + opt_s
    breakdown = {"compute": m * (c_fwd + c_bwd), "attention_scores": m * k["scores"],
                 "elementwise": m * k["elementwise"],
                 "tp_comm": m * (k["tp_fwd"] + k["tp_bwd"]),
                 "bubble": pipeline * bubble, "pp_comm": pp_s, "dp_exposed": dp_exposed,
                 "optimizer": opt_s, "dp_total": dp_total, "efficiency": eff.at(k["width"]),
                 "cp_comm": m * (ring["fwd"] + ring["bwd"]), "cp_total": m * ring["total"],
                 "ep_comm": m * (k["ep"]["fwd"] + k["ep"]["bwd"])}
    if hw.shared_host:  # the ranks share the host's cores: simulate who runs when
        alone = lambda h, r: _rank_terms(cfg, plan, h, eff, r, 1.0)  # noqa: E731
        shared = shared_host_step(cfg, plan, hw, alone, ADAM_BYTES_PER_PARAM)
        breakdown["host_sharing"] = shared - step  # what sharing adds to the per-rank terms
        step = shared
    mf, hf = model_flops(cfg, plan), hardware_flops(cfg, plan)
    peak = hw.flops(plan.dtype)
    return CostEstimate(cfg, plan, hw.name, n, step, plan.global_batch * plan.seq_len / step, mf, hf,
                        mf / step / n / 1e12, hf / step / n / 1e12, mf / step / n / peak,
                        hf / step / n / peak, bubble,
                        {"tp": m * k["tp_wire"], "pp": pp_wire, "dp": dp_wire,
                         **({"cp": m * ring["wire"]} if plan.cp > 1 else {}),
                         **({"ep": m * k["ep"]["wire"]} if plan.ep > 1 else {})}, breakdown,
                        memory or estimate_memory(cfg, plan), hw.memory_bytes)


def predict_step_time(cfg: ModelConfig, plan: Plan, hw: Hardware) -> float:
    """Seconds per optimizer step the model predicts (e.g. for a `mini3d calibrate` CPU JSON)."""
    return estimate_cost(cfg, plan, hw).step_time_s


__all__ = ["Efficiency", "CALIBRATED", "CostEstimate", "TIME_TERMS", "BREAKDOWN_DETAILS", "estimate_cost", "predict_step_time",
           "flops_per_token", "layers_flops", "optimizer_params", "model_flops", "hardware_flops", "bubble_fraction", "bubble_formula",
           "link_bandwidths", "PlanError"]
