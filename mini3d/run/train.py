"""The training loop every rank runs: build the topology, the (parallelised) model, then step.

`train_worker(run)` is what `mini3d train` runs in each process, whether the processes were spawned by
`mini3d.launch.launcher.launch` or by torchrun. `run` is a `RunConfig` (mini3d.run.config: frozen, picklable)
holding the model config, the plan and the run options, so the same function serves the CLI, the
tests and the course (all build it with `make_spec`).

The reporting rank (the one that computes the loss: last pipeline stage, tp_rank 0, dp_rank 0) shows a
progress bar, writes `--log-jsonl` (one JSON object per optimizer step) and returns the step records.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from mini3d.run import stop
from mini3d.config import ModelConfig, Plan
from mini3d.cp import chunk_micro_batches, set_positions
from mini3d.data.corpus import Batches, open_tokens
from mini3d.diagnose.faults import parse_size
from mini3d.diagnose.oom import check_budget, cuda_oom
from mini3d.diagnose.session import for_run
from mini3d.dp import DTYPES
from mini3d.dp.loss import mean_over_replicas
from mini3d.grid import Grid, build_topology
from mini3d.launch.devices import to_device
from mini3d.launch.launcher import current_device
from mini3d.optim import WeightDecay, adamw, set_lr
from mini3d.run.build import parallelize
from mini3d.run import saving
from mini3d.run.periodic import finish_saves, periodic, resumed_schedule, save_checkpoint
from mini3d.pp.runtime import PipelineRuntime
from mini3d.pp.schedules import make_schedule
from mini3d.pp.tied import tie_across_stages
from mini3d.recompute import measure_activations
from mini3d.run.records import (check_finite, collected, describe_plan, memory_by_category,
                                peak_activation_bytes, peak_memory_bytes, reporter_records, summary_line,
                                timed, resolve_timelines)
from mini3d.run.report import RunReport, model_flops_utilisation, peak_flops_per_rank
from mini3d.run.config import RunConfig, make_spec
from mini3d.data.tokenizer import get_tokenizer
from mini3d.tp import boundary_shape, clip_grad_norm_, sum_replicated_grads


class Trainer:
    """One rank's share of the model and optimizer, and one optimizer step over a global batch.

    Parallelising is an ordered series of transforms (see `parallelize`)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, topo, seed: int, lr: float,
                 weight_decay: float = 0.0, grad_clip: float = 0.0, decay_embeddings: bool = False):
        self.cfg, self.plan, self.topo = cfg, plan, topo
        self.stages, self.net, self.optimizer = parallelize(
            cfg, plan, topo, seed, lambda params: adamw(params, lr, 0.0, topo.device))
        # weight decay on the matrices only (mini3d.optim), applied by hand before each update
        self.decay = WeightDecay(self.optimizer, self.net.module, weight_decay, decay_embeddings)
        self.optimizer.grad_hooks.append(
            lambda local: self.decay.apply(self.optimizer.param_groups[0]["lr"]))
        tie_across_stages(self.stages, cfg, plan, topo, self.optimizer)  # a tied head on another stage
        if plan.sequence_parallel and topo.tp.size > 1:  # partial LayerNorm / position gradients
            self.optimizer.grad_hooks.append(lambda local: sum_replicated_grads(local, topo.tp))
        self.last_grad_norm_tensor = None  # the latest step's global gradient norm (grad_clip > 0)
        if grad_clip > 0:
            self.optimizer.grad_hooks.append(lambda local: self._clip(local, grad_clip))
        self.chunks = [self.stages[s] for s in sorted(self.stages)]
        self.runtime = None
        self.last_result = None  # the pipeline runtime's StepResult of the latest step (pp > 1)
        self.last_peak_grad_bytes = 0  # most gradient bytes held at once in the latest step
        if plan.pp > 1:
            schedule = make_schedule(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)
            self.runtime = PipelineRuntime(self.stages, schedule, topo,
                                           boundary_shape(plan, plan.micro_batch_size, cfg),
                                           dtype=DTYPES[plan.dtype], device=topo.device)

    def _clip(self, local, max_norm: float):
        self.last_grad_norm_tensor = clip_grad_norm_(local, self.topo, max_norm, self.plan.zero >= 1)

    @property
    def holds_loss(self) -> bool:
        return self.topo.pp.index == self.topo.pp.size - 1

    def step(self, micro_batches, step: int = 0) -> float:
        """Forward + backward over every micro-batch, then one optimizer step; returns the mean loss
        (on every rank: the pipeline broadcasts it from the last stage)."""
        return float(self.queue_step(micro_batches, step))

    def queue_step(self, micro_batches, step: int = 0) -> torch.Tensor:
        """`step` without reading anything back: the mean loss as a 0-dim tensor on the device, the
        gradient norm (with clipping or --log-grad-norm) in `last_grad_norm_tensor`. On CUDA the host
        only queues the step's work; `train_worker` then reads what it logs in one sync."""
        dev = self.topo.device
        if micro_batches and len(micro_batches[0]) == 3:  # (x, y, positions): a cp rank's chunks
            set_positions(self.chunks, to_device(micro_batches[0][2], dev))
        micro_batches = [(to_device(mb[0], dev), to_device(mb[1], dev)) for mb in micro_batches]
        self.net.meter.reset()  # peak gradient bytes of this step (see dp.ledger.GradMeter)
        # The dp gradient sync overlaps the last backward of each model chunk (interleaved
        # pipelines too: the later chunks finish first, and their buckets come first).
        if self.runtime is None:
            loss = self._step_no_pipeline(micro_batches)
        else:
            self.last_result = self.runtime.step(micro_batches, step, dp=self.net,
                                                 loss_on_device=True)
            loss = self.last_result.loss
        self.optimizer.step()  # waits for the gradient sync (and its grad_hooks) first
        self.last_peak_grad_bytes = self.net.meter.peak
        self.optimizer.zero_grad()
        return loss

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the latest step, before clipping (read back: a host sync)."""
        t = self.last_grad_norm_tensor
        return None if t is None else float(t)

    def _step_no_pipeline(self, micro_batches) -> torch.Tensor:
        m, total, self.last_timeline = len(micro_batches), 0.0, []  # [(start, end, "F0")...]
        # The loss stays a tensor: the step reads nothing back (see queue_step).
        for i, (x, y) in enumerate(micro_batches):
            self.topo.log.context = {**self.topo.log.context, "mb": i}
            sync = i == m - 1  # the last backward all-reduces buckets as they fill
            with contextlib.nullcontext() if sync else self.net.no_sync():
                loss = timed(self.last_timeline, f"F{i}", lambda: self.net(x, y), self.topo.device)
                timed(self.last_timeline, f"B{i}", lambda: (loss / m).backward(), self.topo.device)  # mean over mbs
            total = total + loss.detach() / m
        return total

    def mean_loss_over_dp(self, loss):
        """The mean over the replicas (and the cp ranks' equal chunks) of their mean losses (a
        float for a float; a device tensor, nothing read back, for `queue_step`'s tensor)."""
        return mean_over_replicas(loss, self.topo.dp_cp, self.topo.device)

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, root: str, step: int, meta: dict, keep_last: int = 0, background: bool = False):
        """Collective: every rank writes its share of its stage's full named state (DCP format),
        in the background with `background` (committed by `finish_saves`); mini3d.run.saving."""
        saving.save(self, root, step, meta, keep_last, background)

    def finish_saves(self):
        """Wait for a background save and commit it (collective; nothing if none is in flight)."""
        saving.finish_pending(self)

    def load(self, ckpt: str) -> int:
        """Restore from a checkpoint written by any layout; returns the step to continue from."""
        return saving.load(self, ckpt)


def _setup(run: RunConfig) -> dict:
    """Everything this rank's loop reads: topology, tokenizer, batches, the trainer (resumed or
    initialised from Hugging Face), the lr schedule, diagnostics, the reporter."""
    cfg, plan = run.model, run.plan
    topo = build_topology(Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp, ep=plan.ep), dist.get_rank(),
                          current_device())
    torch.manual_seed(run.seed)
    tok = get_tokenizer(run.tokenizer)
    batches = Batches(open_tokens(run.data, tok), plan.seq_len, plan.global_batch, run.seed)
    val = open_tokens(run.data, tok, "val") if run.eval_every else None
    val_batches = Batches(val, plan.seq_len, plan.global_batch, run.seed, stream=1) if val else None
    clip = run.grad_clip or (float("inf") if run.log_grad_norm else 0.0)  # inf: norm, no clip
    trainer = Trainer(cfg, plan, topo, run.seed, run.lr, run.weight_decay, clip,
                      run.decay_embeddings)
    start = trainer.load(run.resume) if run.resume else 0
    if run.init_from_hf and not run.resume:
        from mini3d.checkpoint.hf import init_from_hf

        init_from_hf(trainer, run.init_from_hf)  # each rank slices its share of the HF weights
    diag = for_run(topo, run)  # mini3d.diagnose: hang watchdog + faults (from the RunConfig)
    if run.stop_on_signal:  # Ctrl-C / SIGTERM: every rank stops at the same boundary (mini3d.run.stop)
        from mini3d.launch.launcher import in_torchrun

        stop.install(in_torchrun())
    reporter = trainer.holds_loss and topo.tp.index == 0 and topo.dp.index == 0 and topo.cp.index == 0
    return dict(topo=topo, tok=tok, batches=batches, val_batches=val_batches, trainer=trainer,
                start=start, schedule=resumed_schedule(run), diag=diag, reporter=reporter,
                report=RunReport(run, reporter, start, f"train {describe_plan(plan)}"),
                peak=peak_flops_per_rank(topo.device, plan.dtype))  # peak None on CPU: no MFU


def _train_step(run: RunConfig, st: dict, step: int, extra: dict) -> dict:
    """One optimizer step of the loop: the batch (a cp rank's chunks), the step, the checks, and
    the step's record."""
    plan, trainer, topo = run.plan, st["trainer"], st["topo"]
    budget = parse_size(run.memory_budget) if run.memory_budget else None
    topo.log.context = {"step": step}
    st["diag"].step_start(step, lambda: memory_by_category(trainer))  # diagnose
    t0 = time.perf_counter()
    set_lr(trainer.optimizer, st["schedule"].at(step))
    mbs = st["batches"].micro_batches(step, topo.dp.index, plan.dp, plan.micro_batches)
    mbs = chunk_micro_batches(mbs, plan.cp, topo.cp.index)  # cp > 1: this cp rank's zig-zag chunks
    first = step == st["start"]
    measure = first and len(trainer.chunks) == 1 and ("activations" in run.collect or budget)
    loss, acts = run_step(trainer, mbs, step, measure, run.run_dir)
    if acts is not None and "activations" in run.collect:
        extra["activations"] = acts
    if budget and first:  # --memory-budget: the measured ledgers against the budget
        check_budget(memory_by_category(trainer, peak_activation_bytes(trainer, acts)), budget,
                     topo.rank, topo.coords, run.model, plan)
    # The step's one host sync: the loss (averaged over dp x cp), the gradient norm and the stop
    # flag, all still on the device, read back together once the step's work is queued.
    loss = trainer.mean_loss_over_dp(loss)  # the step's last traced op
    # every op of the step is issued: the black box marks it whole BEFORE the (untraced) stop
    # agreement, so a rank that skipped an op and went on to wait there is seen to have finished
    # its step (a skip), not as "running outside communication" (periodic validation and samples
    # come after the mark)
    st["diag"].step_end(step)
    flag = stop.agree_tensor(topo.device) if run.stop_on_signal else None
    loss, norm, signum = read_back(loss, trainer.last_grad_norm_tensor, flag)
    extra["stop_signal"] = signum
    check_finite(loss, step, topo)
    dt = time.perf_counter() - t0
    rec = {"step": step + 1, "loss": loss, "step_time_s": dt,
           "tokens_per_s": plan.global_batch * plan.seq_len / dt,
           "peak_mem_bytes": peak_memory_bytes(topo.device), "lr": st["schedule"].at(step),
           "peak_grad_bytes": trainer.last_peak_grad_bytes, **getattr(trainer.net.module, "moe_load", {})}
    if norm is not None:
        rec["grad_norm"] = norm  # before clipping
    if st["peak"]:
        rec["mfu"] = model_flops_utilisation(run.model, plan, dt, st["peak"])
    return rec


def train_worker(run: RunConfig) -> dict:
    """Run optimizer steps until step `run.steps` on this rank; return what this rank saw."""
    st = _setup(run)
    trainer, topo, report = st["trainer"], st["topo"], st["report"]
    records, extra, interrupted = [], {}, None
    for step in range(st["start"], run.steps):
        rec = _train_step(run, st, step, extra)
        done = step + 1
        rec.update(periodic(trainer, run, done, st["val_batches"], st["tok"], report))
        records.append(rec)
        report.step(rec)
        saved = bool(run.save) and (done == run.steps or bool(run.save_every and
                                                               done % run.save_every == 0))
        signum = extra.pop("stop_signal", 0)  # agreed in the step's read-back (stop.agree_tensor)
        if saved or (signum and run.save):  # a stop saves first (at this boundary, on every rank)
            save_checkpoint(trainer, run, done, st["schedule"], st["tok"], st["diag"])
        if signum:
            interrupted = {"signal": signum, "step": done, "saved": bool(run.save)}
            break
    finish_saves(trainer, run, st["diag"])  # --async-save: the last write committed before exit
    report.close()
    st["diag"].finish()  # mini3d.diagnose: "finished" dump, watchdog stopped
    return {"rank": topo.rank, "coords": topo.coords, "reporter": st["reporter"], "records": records,
            "device": topo.device.type, "interrupted": interrupted,
            "comm_bytes": dict(topo.log.bytes_by_axis),
            "comm_wire_bytes": dict(topo.log.wire_bytes_by_axis),
            "peak_in_flight": trainer.last_result.peak_in_flight if trainer.last_result else {},
            **collected(trainer, set(run.collect)), **extra}


def read_back(loss: torch.Tensor, norm: torch.Tensor | None, flag: torch.Tensor | None):
    """(loss, gradient norm or None, stop signal or 0) as Python numbers, in ONE device-to-host
    read: on CUDA the host waits here once a step, not once per value (tests/test_host_syncs.py)."""
    parts = [loss.reshape(1).double()] + [t.reshape(1).double() for t in (norm, flag) if t is not None]
    got = torch.cat(parts).tolist()
    resolve_timelines(loss.device)  # done: the step's CUDA timeline events as seconds, no wait more
    it = iter(got[1:])
    return got[0], next(it) if norm is not None else None, int(next(it)) if flag is not None else 0


def run_step(trainer: Trainer, mbs, step: int, measure: bool, run_dir: str | None = None):
    """One optimizer step, queued; (loss tensor, activation bytes per micro-batch by module or None). A CUDA
    out-of-memory error becomes mini3d's OutOfMemory with the full report."""
    try:
        with measure_activations(trainer.chunks[0]) if measure else contextlib.nullcontext() as ledger:
            loss = trainer.queue_step(mbs, step)  # on the device: read back by _train_step
    except torch.OutOfMemoryError as err:
        t = trainer.topo
        raise cuda_oom(err, memory_by_category(trainer), t.device, t.rank, t.coords, trainer.cfg,
                       trainer.plan, run_dir) from err
    acts = {k: v / len(mbs) for k, v in ledger.by_category.items()} if measure else None
    return loss, acts


__all__ = ["Trainer", "train_worker", "make_spec", "summary_line", "reporter_records",
           "describe_plan", "peak_memory_bytes"]
