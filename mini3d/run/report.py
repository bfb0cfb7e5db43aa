"""What the reporting rank shows of a run: progress bar or plain lines, JSONL, TensorBoard.

The reporting rank (last pipeline stage, tp_rank 0, dp_rank 0) owns one `RunReport`. Each optimizer
step's record goes to `--log-jsonl` (one JSON object per line), to the progress bar on a terminal,
or, when standard error is not a terminal (nohup, Slurm logs), to a plain line every `log_every`
steps, and to TensorBoard event files with `--tensorboard DIR` (torch.utils.tensorboard, which
needs the optional `tensorboard` package). Other ranks get a report that does nothing.
"""

from __future__ import annotations

import json
import sys

# JSONL key -> TensorBoard tag
TB_TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "peak_mem_bytes": "perf/peak_mem_bytes"}


class TensorBoardMissing(ImportError):
    pass


def tensorboard_problem(path: str | None) -> str | None:
    """Exit-2 text when --tensorboard is asked for but is not a writable directory (a file, below
    one, read-only) or the package is missing."""
    if not path:
        return None
    import importlib.util

    from mini3d.exits import dir_target

    where = dir_target("--tensorboard", path)
    if where:
        return where[0]
    if importlib.util.find_spec("tensorboard") is None:
        return (f"--tensorboard {path!r} needs the `tensorboard` package, which is not installed "
                f"(pip install 'mini3d[text]' or pip install tensorboard)")
    return None


def peak_flops_per_rank(device, dtype: str) -> float | None:
    """The hardware peak of this rank's device when mini3d knows it (its cost/hardware presets,
    matched by CUDA device name), else None (CPUs, unknown GPUs): MFU is then left out."""
    if device.type != "cuda":
        return None
    from mini3d.cost.hardware import PRESETS
    from mini3d.launch.devices import device_name

    name = device_name(device).upper()
    for key, hw in PRESETS.items():
        model, mem = key.split("-")
        if model in name and (mem.rstrip("GB") in name or model != "A100"):
            return hw.flops(dtype)
    return None


def model_flops_utilisation(cfg, plan, step_time_s: float, peak: float | None) -> float | None:
    """Useful model FLOPs of one step (mini3d.cost.flops.model_flops) over what the ranks could do."""
    if not peak:
        return None
    from mini3d.cost.flops import model_flops

    return model_flops(cfg, plan) / step_time_s / (peak * plan.world_size)


class RunReport:
    def __init__(self, run, active: bool, start: int, desc: str):
        self.run, self.active = run, active
        self.log = self.bar = self.tb = None
        self.plain = active and run.progress and not sys.stderr.isatty()
        if not active:
            return
        if run.log_jsonl:
            self.log = open(run.log_jsonl, "a" if start else "w")
        if run.progress and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=run.steps, initial=start, desc=desc, unit="step")
        if run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(run.tensorboard, purge_step=start + 1 if start else None)

    def step(self, rec: dict):
        if not self.active:
            return
        if self.log:
            self.log.write(json.dumps(rec) + "\n")
            self.log.flush()
        shown = {"loss": f"{rec['loss']:.4f}", "lr": f"{rec['lr']:.2e}"}
        if "val_loss" in rec:
            shown["val_loss"] = f"{rec['val_loss']:.4f}"
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(shown)
        every = self.run.log_every or 1
        if self.plain and (rec["step"] % every == 0 or rec["step"] == self.run.steps or "val_loss" in rec):
            items = " ".join(f"{k} {v}" for k, v in shown.items())
            print(f"step {rec['step']}/{self.run.steps} {items} {rec['tokens_per_s']:,.0f} tokens/s",
                  file=sys.stderr, flush=True)
        if self.tb:
            for key, tag in TB_TAGS.items():
                if rec.get(key) is not None:
                    self.tb.add_scalar(tag, rec[key], rec["step"])

    def text(self, step: int, sample: str):
        """A sample of the model's text (--sample-every)."""
        if not self.active:
            return
        line = f"sample at step {step}: {sample!r}"
        if self.bar:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        if self.tb:
            self.tb.add_text("sample", sample, step)

    def close(self):
        for h in (self.bar, self.log, self.tb):
            if h is not None:
                h.close()


__all__ = ["RunReport", "tensorboard_problem", "TB_TAGS"]
