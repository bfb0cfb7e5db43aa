"""The command line, generated from the configuration dataclasses: every field of `ModelConfig`,
`Plan` and `RunConfig` is a flag (`--kebab-case` of its name, or a name of `RENAMED`), typed by its
annotation, its help the field's attribute docstring (the string literal under it) with the
dataclass default shown. A field added to one of them is a flag of every command that builds it,
with no code here; `NOT_FLAGS` names the fields that are not, and why.

`configs_from_args(args)` is the one way from parsed flags to (ModelConfig, Plan): `mini3d train`,
its dry run, `estimate` and `plan` all call it; `mini3d schedule` (mini3d.run.schedule_cli) builds
its four Plan flags here too. The model is a preset (`--model`,
default tiny) with the given fields overridden; the rest of the model follows the way it always
did in `mini3d train`: `d_ff` is 4 x `d_model` when `--hidden` is given without `--ffn`, and a
preset with one key/value head per query head keeps that when `--heads` changes.

Choices (schedule, dtype, ...) are listed in the help but checked by `Plan.problems` and
`ModelConfig.problems`, once, so that a bad value is named with every other one (exit 2).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap

from mini3d.config import (ATTENTION, COMPILE, DTYPES, FAMILIES, PRESETS, RECOMPUTE, ModelConfig,
                           Plan, model_from_preset)
from mini3d.models.config import PlanError
from mini3d.models.families import ACTIVATIONS, FAMILY_FEATURES
from mini3d.run.config import RunConfig
from mini3d.schedule_kinds import SCHEDULES

DEFAULT_PRESET = "tiny"
RENAMED = {"n_layers": "--layers", "d_model": "--hidden", "n_heads": "--heads",
           "vocab_size": "--vocab", "d_ff": "--ffn", "n_kv_heads": "--kv-heads",
           "explicit_head_dim": "--head-dim", "n_experts": "--experts", "n_shared_experts": "--shared-experts"}
NOT_FLAGS = {
    "name": "the report label: the preset's name, '+custom' when a field is overridden",
    "model": "the model flags build it", "plan": "the plan flags build it",
    "progress": "on unless --no-progress (a command-line default, not the dataclass's)",
    "collect": "measurements a test or notebook asks a run to return",
    "estimated": "filled in by the run from the estimator",
    "stop_on_signal": "`mini3d train` always stops at a step boundary on Ctrl-C / SIGTERM",
}
CHOICES = {"schedule": SCHEDULES, "recompute": RECOMPUTE, "dtype": DTYPES, "attention": ATTENTION,
           "compile": COMPILE, "zero": (0, 1, 2, 3), "family": FAMILIES,
           "grad_dtype": ("float32", "bf16"),
           "activation": tuple(a for acts in ACTIVATIONS.values() for a in acts)}
METAVARS = {"save": "DIR", "resume": "DIR", "run_dir": "DIR", "tensorboard": "DIR",
            "log_jsonl": "FILE", "init_from_hf": "HF_DIR", "memory_budget": "SIZE",
            "inject_fault": "KIND:RANK:STEP[:ARG]", "hang_timeout": "SECONDS"}
EXTRA = {"compile": dict(nargs="?", const="inductor", metavar="BACKEND"),
         "rope_scaling": dict(nargs=4, type=float, metavar=("FACTOR", "LOW", "HIGH", "CONTEXT")),
         "yarn": dict(nargs=6, type=float, metavar=("FACTOR", "CONTEXT", "BETA_FAST", "BETA_SLOW",
                                                    "MSCALE", "MSCALE_ALL_DIM"))}
GIVEN_ONLY = {"tokenizer": "None: the one --data DIR or the resumed checkpoint was made with, else bytes"}
TYPES = {"int": int, "float": float, "str": str, "str | None": str}


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: its attribute docstring, on one line} from the source of dataclass `cls`."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and \
                isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flag_name(field: str) -> str:
    return RENAMED.get(field, "--" + field.replace("_", "-"))


def flag_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in NOT_FLAGS]


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else None


def _type(f: dataclasses.Field) -> str:
    """The annotation as written ('int', 'str | None'), also where it is not a string."""
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _metavar(f: dataclasses.Field) -> str:
    if f.name in CHOICES:
        return "{" + ",".join(map(str, CHOICES[f.name])) + "}"
    return METAVARS.get(f.name) or {"int": "N", "float": "X"}.get(_type(f), "TEXT")


def add_flags(group, cls, defaults: bool = True, skip=(), given_only=None):
    """A flag per field of `cls` (dest: the field's name). `defaults`: the dataclass's own;
    without, every flag defaults to None (not given) and the help shows the default preset's.
    `given_only` adds {field: the help's default text} to GIVEN_ONLY's None-unless-given fields."""
    docs, given_only_ = field_docs(cls), {**GIVEN_ONLY, **(given_only or {})}
    for f in flag_fields(cls):
        if f.name in skip:
            continue
        shown = _default(f) if defaults else getattr(PRESETS[DEFAULT_PRESET], f.name, None)
        help_ = docs.get(f.name, f.name).replace("%", "%%")
        help_ += f" (default: {given_only_.get(f.name, repr(shown))})" if defaults else \
            f" ({DEFAULT_PRESET}: {shown!r})"
        kw = dict(dest=f.name, help=help_,
                  default=_default(f) if defaults and f.name not in given_only_ else None)
        if _type(f) == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=TYPES.get(_type(f), str), metavar=_metavar(f))
            kw.update(EXTRA.get(f.name, {}))
        group.add_argument(flag_name(f.name), **kw)


def add_model_flags(p):
    g = p.add_argument_group("model (a preset, optionally with fields overridden)")
    g.add_argument("--model", help=f"preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}")
    add_flags(g, ModelConfig, defaults=False)


def add_plan_flags(p, skip=(), given_only=None):
    add_flags(p.add_argument_group("parallel plan"), Plan, skip=skip, given_only=given_only)


def add_run_flags(p):
    g = p.add_argument_group("run")
    add_flags(g, RunConfig)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def model_overrides(args) -> dict:
    """The ModelConfig fields given on the command line."""
    return {f.name: getattr(args, f.name) for f in flag_fields(ModelConfig)
            if getattr(args, f.name, None) is not None}


def model_from_args(args) -> ModelConfig:
    """The preset of --model (default tiny) with the given fields overridden (PlanError for an
    unknown preset; see the module docstring for what follows from what)."""
    preset = getattr(args, "model", None) or DEFAULT_PRESET
    over = model_overrides(args)
    base = PRESETS.get(preset)
    if "family" in over:  # the family's own activation, and full attention unless --kv-heads
        over.setdefault("activation", "")
        over.setdefault("n_kv_heads", 0)
        feature = FAMILY_FEATURES.get(over["family"])  # qwen2's biases, qwen3's q/k norms
        if feature and over.get(feature) is False:
            raise PlanError([f"--family {over['family']} --no-{feature.replace('_', '-')}: "
                             f"{over['family']} is the llama family with {feature} on (use --family llama)"])
    if "n_heads" in over and "n_kv_heads" not in over and base and base.n_kv_heads == base.n_heads:
        over["n_kv_heads"] = 0  # still one key/value head per query head
    if "d_model" in over and "d_ff" not in over:
        over["d_ff"] = 0  # 4 x d_model
    if over:
        over["name"] = f"{preset}+custom"
    return model_from_preset(preset, **over)


def plan_from_args(args, **derived) -> Plan:
    """The Plan of the given flags; fields without a flag on this command (or given in `derived`)
    take `derived`'s values, else the dataclass defaults."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Plan)
             if getattr(args, f.name, None) is not None}
    return Plan(**{**given, **derived})


def configs_from_args(args, **derived) -> tuple[ModelConfig, Plan]:
    """(ModelConfig, Plan) of the parsed flags: the one path every command takes."""
    return model_from_args(args), plan_from_args(args, **derived)


def run_fields(args) -> dict:
    """The RunConfig fields given as flags (everything but the model and the plan)."""
    out = {f.name: getattr(args, f.name) for f in flag_fields(RunConfig)
           if hasattr(args, f.name)}
    out["progress"] = not getattr(args, "no_progress", True)
    return out


__all__ = ["field_docs", "flag_name", "flag_fields", "add_flags", "add_model_flags",
           "add_plan_flags", "add_run_flags", "model_from_args", "plan_from_args",
           "configs_from_args", "run_fields", "model_overrides", "NOT_FLAGS", "RENAMED"]
