"""What a run does besides its training steps: validation, samples, and what a checkpoint records.

`periodic` runs every N steps inside `train_worker` (validation loss on every rank, a text sample);
`checkpoint_meta` is the meta.json of a checkpoint (with the tokenizer and the lr schedule), and
`resumed_schedule` reads that schedule back, so a resumed run continues it exactly.
"""

from __future__ import annotations

from .checkpoint import read_meta
from .evaluate import evaluate
from .optim import LRSchedule
from .run_config import RunConfig


def periodic(trainer, run: RunConfig, done: int, val_batches, tok, report) -> dict:
    """What happens every N steps besides training: the validation loss (all ranks, collective)
    and a sample of the model's text (--sample-every: collective over tp and dp, pp = 1)."""
    out = {}
    if val_batches is not None and (done % run.eval_every == 0 or done == run.steps):
        out["val_loss"] = evaluate(trainer, val_batches, run.eval_batches)
    if run.sample_every and done % run.sample_every == 0:
        from .sample import sample_during_training

        report.text(done, sample_during_training(trainer, tok, run.seed))
    return out


def resumed_schedule(run: RunConfig):
    """The lr schedule to follow: the resumed checkpoint's (so it continues exactly), else the run's."""
    if run.resume:
        saved = read_meta(run.resume).get("lr_schedule")
        if saved:
            return LRSchedule(**saved)
    return run.schedule()


def checkpoint_meta(run: RunConfig, done: int, schedule, tok) -> dict:
    return {"step": done, "model": run.model_dict(), "plan": run.plan.to_dict(), "seed": run.seed,
            "data_position": done, "lr_schedule": schedule.as_dict(), "tokenizer": tok.name}
