"""Where `mini3d train`'s model comes from: the model flags (a preset, fields overridden by flags),
or a checkpoint (`--resume`) or a Hugging Face directory (`--init-from-hf`), which IS the model.

A checkpoint's meta.json and an HF config.json carry every `ModelConfig` field (family, layers,
hidden, heads, key/value heads, d_ff, vocabulary, max_seq_len, norm eps, activation, tied head,
rope base and scaling), so a run that starts from one takes them all from it, and a flag may change
none of them: each sets a weight's shape or what the weights compute. A model flag that agrees with
the source is accepted (scripts that retype the shape keep working); one that differs is exit 2
naming the flag, the source's value and what may change instead (the run: layout, batch, sequence
length, steps, optimizer, data), checked before any process starts.
"""

from __future__ import annotations

from mini3d.config import ModelConfig, PlanError, model_from_dict

IGNORED = ("name", "dropout")  # a report label, and a training option no weight depends on


def source_model(args) -> tuple[ModelConfig | None, str | None, list[str]]:
    """(the model, the words that name its source, problems) of --resume or --init-from-hf;
    (None, None, []) when neither is given or the checkpoint cannot be read (the resume checks,
    `check_resume`, name what is wrong with it; the flags' model stands in meanwhile)."""
    if args.init_from_hf:
        from mini3d.checkpoint.hf import HFError, hf_config

        if args.resume:
            return None, None, ["--init-from-hf and --resume both say where the weights come from "
                                "(give one)"]
        try:
            return hf_config(args.init_from_hf), f"--init-from-hf {args.init_from_hf!r}", []
        except HFError as e:
            return None, None, [f"--init-from-hf: {e}"]
    if not args.resume:
        return None, None, []
    from mini3d.checkpoint.store import latest_dir, read_meta

    ckpt = latest_dir(args.resume)
    try:
        return model_from_dict(read_meta(ckpt)["model"]), f"checkpoint {ckpt!r}", []
    except (TypeError, KeyError, OSError, ValueError):  # no checkpoint, or a broken meta.json
        return None, None, []


def _given(args) -> list[tuple[str, object, str]]:
    """(flag as typed, value, field) of every model flag on the command line."""
    out = []
    from mini3d.run.flags import flag_fields, flag_name

    for field in (f.name for f in flag_fields(ModelConfig) if f.name not in IGNORED):
        flag, value = flag_name(field), getattr(args, field, None)
        value = tuple(value) if isinstance(value, list) else value  # --rope-scaling
        if value is not None:
            out.append((flag.replace("--", "--no-", 1) if value is False else flag, value, field))
    return out


def flag_conflicts(args, cfg: ModelConfig, source: str, flags_model) -> list[str]:
    """One problem naming every model flag of `args` that differs from `cfg`, the model of
    `source`: each flag with the source's value, then what may change instead. `flags_model()`
    builds the model the flags describe (for --model: the preset's fields no flag overrides)."""
    clashes, named = [], set()
    for flag, value, field in _given(args):
        named.add(field)
        if value != getattr(cfg, field):
            shown = "" if isinstance(value, bool) else f" {value}"
            clashes.append(f"{flag}{shown} (it has {field}={getattr(cfg, field)!r})")
    if getattr(args, "model", None) is not None:
        try:
            preset = flags_model()
        except PlanError as e:
            return e.problems
        fields = [f for f in ModelConfig.__dataclass_fields__ if f not in named and f not in IGNORED]
        differ = [f for f in fields if getattr(preset, f) != getattr(cfg, f)]
        if differ:
            clashes.append(f"--model {args.model} (" + ", ".join(
                f"{f}={getattr(preset, f)!r} where it has {getattr(cfg, f)!r}" for f in differ) + ")")
    if not clashes:
        return []
    return [f"{source} is the model, and a flag may not change it: {'; '.join(clashes)}; leave "
            f"the model flags out (family, layers, hidden, heads, kv heads, d_ff, vocab, "
            f"max_seq_len, norm eps, activation, tied head and rope settings all come from it); "
            f"what may change is the run: the layout (--tp --pp --dp --cp --zero --schedule), the "
            f"batch (--global-batch --micro-batches, --seq-len up to its max_seq_len="
            f"{cfg.max_seq_len}), --steps, the optimizer, the data and what is saved or logged"]


def run_model(args, flags_model) -> tuple[ModelConfig | None, bool, list[str]]:
    """(the model `mini3d train` runs, whether it is fixed by a checkpoint or an HF directory,
    problems): the source's model with its flags checked against it, else `flags_model()`'s
    (which may raise PlanError). The model is None when the source itself is bad input."""
    cfg, source, problems = source_model(args)
    if problems:
        return None, True, problems
    if cfg is None:
        return flags_model(), False, []
    return cfg, True, flag_conflicts(args, cfg, source, flags_model)


__all__ = ["source_model", "flag_conflicts", "run_model"]
