"""The training loop every rank runs: build the topology, the (parallelised) model, then step.

`train_worker(spec)` is what `mini3d train` runs in each process, whether the processes were spawned by
`mini3d.launch.launch` or by torchrun. `spec` is a plain dict (picklable, JSON-able) holding the model
config, the plan and the run options, so the same function serves the CLI, the tests and the course.

The reporting rank (the one that computes the loss: last pipeline stage, tp_rank 0, dp_rank 0) shows a
progress bar, writes `--log-jsonl` (one JSON object per optimizer step) and returns the step records.
"""

from __future__ import annotations

import contextlib
import json
import resource
import time

import torch
import torch.distributed as dist

from . import comm
from .config import ModelConfig, Plan, model_from_dict, plan_from_dict
from .data import Batches, load_tokens
from .diagnose.faults import parse_size
from .diagnose.oom import check_budget, cuda_oom
from .diagnose.session import diagnostics
from .grid import Grid, build_topology
import torch.nn as nn

from .checkpoint import (CheckpointWriter, gather_full_state, read_meta, read_states,
                         restore_full_state)
from .dp import make_dp, model_state_ledger
from .launch import current_device, device_memory
from .pp.partition import build_stages
from .pp.runtime import PipelineRuntime
from .pp.schedules import make_schedule, placement_of
from .model import set_attention
from .recompute import apply_recompute, measure_activations
from .tp import (apply_tp, boundary_shape, clip_grad_norm_, materialize_reference,
                 sum_replicated_grads)


def make_spec(cfg: ModelConfig, plan: Plan, steps: int = 20, lr: float = 3e-3, seed: int = 0,
              data: str | None = None, log_jsonl: str | None = None, progress: bool = False,
              weight_decay: float = 0.0, grad_clip: float = 0.0, **extra) -> dict:
    """Everything a worker needs, as a plain dict."""
    import dataclasses

    return dict(model=dataclasses.asdict(cfg), plan=plan.to_dict(), steps=steps, lr=lr, seed=seed,
                data=data, log_jsonl=log_jsonl, progress=progress, weight_decay=weight_decay,
                grad_clip=grad_clip, **extra)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA's allocator peak on GPUs, the process' peak RSS on CPU."""
    if device.type == "cuda":
        return device_memory(device)["peak"]
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def adamw(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """mini3d's optimizer. On CUDA the fused kernel: one pass over each flat master instead of the
    default multi-tensor path's several elementwise kernels; on CPU torch's default (what the
    float32 parity tests compare with)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             fused=True if device.type == "cuda" else None)


class Trainer:
    """One rank's share of the model and optimizer, and one optimizer step over a global batch.

    Parallelising is an ordered series of transforms (see `parallelize`)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, topo, seed: int, lr: float,
                 weight_decay: float = 0.0, grad_clip: float = 0.0):
        self.cfg, self.plan, self.topo = cfg, plan, topo
        self.stages, self.net, self.optimizer = parallelize(
            cfg, plan, topo, seed,
            lambda params: adamw(params, lr, weight_decay, topo.device))
        if plan.sequence_parallel and topo.tp.size > 1:  # partial LayerNorm / position gradients
            self.optimizer.grad_hooks.append(lambda local: sum_replicated_grads(local, topo.tp))
        self.last_grad_norm = None  # the global gradient norm of the latest step (grad_clip > 0)
        if grad_clip > 0:
            self.optimizer.grad_hooks.append(lambda local: self._clip(local, grad_clip))
        self.chunks = [self.stages[s] for s in sorted(self.stages)]
        self.runtime = None
        self.last_result = None  # the pipeline runtime's StepResult of the latest step (pp > 1)
        if plan.pp > 1:
            schedule = make_schedule(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)
            act_dtype = torch.bfloat16 if plan.dtype == "bf16" else torch.float32
            self.runtime = PipelineRuntime(self.stages, schedule, topo,
                                           boundary_shape(plan, plan.micro_batch_size, cfg),
                                           dtype=act_dtype, device=topo.device)

    def _clip(self, local, max_norm: float):
        self.last_grad_norm = clip_grad_norm_(local, self.topo, max_norm, self.plan.zero >= 1)

    @property
    def holds_loss(self) -> bool:
        return self.topo.pp.index == self.topo.pp.size - 1

    def step(self, micro_batches, step: int = 0) -> float:
        """Forward + backward over every micro-batch, then one optimizer step; returns the mean loss
        (on every rank: the pipeline broadcasts it from the last stage)."""
        dev = self.topo.device
        micro_batches = [(x.to(dev), y.to(dev)) for x, y in micro_batches]
        # The dp gradient sync overlaps the last backward of each model chunk (interleaved
        # pipelines too: the later chunks finish first, and their buckets come first).
        if self.runtime is None:
            loss = self._step_no_pipeline(micro_batches)
        else:
            self.last_result = self.runtime.step(micro_batches, step, dp=self.net)
            loss = self.last_result.loss
        self.optimizer.step()  # waits for the gradient sync (and its grad_hooks) first
        self.optimizer.zero_grad()
        return loss

    def _step_no_pipeline(self, micro_batches) -> float:
        m, total = len(micro_batches), 0.0
        # The loss stays a tensor until the step ends: one host sync per step, not per micro-batch.
        for i, (x, y) in enumerate(micro_batches):
            self.topo.log.context = {**self.topo.log.context, "mb": i}
            sync = i == m - 1  # the last backward all-reduces buckets as they fill
            with contextlib.nullcontext() if sync else self.net.no_sync():
                loss = self.net(x, y)
                (loss / m).backward()  # mean over micro-batches = mean over the replica's batch
            total = total + loss.detach() / m
        return float(total)

    def mean_loss_over_dp(self, loss: float) -> float:
        if self.topo.dp.size == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(t, self.topo.dp, op="avg")
        return float(t.item())

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, root: str, step: int, meta: dict):
        """Collective: gather the full named state per pipeline stage and write it atomically."""
        weights, moments, opt_step = gather_full_state(self.chunks, self.optimizer, self.topo)
        world = self.topo.axes["world"]
        writer = CheckpointWriter(root, step)
        if self.topo.rank == 0:
            writer.begin()
        comm.barrier(world)
        if self.topo.tp.index == 0 and self.topo.dp.index == 0:
            part = {"model": weights, "optim": moments, "optim_step": opt_step}
            if self.topo.pp.index == 0:
                part["rng"] = torch.get_rng_state()
            writer.write(f"stage{self.topo.pp.index}.pt", part)
        comm.barrier(world)
        if self.topo.rank == 0:
            writer.commit(meta)
        comm.barrier(world)

    def load(self, ckpt: str) -> int:
        """Restore from a checkpoint written by any layout; returns the step to continue from."""
        meta = read_meta(ckpt)
        states = read_states(ckpt)
        opt_step = max((int(torch.load(f"{ckpt}/{n}", weights_only=True).get("optim_step", 0))
                        for n in _stage_files(ckpt)), default=0)
        restore_full_state(self.chunks, self.optimizer, self.topo, states["model"], states["optim"],
                           opt_step)
        return int(meta["step"])


def _stage_files(ckpt: str) -> list[str]:
    import os

    return sorted(n for n in os.listdir(ckpt) if n.startswith("stage") and n.endswith(".pt"))


def parallelize(cfg: ModelConfig, plan: Plan, topo, seed: int, optimizer_factory):
    """The ordered transforms that turn the reference model into this rank's share of it:

    1. pipeline: build only this pp rank's stages (v chunks for interleaved), on the meta device
       (shapes, no memory);
    2. tensor parallelism: slice each stage's matrices for this tp rank (still shapes), then give
       each slice its value on this rank's device: the slice of the same parameter of the full
       reference model (one full parameter in host memory at a time, never the unsliced stage);
    3. the attention core (written out, or torch's fused sdpa) and the recomputation policy;
    4. data parallelism / ZeRO over the dp axis, which also builds the optimizer.

    Returns ({stage id: module}, the dp wrapper, the optimizer)."""
    stages = build_stages(cfg, seed, topo.pp.index, plan.pp, plan.virtual_stages, device="meta",
                          placement=placement_of(plan.schedule))
    for module in stages.values():
        apply_tp(module, topo, plan)
        materialize_reference(module, topo, seed, topo.device)
        set_attention(module, plan.attention)
        apply_recompute(module, plan.recompute)
    chunks = [stages[s] for s in sorted(stages)]
    root = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
    net, optimizer = make_dp(root, topo.dp, plan, optimizer_factory)
    return stages, net, optimizer


def train_worker(spec: dict) -> dict:
    """Run optimizer steps until step `spec["steps"]` on this rank; return what this rank saw."""
    cfg, plan = model_from_dict(spec["model"]), plan_from_dict(spec["plan"])
    rank = dist.get_rank()
    topo = build_topology(Grid(plan.tp, plan.pp, plan.dp), rank, current_device())
    torch.manual_seed(spec["seed"])
    tokens = load_tokens(spec.get("data"))
    batches = Batches(tokens, plan.seq_len, plan.global_batch, spec["seed"])
    trainer = Trainer(cfg, plan, topo, spec["seed"], spec["lr"], spec.get("weight_decay", 0.0),
                      spec.get("grad_clip", 0.0))
    start = trainer.load(spec["resume"]) if spec.get("resume") else 0
    diag = diagnostics(topo, spec)  # mini3d.diagnose: hang watchdog + fault injection (if asked)
    reporter = trainer.holds_loss and topo.tp.index == 0 and topo.dp.index == 0
    log_file = open(spec["log_jsonl"], "a" if start else "w") if (reporter and spec.get("log_jsonl")) else None
    bar = None
    if reporter and spec.get("progress"):
        from tqdm.auto import tqdm

        bar = tqdm(total=spec["steps"], initial=start, desc=f"train {describe_plan(plan)}",
                   unit="step", disable=None)  # None: only on a terminal
    records = []
    tokens_per_step = plan.global_batch * plan.seq_len
    save_every = spec.get("save_every") or 0
    collect, extra = set(spec.get("collect") or ()), {}
    budget = parse_size(spec["memory_budget"]) if spec.get("memory_budget") else None
    for step in range(start, spec["steps"]):
        topo.log.context = {"step": step}
        diag.step_start(step, lambda: memory_by_category(trainer))  # diagnose
        t0 = time.perf_counter()
        mbs = batches.micro_batches(step, topo.dp.index, plan.dp, plan.micro_batches)
        measure = step == start and len(trainer.chunks) == 1 and ("activations" in collect or budget)
        loss, acts = run_step(trainer, mbs, step, measure, spec.get("run_dir"))
        if acts is not None and "activations" in collect:
            extra["activations"] = acts
        if budget and step == start:  # --memory-budget: the measured ledgers against the budget
            check_budget(memory_by_category(trainer, peak_activation_bytes(trainer, acts)), budget,
                         rank, topo.coords, cfg, plan)
        loss = trainer.mean_loss_over_dp(loss)
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
               "peak_mem_bytes": peak_memory_bytes(topo.device)}
        if trainer.last_grad_norm is not None:
            rec["grad_norm"] = trainer.last_grad_norm  # before clipping
        records.append(rec)
        if log_file:
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        done = step + 1
        if spec.get("save") and (done == spec["steps"] or (save_every and done % save_every == 0)):
            trainer.save(spec["save"], done, {"step": done, "model": spec["model"], "plan": spec["plan"],
                                              "seed": spec["seed"], "data_position": done})
    if bar:
        bar.close()
    if log_file:
        log_file.close()
    diag.finish()  # mini3d.diagnose: "finished" dump, watchdog stopped
    return {"rank": rank, "coords": topo.coords, "reporter": reporter, "records": records,
            "comm_bytes": dict(topo.log.bytes_by_axis),
            "comm_wire_bytes": dict(topo.log.wire_bytes_by_axis),
            "peak_in_flight": trainer.last_result.peak_in_flight if trainer.last_result else {},
            **collected(trainer, collect), **extra}


def run_step(trainer: Trainer, mbs, step: int, measure: bool, run_dir: str | None = None):
    """One optimizer step; (loss, activation bytes per micro-batch by module or None). A CUDA
    out-of-memory error becomes mini3d's OutOfMemory with the full report."""
    try:
        with measure_activations(trainer.chunks[0]) if measure else contextlib.nullcontext() as ledger:
            loss = trainer.step(mbs, step)
    except torch.OutOfMemoryError as err:
        t = trainer.topo
        raise cuda_oom(err, memory_by_category(trainer), t.device, t.rank, t.coords, trainer.cfg,
                       trainer.plan, run_dir) from err
    acts = {k: v / len(mbs) for k, v in ledger.by_category.items()} if measure else None
    return loss, acts


def peak_activation_bytes(trainer: Trainer, acts: dict | None) -> float:
    """Measured activation peak: bytes saved per micro-batch x micro-batches in flight at once
    (1 without a pipeline: each micro-batch's backward frees them before the next forward)."""
    if not acts:
        return 0.0
    in_flight = max(trainer.last_result.peak_in_flight.values()) if trainer.last_result else 1
    return sum(acts.values()) * in_flight


def memory_by_category(trainer: Trainer, activations: float = 0) -> dict:
    """Measured bytes of this rank in the estimator's categories (model states from the live
    ledger; activations as measured by the caller)."""
    led = model_state_ledger(trainer.net, trainer.optimizer)
    return {"params": led["parameters"], "grads": led["gradients"],
            "optimizer": led["master_weights"] + led["optimizer_states"] + led["optimizer_scalars"],
            "activations": activations, "comm_buffers": 0}


def collected(trainer: Trainer, what: set) -> dict:
    """Optional measurements a caller (tests, the course) asks for with spec["collect"]:
    "events" (this rank's comm event log), "timeline" (the last pipeline step's measured actions),
    "ledger" (model-state bytes by category), "activations" (bytes saved for backward per
    micro-batch by module, measured during the first step; one model chunk only)."""
    out = {}
    if "events" in what:
        out["events"] = trainer.topo.log.snapshot()
    if "timeline" in what and trainer.last_result is not None:
        out["timeline"] = [(s, e, a) for s, e, a in trainer.last_result.timeline]
    if "ledger" in what:
        out["ledger"] = model_state_ledger(trainer.net, trainer.optimizer)
    return out


def describe_plan(plan: Plan) -> str:
    s = f"tp{plan.tp} x pp{plan.pp} x dp{plan.dp}"
    if plan.zero:
        s += f" zero{plan.zero}"
    if plan.pp > 1:
        s += f" {plan.schedule}"
    if plan.attention != "explicit":
        s += f" {plan.attention}"
    return s


def summary_line(records: list[dict], plan: Plan) -> str:
    first, last = records[0], records[-1]
    n = len(records)
    mean_tps = sum(r["tokens_per_s"] for r in records[1:] or records) / max(1, len(records[1:] or records))
    return (f"done: {n} steps on {describe_plan(plan)} ({plan.world_size} processes): loss "
            f"{first['loss']:.4f} -> {last['loss']:.4f}, {mean_tps:,.0f} tokens/s, peak memory "
            f"{max(r['peak_mem_bytes'] for r in records) / 2**20:,.0f} MiB per rank")


def reporter_records(results: list[dict]) -> list[dict]:
    return next(r["records"] for r in results if r["reporter"])
