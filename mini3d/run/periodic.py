"""What a run does besides its training steps: validation, samples, and what a checkpoint records.

`periodic` runs every N steps inside `train_worker` (validation loss on every rank, a text sample);
`save_checkpoint` saves at a step boundary, on the save's clock rather than the hang clock (with
--async-save the write goes on in the background and `finish_saves` commits the last one);
`checkpoint_meta` is the meta.json of a checkpoint (with the tokenizer and the lr schedule), and
`resumed_schedule` reads that schedule back, so a resumed run continues it exactly.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from mini3d.checkpoint.store import read_meta
from mini3d.diagnose.save_clock import checkpoint_bytes
from mini3d.run.evaluate import evaluate
from mini3d.optim import LRSchedule
from mini3d.run.config import RunConfig


def periodic(trainer, run: RunConfig, done: int, val_batches, tok, report) -> dict:
    """What happens every N steps besides training: the validation loss (all ranks, collective)
    and a sample of the model's text (--sample-every: collective over tp and dp, pp = 1)."""
    out = {}
    if val_batches is not None and (done % run.eval_every == 0 or done == run.steps):
        out["val_loss"] = evaluate(trainer, val_batches, run.eval_batches)
    if run.sample_every and done % run.sample_every == 0:
        from mini3d.run.sample import sample_during_training

        report.text(done, sample_during_training(trainer, tok, run.seed))
    return out


def save_checkpoint(trainer, run: RunConfig, done: int, schedule, tok, diag):
    """The collective save of step `done` (and the pruning to --keep-last), timed by the watchdog
    against the save's own bound, not --hang-timeout (mini3d.diagnose.save_clock): a slow disk
    is not a hang, a save stuck far past its bound still is."""
    with diag.saving(checkpoint_bytes(run.model.n_params()), done):
        trainer.save(run.save, done, checkpoint_meta(run, done, schedule, tok), run.keep_last,
                     background=run.async_save)


def finish_saves(trainer, run: RunConfig, diag):
    """--async-save: wait for the background write and commit it (end of training, or a stop on
    a signal), on the save's clock too."""
    from mini3d.run.saving import pending_step

    step = pending_step(trainer)
    if step is not None:
        with diag.saving(checkpoint_bytes(run.model.n_params()), step):
            trainer.finish_saves()


def resumed_schedule(run: RunConfig):
    """The lr schedule to follow: the resumed checkpoint's (so it continues exactly), else the run's."""
    if run.resume:
        saved = read_meta(run.resume).get("lr_schedule")
        if saved:
            kept = LRSchedule(**saved)
            asked = run.schedule()
            if kept.differs_from(asked) and dist.get_rank() == 0:
                print(f"mini3d train: resuming {run.resume} with its lr schedule {kept.as_dict()}, "
                      f"not the flags' {asked.as_dict()} (a checkpoint's schedule continues "
                      f"exactly; to change it, start a new run from its weights)", file=sys.stderr,
                      flush=True)
            return kept
    return run.schedule()


def checkpoint_meta(run: RunConfig, done: int, schedule, tok) -> dict:
    import os

    data = os.path.abspath(run.data) if run.data else None  # a resume checks it (run_checks)
    return {"step": done, "model": run.model_dict(), "plan": run.plan.to_dict(), "seed": run.seed,
            "data": data, "data_position": done, "lr_schedule": schedule.as_dict(), "tokenizer": tok.name}
