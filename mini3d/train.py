"""The training loop every rank runs: build the topology, the (parallelised) model, then step.

`train_worker(spec)` is what `mini3d train` runs in each process, whether the processes were spawned by
`mini3d.launch.launch` or by torchrun. `spec` is a plain dict (picklable, JSON-able) holding the model
config, the plan and the run options, so the same function serves the CLI, the tests and the course.

The reporting rank (the one that computes the loss: last pipeline stage, tp_rank 0, dp_rank 0) shows a
progress bar, writes `--log-jsonl` (one JSON object per optimizer step) and returns the step records.
"""

from __future__ import annotations

import json
import resource
import time

import torch
import torch.distributed as dist

from . import comm
from .config import ModelConfig, Plan, model_from_dict, plan_from_dict
from .data import Batches, load_tokens
from .diagnose.faults import measure_memory
from .diagnose.session import diagnostics
from .grid import Grid, build_topology
from .launch import current_device
from .model import GPT


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
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class Trainer:
    """One rank's share of the model and optimizer, and one optimizer step over a global batch."""

    def __init__(self, cfg: ModelConfig, plan: Plan, topo, seed: int, lr: float,
                 weight_decay: float = 0.0):
        self.cfg, self.plan, self.topo = cfg, plan, topo
        self.model = GPT(cfg, seed).to(topo.device)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95),
                                           weight_decay=weight_decay)

    @property
    def holds_loss(self) -> bool:
        return self.topo.pp.index == self.topo.pp.size - 1

    def step(self, micro_batches) -> float:
        """Forward + backward over every micro-batch, then one optimizer step; returns the mean loss."""
        m = len(micro_batches)
        total = 0.0
        for i, (x, y) in enumerate(micro_batches):
            self.topo.log.context = {"mb": i}
            loss = self.model(x.to(self.topo.device), y.to(self.topo.device))
            (loss / m).backward()  # mean over micro-batches = mean over the replica's batch
            total += loss.item() / m
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def mean_loss_over_dp(self, loss: float) -> float:
        if self.topo.dp.size == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(t, self.topo.dp, op="avg")
        return float(t.item())


def train_worker(spec: dict) -> dict:
    """Run `spec["steps"]` optimizer steps on this rank; return what this rank saw."""
    cfg, plan = model_from_dict(spec["model"]), plan_from_dict(spec["plan"])
    rank = dist.get_rank()
    topo = build_topology(Grid(plan.tp, plan.pp, plan.dp), rank, current_device())
    torch.manual_seed(spec["seed"])
    tokens = load_tokens(spec.get("data"))
    batches = Batches(tokens, plan.seq_len, plan.global_batch, spec["seed"])
    trainer = Trainer(cfg, plan, topo, spec["seed"], spec["lr"], spec.get("weight_decay", 0.0))
    diag = diagnostics(topo, spec)  # mini3d.diagnose: hang watchdog + fault injection (if asked)
    reporter = trainer.holds_loss and topo.tp.index == 0 and topo.dp.index == 0
    log_file = open(spec["log_jsonl"], "w") if (reporter and spec.get("log_jsonl")) else None
    bar = None
    if reporter and spec.get("progress"):
        from tqdm.auto import tqdm

        bar = tqdm(total=spec["steps"], desc=f"train {describe_plan(plan)}", unit="step",
                   disable=None)  # None: only on a terminal
    records = []
    tokens_per_step = plan.global_batch * plan.seq_len
    for step in range(spec["steps"]):
        topo.log.context = {"step": step}
        diag.step_start(step, lambda: measure_memory(trainer.params, trainer.optimizer))  # diagnose
        t0 = time.perf_counter()
        mbs = batches.micro_batches(step, topo.dp.index, plan.dp, plan.micro_batches)
        loss = trainer.step(mbs)
        loss = trainer.mean_loss_over_dp(loss) if trainer.holds_loss else float("nan")
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
               "peak_mem_bytes": peak_memory_bytes(topo.device)}
        records.append(rec)
        if log_file:
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
    if bar:
        bar.close()
    if log_file:
        log_file.close()
    diag.finish()  # mini3d.diagnose: "finished" dump, watchdog stopped
    return {"rank": rank, "coords": topo.coords, "reporter": reporter, "records": records,
            "comm_bytes": dict(topo.log.bytes_by_axis), "comm_wire_bytes": dict(topo.log.wire_bytes_by_axis)}


def describe_plan(plan: Plan) -> str:
    s = f"tp{plan.tp} x pp{plan.pp} x dp{plan.dp}"
    if plan.zero:
        s += f" zero{plan.zero}"
    if plan.pp > 1:
        s += f" {plan.schedule}"
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
