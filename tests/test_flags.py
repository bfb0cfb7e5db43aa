"""One flag builder (mini3d/run/flags.py): every config field is a flag with its docstring and
default as help, and `train`, its dry run, `estimate` and `plan` build the same configs from the
same flags (issue #29, items 1-2); exit codes come from the exception classes (item 5)."""

import argparse
import dataclasses
import importlib
import json
import shutil
from dataclasses import dataclass

import pytest

import mini3d.cost.planner  # noqa: F401  (imported before a test patches the estimate it binds)
from mini3d import cli
from mini3d.config import ModelConfig, Plan, PlanError
from mini3d.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NONFINITE, EXIT_OOM, BadInput, exit_code_of
from mini3d.run import flags
from mini3d.run.config import RunConfig


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(parser) -> dict:
    """{dest: action} of every option of `parser`."""
    return {a.dest: a for a in parser._actions if a.option_strings}


@pytest.mark.parametrize("command,classes", [("train", (ModelConfig, Plan, RunConfig)),
                                             ("estimate", (ModelConfig, Plan)),
                                             ("plan", (ModelConfig,))])
def test_every_field_is_a_flag_with_its_docstring_and_default(command, classes):
    opts = _options(_subparser(command))
    for cls in classes:
        docs = flags.field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in flags.NOT_FLAGS:
                continue
            assert f.name in opts, f"{cls.__name__}.{f.name} has no flag in `mini3d {command}`"
            assert flags.flag_name(f.name) in opts[f.name].option_strings
            assert docs[f.name].split()[0] in opts[f.name].help  # the docstring is the help
            if cls is not ModelConfig and f.default is not dataclasses.MISSING:
                assert f"(default: {f.default!r})" in opts[f.name].help or f.name in flags.GIVEN_ONLY


def test_every_field_has_a_docstring():
    for cls in (ModelConfig, Plan, RunConfig):
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in flags.field_docs(cls)]
        assert not missing, f"{cls.__name__} fields without an attribute docstring: {missing}"


@dataclass(frozen=True)
class _NewFields:
    n_lanterns: int = 0
    """lanterns per layer (0: none)"""
    moe_router: str = "topk"
    """how tokens choose experts"""
    aux_loss: bool = False
    """add the load-balancing loss"""


def test_a_new_field_gets_a_flag_without_code_elsewhere():
    p = argparse.ArgumentParser()
    flags.add_flags(p, _NewFields)
    help_text = p.format_help()
    assert "--n-lanterns N" in help_text and "lanterns per layer (0: none) (default: 0)" in help_text
    args = p.parse_args(["--n-lanterns", "8", "--moe-router", "x", "--aux-loss"])
    assert (args.n_lanterns, args.moe_router, args.aux_loss) == (8, "x", True)
    assert p.parse_args(["--no-aux-loss"]).aux_loss is False


def test_help_has_a_description_per_command_and_run_flags_have_help():
    parser = cli.build_parser()
    top = parser.format_help()
    for name in ("prepare", "sample", "import-hf", "export-hf", "estimate", "plan"):
        assert name in parser.description, name
        assert name in top
    for name in ("estimate", "plan"):
        assert _subparser(name).description
    opts = _options(_subparser("train"))
    for dest, default in (("steps", 20), ("lr", 3e-3), ("seed", 0)):
        assert opts[dest].help and f"(default: {default!r})" in opts[dest].help


class _Captured(Exception):
    pass


def _unsearched(argv: list) -> list:
    """`argv` without the flags `mini3d plan` searches over instead (mini3d.run.cost_cli.SEARCHED)."""
    from mini3d.run.cost_cli import SEARCHED

    searched = {flags.flag_name(f) for f in SEARCHED}
    out, words = [], iter(argv)
    for w in words:
        if w in searched:
            if w != "--sequence-parallel":
                next(words)
        else:
            out.append(w)
    return out


def _capture(monkeypatch, command: str, argv: list) -> tuple:
    """(ModelConfig, Plan) that `command` hands to the code it drives, from `argv`."""
    got = {}
    if command in ("train", "dry-run"):
        def launch(spec, *a, **k):
            got.update(model=spec.model, plan=spec.plan, run_dir=spec.run_dir)
            raise _Captured

        def dry(cfg, plan, *a, **k):
            got.update(model=cfg, plan=plan)
            raise _Captured

        monkeypatch.setattr(cli, "launch_train", launch)
        monkeypatch.setattr(importlib.import_module("mini3d.run.dryrun"), "dry_run", dry)
        words = ["train", *argv, "--device", "cpu"] + (["--dry-run"] if command == "dry-run" else [])
    elif command == "estimate":
        def estimate(cfg, plan, *a, **k):
            got.update(model=cfg, plan=plan)
            raise _Captured

        monkeypatch.setattr(importlib.import_module("mini3d.cost.model"), "estimate_cost", estimate)
        words = ["estimate", *argv]
    else:
        def search(cfg, gpus, hw, batch, seq, dtype, top_k=5, attention="explicit"):
            got.update(model=cfg, plan=dict(global_batch=batch, seq_len=seq, dtype=dtype,
                                            attention=attention))
            raise _Captured

        monkeypatch.setattr(importlib.import_module("mini3d.cost.planner"), "search", search)
        words = ["plan", *_unsearched(argv), "--gpus", "8"]
    with pytest.raises(_Captured):
        cli.main(words)
    if got.get("run_dir"):
        shutil.rmtree(got["run_dir"], ignore_errors=True)
    return got["model"], got["plan"]


FLAG_SETS = [
    [],
    ["--model", "tiny", "--heads", "8", "--hidden", "128"],
    ["--hidden", "128", "--layers", "2", "--tp", "2", "--dp", "2", "--micro-batches", "2",
     "--global-batch", "8", "--zero", "1", "--seq-len", "32", "--dtype", "float64"],
    ["--model", "small", "--family", "llama", "--kv-heads", "2", "--ffn", "200", "--pp", "2",
     "--micro-batches", "4", "--schedule", "gpipe", "--recompute", "full", "--attention", "sdpa"],
    ["--model", "small", "--tie-embeddings", "--rope-base", "500000", "--max-seq-len", "512",
     "--seq-len", "256", "--sequence-parallel", "--tp", "2", "--bucket-mb", "0.5"],
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", FLAG_SETS, ids=lambda a: " ".join(a) or "defaults")
def test_train_dry_run_estimate_and_plan_build_identical_configs(argv, monkeypatch, capsys):
    model, plan = _capture(monkeypatch, "train", argv)
    assert (model, plan) == _capture(monkeypatch, "dry-run", argv)
    assert (model, plan) == _capture(monkeypatch, "estimate", argv)
    planned_model, batch = _capture(monkeypatch, "plan", argv)
    assert planned_model == model
    assert batch == {k: getattr(plan, k) for k in batch}
    if "--hidden" in argv and "--ffn" not in argv:
        assert model.d_ff == 4 * model.d_model  # d_ff follows --hidden
    if "--heads" in argv and "--kv-heads" not in argv:
        assert model.n_kv_heads == model.n_heads  # one key/value head per query head still


def test_issue_29_estimate_heads_8_hidden_128_counts_what_train_builds(monkeypatch, capsys):
    argv = ["--model", "tiny", "--heads", "8", "--hidden", "128"]
    assert cli.main(["estimate", *argv, "--json"]) == 0  # it used to say n_kv_heads=4 != n_heads=8
    out = json.loads(capsys.readouterr().out)
    model, _ = _capture(monkeypatch, "train", argv)
    assert (model.n_heads, model.n_kv_heads, model.d_model, model.d_ff) == (8, 8, 128, 512)
    assert out["params"] == out["memory_per_stage_bytes"][0]["n_params"] == model.n_params() == 875264


def test_model_flags_are_overrides_of_the_preset():
    args = _subparser("train").parse_args(["--model", "llama-3.1-8b", "--layers", "2"])
    cfg = flags.model_from_args(args)
    assert cfg.n_layers == 2 and cfg.n_kv_heads == 8 and cfg.d_ff == 14336  # the rest: the preset's
    assert cfg.name == "llama-3.1-8b+custom"
    with pytest.raises(PlanError, match="model='nope' is not a preset"):
        flags.model_from_args(_subparser("train").parse_args(["--model", "nope"]))


def test_exit_codes_come_from_the_exception_classes():
    from mini3d.diagnose.faults import OutOfMemory
    from mini3d.run.records import NonFiniteLoss

    assert exit_code_of(PlanError(["tp=3 does not divide n_heads=4"])) == EXIT_BAD_INPUT
    assert exit_code_of(BadInput("x")) == EXIT_BAD_INPUT
    assert exit_code_of(NonFiniteLoss("nan")) == EXIT_NONFINITE
    assert OutOfMemory.exit_code == EXIT_OOM
    assert exit_code_of(RuntimeError("boom")) == exit_code_of(KeyboardInterrupt()) == EXIT_FAILED


def test_a_rank_error_with_its_own_exit_code_is_reported_by_its_class(capsys):
    from mini3d.launch.jobs import WorkerError
    from mini3d.run.outcome import report_worker_error

    e = WorkerError(1, "NonFiniteLoss: the loss is nan at step 3", "tb", EXIT_NONFINITE,
                    "the loss is nan at step 3")
    assert report_worker_error(e, [], None) == EXIT_NONFINITE
    assert capsys.readouterr().err.strip() == "mini3d train: the loss is nan at step 3"
    plain = WorkerError(0, "NonFiniteLoss: looks like one, but raised as a plain error")
    assert report_worker_error(plain, [], None) == EXIT_FAILED  # no prefix matching


def _diverge():
    from mini3d.run.records import NonFiniteLoss

    raise NonFiniteLoss("the loss is nan at step 1 (a test)")


@pytest.mark.timeout(120)
def test_the_launcher_carries_the_exit_code_of_the_class_a_rank_raised():
    from mini3d.launch.jobs import WorkerError
    from mini3d.launch.launcher import launch

    with pytest.raises(WorkerError) as e:
        launch(_diverge, 1, device="cpu", timeout=90)
    assert e.value.exit_code == EXIT_NONFINITE and e.value.rank == 0
    assert e.value.text == "the loss is nan at step 1 (a test)"


def test_schedule_flags_are_plan_fields():
    """`mini3d schedule` (mini3d.run.schedule_cli) builds its four flags from Plan's fields through
    the flag builder: the same words, dests and help as `mini3d train`'s."""
    opts, train, docs = _options(_subparser("schedule")), _options(_subparser("train")), flags.field_docs(Plan)
    assert set(opts) == {"help", "pp", "micro_batches", "schedule", "virtual_stages", "transfers", "json"}
    for field in ("pp", "micro_batches", "schedule"):
        assert opts[field].option_strings == train[field].option_strings
        assert opts[field].help == train[field].help and opts[field].help.startswith(docs[field])
        assert opts[field].default == getattr(Plan(), field) and "(default: " in opts[field].help
    assert opts["virtual_stages"].option_strings == train["virtual_stages"].option_strings
    assert opts["virtual_stages"].default is None and "(default: the kind's" in opts["virtual_stages"].help
