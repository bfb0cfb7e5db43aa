"""The pipeline runtime: executes any `Schedule` on this rank's stage modules.

`PipelineRuntime(stages, schedule, topo, act_shape)` holds this pipeline rank's stage modules
({global stage id: module}, see `partition.build_stages`) and runs `step(micro_batches)`:

* every rank is given all m micro-batches [(x, y), ...] of token ids; stage 0 reads x, the last
  stage reads y and computes the loss;
* the loss of the step is the mean over micro-batch losses, as in the single-process reference, so
  each micro-batch's loss is scaled by 1/m before its backward; parameter gradients accumulate over
  the micro-batches in `.grad` (the caller zeroes them between steps, like any optimizer loop);
* a stage's saved input, output and received gradient are dropped as soon as its backward is done,
  so the activations alive on a stage are exactly its in-flight micro-batches; the runtime tracks
  their peak per stage (`StepResult.peak_in_flight`) and per rank (`peak_chunks`);
* split backward (schedules with W actions, `zero_bubble.py`): B computes only the gradient of the
  stage input and sends it at once; each linear layer's input and output gradient, which W needs,
  stay alive until W computes the weight gradients (`split_backward.py`, `mini3d/wgrad.py`); the
  micro-batch counts as in flight until its W;
* a stage without the head but with MoE layers adds its router losses to the backward through
  its output (`mini3d.models.balance.carry_router_loss`, scaled 1/m like the last stage's loss) and
  their values to the step's loss: with router losses the loss is summed over pp (all-reduce:
  the last stage's mean loss, each other rank's stages' mean carried losses) instead of
  broadcast (`pp_total_loss`);
* each action's start and end is recorded (`StepResult.timeline`) on the device's timeline clock
  (`mini3d.timeline_clock`): time.perf_counter seconds on CPU (one clock for all local
  processes); on CUDA, timing events on the compute stream, the GPU's times on the host's seconds
  scale once resolved: by `step` when it reads the loss back, else by the next read-back on the
  rank (the trainer's, `loss_on_device`; until then the timeline holds unresolved marks); and
  `topo.log.context` is set to {step, action, stage, mb} before each action so every logged
  transfer says which action issued it.

Transfers: receives block; sends are non-blocking by default (`async_send=True`, see
`p2p.SendQueue`) and all complete before `step` returns. The schedule's order is proven safe even
with blocking sends (`check()`), which `async_send=False` uses, and two neighbours' transfers toward
each other pair up one for one in issue order, as NCCL's per-pair stream needs (see `p2p.py`). With `async_recv` (default: for
split schedules, when sends are non-blocking too) a receive is posted where the list has it and
waited for by the action that needs its tensor: a split schedule lists some receives before a
compute that does not need them (a W, or the next F), which then runs while the message travels.
The wait is recorded in the timeline under the receive's name. Still deadlock-free: every wait is
for a send that comes earlier in the global order `check()` executes.

Data-parallel hook (minimal on purpose): `step(..., dp=obj)` where `obj` has a `no_sync()` context
manager (like DistributedDataParallel), or a dict {stage: obj} with one per stage. Every backward of
a stage runs inside `no_sync()` except the stage's *last* backward of the step, so a wrapper that
all-reduces gradients as they are produced does so once, during that last backward.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from mini3d import comm
from mini3d.models.balance import has_router_loss
from mini3d.timeline_clock import clock_for
from mini3d.wgrad import WeightGradStore, deferring

from mini3d.pp.p2p import PipeP2P, SendQueue
from mini3d.pp.split_backward import backward_input


@dataclass
class StepResult:
    """What one pipeline step measured on this rank."""

    loss: float | None  # mean micro-batch loss (every pp rank if broadcast_loss, else last only;
    #                     a 0-dim tensor with step(..., loss_on_device=True))
    timeline: list = field(default_factory=list)  # [(start, end, action string)], s (timeline_clock)
    peak_in_flight: dict = field(default_factory=dict)  # {stage: max micro-batches alive}
    pp_rank: int = 0
    peak_chunks: int = 0  # max chunk activations alive on this rank, all its stages together

    def busy_s(self, compute_only: bool = True) -> float:
        """Seconds spent in actions (F, B and W only, by default)."""
        return sum(e - s for s, e, a in self.timeline
                   if not compute_only or a[0] in "FBW")


class PipelineRuntime:
    """Runs a Schedule on this pipeline rank (see the module docstring).

    `act_shape`: the per-rank shape of the activation at a stage boundary, e.g. (b, T, d_model),
    or (b, T / tp, d_model) under sequence parallelism; its gradient has the same shape."""

    def __init__(self, stages: dict, schedule, topo, act_shape, dtype=torch.float32, device=None,
                 async_send: bool = True, async_recv: bool | None = None):
        self.schedule, self.topo = schedule, topo
        self.async_send = async_send  # non-blocking sends (see p2p.SendQueue); False: blocking
        self.async_recv = (schedule.split and async_send) if async_recv is None else async_recv
        self.pp_rank = topo.pp.index
        want = schedule.stages_of(self.pp_rank)
        if sorted(stages) != want:
            raise ValueError(f"pp rank {self.pp_rank} holds stages {sorted(stages)} but the "
                             f"{schedule.kind} schedule with p={schedule.p} v={schedule.v} "
                             f"expects {want}")
        if schedule.p != topo.pp.size:
            raise ValueError(f"schedule p={schedule.p} but the pp axis has {topo.pp.size} ranks")
        self.stages = stages
        if device is None:
            param = next(iter(stages[want[0]].parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.p2p = PipeP2P(topo.pp, act_shape, dtype, self.device)
        self.clock = clock_for(self.device)

    def step(self, micro_batches, step: int = 0, dp=None, broadcast_loss: bool = True,
             loss_on_device: bool = False) -> StepResult:
        """Run one optimizer step's forwards and backwards; gradients accumulate in `.grad`.
        `loss_on_device`: `StepResult.loss` is the 0-dim loss tensor, not read back (no host sync;
        the trainer reads it once a step with the rest of what it logs)."""
        sched = self.schedule
        if len(micro_batches) != sched.m:
            raise ValueError(f"got {len(micro_batches)} micro-batches, the schedule has m={sched.m}")
        st = _StepState(self, micro_batches, dp)
        for module in self.stages.values():  # a headless stage's router losses: 1/m, as the loss
            module.router_loss_scale = 1.0 / sched.m
        log = self.topo.log
        for a in sched.actions[self.pp_rank]:
            if log is not None:
                log.context = {"step": step, "action": str(a), "stage": a.stage, "mb": a.mb}
            st.await_inputs(a)  # posted receives this action needs (async_recv)
            t0 = self.clock.mark()
            st.run(a)
            self.clock.span(st.timeline, t0, str(a))
        st.sends.wait_all()
        if log is not None:
            log.context = {"step": step}
        loss = None
        if st.losses:
            loss = torch.stack(st.losses).mean()
        if broadcast_loss and sched.p > 1:
            loss = pp_total_loss(self, loss, st.carried, sched.m)
        if loss is not None and not loss_on_device:
            loss = float(loss)  # the step's read-back, then its timeline's CUDA marks as seconds
            self.clock.resolve()
        return StepResult(loss, st.timeline,
                          dict(st.peak), self.pp_rank, st.peak_chunks)


def pp_total_loss(rt: PipelineRuntime, loss, carried: list, m: int) -> torch.Tensor:
    """The step's loss on every pp rank: broadcast from the last stage's rank, or, when the
    model has router losses (`mini3d.models.balance.has_router_loss`), all-reduced over pp: the last
    stage's mean loss plus each rank's headless stages' carried router losses / m (the same
    decision on every rank: it reads the model's config)."""
    wide = torch.promote_types(rt.p2p.dtype, torch.float32)  # the loss's dtype
    buf = (loss.reshape(1).to(wide).clone() if loss is not None else
           torch.zeros(1, dtype=wide, device=rt.device))
    cfg = getattr(next(iter(rt.stages.values())), "cfg", None)
    if cfg is not None and has_router_loss(cfg):
        if carried:
            buf += torch.stack(carried).sum().to(wide) / m
        comm.all_reduce(buf, rt.topo.pp)
    else:
        comm.broadcast(buf, rt.topo.pp, src_index=rt.schedule.rank_of(rt.schedule.n_stages - 1))
    return buf[0]


class _StepState:
    """The tensors alive during one step on one rank, and how each action changes them."""

    def __init__(self, rt: PipelineRuntime, micro_batches, dp):
        self.rt, self.mbs, self.dp = rt, micro_batches, dp
        self.m = rt.schedule.m
        # d(step loss)/d(micro-batch loss) for the split backwards: made on the device once a step
        # (a fill, not a host-to-device copy per backward as torch.tensor(...) would be)
        self.loss_grad = torch.full((), 1.0 / self.m, device=rt.device)
        self.last_stage = rt.schedule.n_stages - 1
        self.inputs, self.outputs = {}, {}  # (stage, mb) -> tensor saved for the backward
        self.grad_out, self.grad_in = {}, {}  # received output grads / input grads to send
        self.live, self.peak, self.peak_chunks = Counter(), Counter(), 0
        self.losses, self.timeline = [], []
        self.carried = []  # the router losses of this rank's headless stages, one per forward
        self.sends = SendQueue()
        self.posted = {}  # (stage, mb, "F" or "B") -> (work, receive action) of a posted receive
        acts = rt.schedule.actions[rt.pp_rank]
        self.split = {(a.stage, a.mb) for a in acts if a.op == "W"}  # B now, W later
        self.pending = {}  # (stage, mb) -> split_backward.PendingWeightGrad, from B to W
        self.stores = {}  # (stage, mb) -> the wgrad.WeightGradStore its forward recorded, F to B
        last = {}  # stage -> its last action producing weight gradients
        for a in acts:
            if a.op == "W" or (a.op == "B" and (a.stage, a.mb) not in self.split):
                last[a.stage] = (a.stage, a.mb)
        self.last_backward = set(last.values())

    def run(self, a):
        key = (a.stage, a.mb)
        if a.op == "F":
            self.forward(a.stage, a.mb)
        elif a.op == "B":
            self.backward(a.stage, a.mb)
        elif a.op == "W":
            self.weight(a.stage, a.mb)
        elif a.op == "SEND_F":
            self.send(self.outputs[key], a.peer)
        elif a.op == "RECV_F" and self.rt.async_recv:
            self.inputs[key], work = self.rt.p2p.irecv(a.peer)
            self.posted[(a.stage, a.mb, "F")] = (work, a)
        elif a.op == "RECV_F":
            self.inputs[key] = self.rt.p2p.recv(a.peer).requires_grad_()
        elif a.op == "RECV_B" and self.rt.async_recv:
            self.grad_out[key], work = self.rt.p2p.irecv(a.peer)
            self.posted[(a.stage, a.mb, "B")] = (work, a)
        elif a.op == "SEND_B":
            self.send(self.grad_in.pop(key), a.peer)
        elif a.op == "RECV_B":
            self.grad_out[key] = self.rt.p2p.recv(a.peer)
        else:
            raise ValueError(f"unknown action {a}")

    def await_inputs(self, a):
        """Wait for the posted receive whose tensor action `a` (F or B) reads, timing the wait."""
        got = self.posted.pop((a.stage, a.mb, a.op), None) if a.op in ("F", "B") else None
        if got is None:
            return
        work, recv = got
        t0 = self.rt.clock.mark()
        work.wait()
        self.rt.clock.span(self.timeline, t0, str(recv))
        if a.op == "F":
            self.inputs[(a.stage, a.mb)].requires_grad_()

    def send(self, tensor, peer: int):
        if self.rt.async_send:
            t = tensor.detach().contiguous()
            self.sends.add(self.rt.p2p.send(t, peer, async_op=True), t)
        else:
            self.rt.p2p.send(tensor, peer)

    def forward(self, s: int, mb: int):
        module = self.rt.stages[s]
        x, y = self.mbs[mb]
        h = x.to(self.rt.device) if s == 0 else self.inputs[(s, mb)]
        # linears' W work; stage 0 has no input gradient, so its B is empty and W a whole backward
        store = WeightGradStore() if s > 0 and (s, mb) in self.split else None
        with deferring(store):
            if s == self.last_stage:
                out = module(h, y.to(self.rt.device))  # the micro-batch's mean token loss
                self.losses.append(out.detach())
            else:
                out = module(h)  # (b, T, C)
                if getattr(module, "carried_loss", None) is not None:  # its MoE layers' losses
                    self.carried.append(module.carried_loss)
                    module.carried_loss = None
        if store is not None:
            self.stores[(s, mb)] = store
        self.outputs[(s, mb)] = out
        if s < self.last_stage and self.rt.schedule.rank_of(s + 1) == self.rt.pp_rank:
            self.inputs[(s + 1, mb)] = out.detach().requires_grad_()  # local hand-over (p == 1)
        self.live[s] += 1
        self.peak[s] = max(self.peak[s], self.live[s])
        self.peak_chunks = max(self.peak_chunks, sum(self.live.values()))

    def _sync_context(self, s: int, mb: int):
        dp = self.dp.get(s) if isinstance(self.dp, dict) else self.dp
        if dp is None or (s, mb) in self.last_backward:
            return contextlib.nullcontext()
        return dp.no_sync()

    def backward(self, s: int, mb: int):
        out = self.outputs.pop((s, mb))
        inp = self.inputs.pop((s, mb), None)
        if (s, mb) in self.split:  # B: the input gradient only; W later (no dp sync here)
            grad = (self.loss_grad if s == self.last_stage
                    else self.grad_out.pop((s, mb)))
            dinp, self.pending[(s, mb)] = backward_input(
                out, grad, inp, list(self.rt.stages[s].parameters()), self.stores.pop((s, mb), None))
        else:
            with self._sync_context(s, mb):
                if s == self.last_stage:
                    (out / self.m).backward()  # global loss = mean of the m micro-batch losses
                else:
                    torch.autograd.backward(out, self.grad_out.pop((s, mb)))
            dinp = None if inp is None else inp.grad
            self.live[s] -= 1
        if s > 0:
            if self.rt.schedule.rank_of(s - 1) == self.rt.pp_rank:
                self.grad_out[(s - 1, mb)] = dinp  # local hand-over
            else:
                self.grad_in[(s, mb)] = dinp

    def weight(self, s: int, mb: int):
        """W: the weight gradients of a micro-batch whose B ran; releases its graph."""
        with self._sync_context(s, mb):
            self.pending.pop((s, mb)).run()
        self.live[s] -= 1


__all__ = ["PipelineRuntime", "StepResult"]
