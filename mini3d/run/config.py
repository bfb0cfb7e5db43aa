"""The run configuration: everything a training worker needs, as one frozen, typed object.

`RunConfig` sits next to `ModelConfig` (the model's shape) and `Plan` (the parallel layout): it holds
those two plus the run options (steps, optimizer, data, logging, checkpoints, diagnostics). The CLI,
the tests and the notebooks all build it the same way, `make_spec(cfg, plan, steps=..., ...)` (or
`RunConfig(model=cfg, plan=plan, ...)`), and every rank's `train_worker(run)` reads it. It is made of
plain frozen dataclasses, strings and numbers, so it pickles for `spawn` and for torchrun alike.

Validation happens once: `problems(world_size)` lists every offending value with what would fit (the
CLI prints them and exits 2 before any process starts); `validate()` raises `PlanError` with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mini3d.config import ModelConfig, Plan, PlanError

COLLECTABLE = ("events", "timeline", "ledger", "activations", "save", "load")


@dataclass(frozen=True)
class RunConfig:
    """One training run: the model, the plan, and how to run, log, save and diagnose it."""

    model: ModelConfig
    """the model's shape"""
    plan: Plan
    """the parallel layout and batch shape"""
    steps: int = 20
    """optimizer steps to reach (the total, also when resuming)"""
    lr: float = 3e-3
    """AdamW learning rate"""
    seed: int = 0
    """seeds the weights and the batches (batches are a function of (seed, step))"""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay"""
    grad_clip: float = 0.0
    """clip the global gradient norm to this (0: off)"""
    log_grad_norm: bool = False
    """record `grad_norm` every step also without clipping"""
    data: str | None = None
    """a text file, a `mini3d prepare` shard directory; None: embedded corpus"""
    tokenizer: str = "bytes"
    """bytes, gpt2, or a tokenizer file's path (mini3d.data.tokenizer)"""
    eval_every: int = 0
    """validation loss every N steps and at the end (0: never)"""
    eval_batches: int = 4
    """global batches of the validation split per evaluation"""
    lr_schedule: str = "constant"
    """constant, cosine or linear decay after the warmup"""
    warmup_steps: int = 0
    """linear warmup from lr/warmup_steps to lr"""
    min_lr: float = 0.0
    """where cosine / linear decay ends"""
    decay_steps: int = 0
    """the step at which the decay reaches min_lr (0: steps)"""
    decay_embeddings: bool = False
    """weight decay on the embeddings too (matrices always, 1-d never)"""
    sample_every: int = 0
    """print a short sample every N steps on the reporting rank (0: never)"""
    tensorboard: str | None = None
    """a directory for TensorBoard event files (reporting rank)"""
    keep_last: int = 0
    """keep only the newest N checkpoints under `save` (0: keep all)"""
    log_every: int = 10
    """plain progress line every N steps when stderr is not a terminal"""
    log_jsonl: str | None = None
    """file for one JSON object per optimizer step (reporting rank)"""
    progress: bool = False
    """show a progress bar on the reporting rank"""
    save: str | None = None
    """checkpoint root directory (saved at the end and every save_every)"""
    save_every: int = 0
    """also save every N steps (0: only at the end)"""
    async_save: bool = False
    """write checkpoints in the background while training goes on (committed when done)"""
    resume: str | None = None
    """a checkpoint directory to continue from (any layout)"""
    init_from_hf: str | None = None
    """a local Hugging Face checkpoint directory to start from"""
    collect: tuple = ()
    """extra measurements to return: events, timeline, ledger, activations, save"""
    run_dir: str | None = None
    """where ranks dump diagnostics (hangs, faults)"""
    hang_timeout: float = 300.0
    """seconds an op may pend before it counts as a hang"""
    inject_fault: str | None = None
    """KIND:RANK:STEP[:ARG], a fault drill (mini3d.diagnose)"""
    memory_budget: str | None = None
    """per-rank memory cap such as '512MiB' (checked at step 1)"""
    estimated: dict | None = None
    """the estimator's bytes per category, for fault reports"""
    stop_on_signal: bool = False
    """Ctrl-C / SIGTERM stop every rank at a step boundary (mini3d.run.stop)"""

    def __post_init__(self):
        object.__setattr__(self, "collect", tuple(self.collect or ()))

    def problems(self, world_size: int | None = None) -> list[str]:
        """Every reason this run cannot start, each naming the value and what would fit."""
        from mini3d.data.corpus import check_data_path

        out = self.plan.problems(self.model, world_size)
        if self.steps < 1:
            out.append(f"steps={self.steps} must be >= 1")
        if self.lr <= 0:
            out.append(f"lr={self.lr} must be > 0")
        if not 0 <= self.weight_decay < float("inf"):  # (nan too: every comparison is False)
            out.append(f"weight_decay={self.weight_decay} must be a finite number >= 0")
        if self.grad_clip < 0:
            out.append(f"grad_clip={self.grad_clip} must be >= 0 (0 turns clipping off)")
        if self.save_every < 0:
            out.append(f"save_every={self.save_every} must be >= 0")
        unknown = [c for c in self.collect if c not in COLLECTABLE]
        if unknown:
            out.append(f"collect={unknown} is unknown (choose from {', '.join(COLLECTABLE)})")
        data_problem = check_data_path(self.data)
        if data_problem:
            out.append(data_problem)
        out += self._tokenizer_problems(data_problem is None)
        out += self._run_problems()
        return out + self._moe_problems() + self._mla_problems()  # ep: any layout (tests/test_ep.py)

    def _mla_problems(self) -> list[str]:
        """The deepseek family's latent attention trains over dp (any ZeRO stage), tp (heads
        split; the latent down-projections replicated, under sequence parallelism their normed
        outputs gathered along the sequence: mini3d.tp.parallelize), pp and cp (ring attention,
        v padded to k's width: mini3d.models.mla)."""
        p, m = self.plan, self.model
        if not m.mla:
            return []
        out = []
        if p.cp > 1 and m.v_head_dim > m.head_dim:
            out.append(f"family='deepseek' with cp={p.cp} needs v_head_dim={m.v_head_dim} <= "
                       f"qk_nope_dim + qk_rope_dim = {m.head_dim} (ring attention sends v padded "
                       f"to k's width)")
        return out

    def _moe_problems(self) -> list[str]:
        """MoE layers run whole (router, experts, shared experts) on every tp rank, or with
        `--expert-tp` their experts split over tp (mini3d.tp.experts), and compose with tp,
        sequence parallelism, pp, cp, ZeRO-1/2/3 (tests/test_moe_splits.py). Refused: what
        would not equal the one-process run, and `--expert-tp` with what is not checked under it
        yet (the Hugging Face import, the samples)."""
        m, p = self.model, self.plan
        if not m.n_experts:
            return []
        out = []
        if p.pp > 1 and m.aux_loss_coef and m.aux_loss_scope == "model":
            out.append(f"aux_loss_coef={m.aux_loss_coef} with aux_loss_scope='model' and "
                       f"pp={p.pp}: the balancing loss pooled over all MoE layers needs every "
                       f"layer's statistics, and a pipeline stage sees only its own; use "
                       f"--aux-loss-scope layer (each layer's own loss, Megatron-Core's) or pp=1")
        untested = [f"--{n.replace('_', '-')}" for n in ("init_from_hf", "sample_every")
                    if getattr(self, n)]
        if p.expert_tp and untested:
            out.append(f"expert_tp with {', '.join(untested)} is refused for now (not checked with "
                       f"the experts split over tp yet); train with --expert-tp without them "
                       f"(checkpoints work: --save / --resume), or without --expert-tp")
        split = [f"cp={p.cp}"] * (p.cp > 1) + ["sequence_parallel"] * p.sequence_parallel
        if m.capacity_factor and split:
            out.append(f"capacity_factor={m.capacity_factor} with {', '.join(split)}: each rank "
                       f"would cap the experts over its own part of the tokens, not the "
                       f"micro-batch's as one process does; use capacity_factor=0 (dropless) or "
                       f"leave out {' and '.join(split)}")
        return out

    def _tokenizer_problems(self, data_ok: bool) -> list[str]:
        from mini3d.data.corpus import has_validation_split, shard_tokenizer
        from mini3d.data.tokenizer import TokenizerError, get_tokenizer, vocab_problems

        try:
            tok = get_tokenizer(self.tokenizer)
        except TokenizerError as e:
            return [str(e)]
        out = vocab_problems(self.model.vocab_size, tok)
        if data_ok and self.data is not None:
            made_with = shard_tokenizer(self.data)
            if made_with is not None and made_with != tok.name:
                out.append(f"--data {self.data!r} was tokenised with {made_with!r}, not "
                           f"--tokenizer {self.tokenizer!r} (leave --tokenizer out)")
        if data_ok and self.eval_every and not has_validation_split(self.data):
            out.append(f"eval_every={self.eval_every} needs a validation split, and --data "
                       f"{self.data!r} has none (make one with mini3d prepare --val-fraction F)")
        return out

    def _run_problems(self) -> list[str]:
        from mini3d.optim import SCHEDULES

        out = []
        for name in ("eval_every", "warmup_steps", "decay_steps", "sample_every", "keep_last",
                     "log_every"):
            if getattr(self, name) < 0:
                out.append(f"{name}={getattr(self, name)} must be >= 0")
        if self.eval_batches < 1:
            out.append(f"eval_batches={self.eval_batches} must be >= 1")
        if self.lr_schedule not in SCHEDULES:
            out.append(f"lr_schedule={self.lr_schedule!r} is unknown (choose {', '.join(SCHEDULES)})")
        if not 0 <= self.min_lr <= self.lr:
            out.append(f"min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        return out

    def validate(self, world_size: int | None = None) -> "RunConfig":
        problems = self.problems(world_size)
        if problems:
            raise PlanError(problems)
        return self

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def schedule(self):
        """The learning-rate schedule of this run (mini3d.optim.LRSchedule)."""
        from mini3d.optim import LRSchedule

        return LRSchedule(self.lr_schedule, self.lr, self.warmup_steps,
                          self.decay_steps or self.steps, self.min_lr)

    def model_dict(self) -> dict:
        return dataclasses.asdict(self.model)


def make_spec(cfg: ModelConfig, plan: Plan, **options) -> RunConfig:
    """A validated `RunConfig` for `cfg` and `plan`; `options` are its fields (a typo is a
    TypeError naming it, a bad value a PlanError naming it)."""
    return RunConfig(model=cfg, plan=plan, **options).validate()


__all__ = ["RunConfig", "make_spec", "COLLECTABLE"]
