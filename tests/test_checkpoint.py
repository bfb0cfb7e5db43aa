"""Checkpoints through the trainer: identical continuation, resharded resume, crash-safe saves,
refusal of a checkpoint of another model shape, and weights_only loading.

Three launches carry the multi-process part (a module fixture): 8 ranks (the 8-rank launch this
module shares with the 3d files: tests/conftest.py eight_rank_job) train tp2 x pp2 x dp2 for 4
steps saving at steps 2 and 4 with --async-save (the write in the background, committed at the
next save and at the end), then (same processes) resume the step-2 checkpoint in the same layout
up to step 4; 4 ranks resume the step-2 checkpoint as tp1 x pp1 x dp4 (ZeRO-1) and as
tp4 x pp1 x dp1, each rank reading only what its share needs, and one process resumes it alone.
The checkpoints are sharded (DCP: one `__{rank}_0.distcp` per rank).
"""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from mini3d import cli
from mini3d.checkpoint.store import latest_dir, read_meta, read_states
from mini3d.config import Plan, model_from_preset
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec, reporter_records
from tests.test_3d import SHARED_LAUNCH_TIMEOUT
from tests.threed_workers import run_specs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The CLI has no --max-seq-len flag, so the model is the `tiny` preset made smaller by flags:
# `mini3d train --hidden 32` builds exactly this shape (a resume from the CLI must match it).
CFG = model_from_preset("tiny", d_model=32, d_ff=128, name="tiny+custom")
MODEL_FLAGS = ["--hidden", "32"]
RUN = dict(global_batch=16, seq_len=16)
SEED, LR = 5, 3e-3


def spec(plan: Plan, steps: int, **kw) -> dict:
    return make_spec(CFG, plan, steps=steps, lr=LR, seed=SEED, weight_decay=0.1, **kw)


def eight_rank_specs(tmp_dir: str) -> list[dict]:
    """This module's part of the shared 8-rank launch (tests/conftest.py eight_rank_job): tp2 x pp2
    x dp2 ZeRO-1 saves at steps 2 and 4 under tmp_dir/run, then resumes step 2 in the same layout."""
    root = os.path.join(tmp_dir, "run")
    p3d = Plan(tp=2, pp=2, dp=2, zero=1, micro_batches=4, **RUN)
    return [spec(p3d, 4, save=root, save_every=2, async_save=True, collect=("save",)),
            spec(p3d, 4, resume=os.path.join(root, "step-000002"))]


EIGHT_RANK_TIMEOUT = 200
# whichever test of the session first uses eight_rank_job pays for the shared launch, and the first
# test using `runs` then for the 4-rank launch
RUNS_TIMEOUT = SHARED_LAUNCH_TIMEOUT + 240


@pytest.fixture(scope="module")
def runs(eight_rank_job):
    tmp_dir, first = eight_rank_job[__name__]
    root = os.path.join(tmp_dir, "run")
    step2 = os.path.join(root, "step-000002")
    resharded = launch(run_specs, 4, [spec(Plan(dp=4, zero=1, micro_batches=2, **RUN), 4, resume=step2,
                                           collect=("load",)),
                                      spec(Plan(tp=4, zero=0, **RUN), 4, resume=step2, collect=("load",))],
                       device="cpu", timeout=200)
    alone = launch(run_specs, 1, [spec(Plan(micro_batches=2, **RUN), 4, resume=step2)], device="cpu",
                   timeout=100)
    losses = lambda results, i: [r["loss"] for r in reporter_records([x[i] for x in results])]
    return {"root": root, "full": losses(first, 0), "same": losses(first, 1),
            "dp4": losses(resharded, 0), "tp4": losses(resharded, 1), "one": losses(alone, 0),
            "save_stats": [(x[0]["coords"], x[0]["save_stats"]) for x in first],
            "load_stats": {name: [x[i]["load_stats"] for x in resharded]
                           for i, name in enumerate(("dp4", "tp4"))}}


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_resume_in_the_same_layout_continues_bit_identically(runs):
    assert len(runs["full"]) == 4 and len(runs["same"]) == 2  # the resumed run did steps 3 and 4
    # Bitwise: the checkpoint holds the fp32 weights and AdamW moments and step exactly, the data of
    # step s is a pure function of (seed, s), and the same layout sums in the same order.
    assert runs["same"] == runs["full"][2:]
    assert runs["full"][3] < runs["full"][0]  # it trains (a frozen model would also "continue")


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_resharded_resume_gives_the_same_next_losses(runs):
    # Another layout sums in another order (tp all-reduces, dp averaging): float32 rounding, ~1e-7
    # relative per op, so the next losses agree to 1e-5 (measured ~1e-6), not bitwise.
    for layout in ("dp4", "tp4", "one"):
        assert len(runs[layout]) == 2
        assert runs[layout] == pytest.approx(runs["full"][2:], abs=1e-5), layout
    # and the comparison is not blind: the loss changes by far more than 1e-5 per step
    assert abs(runs["full"][2] - runs["full"][3]) > 1e-3


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_checkpoint_layout_on_disk(runs):
    root = runs["root"]
    assert pathlib.Path(root, "latest").read_text().strip() == "step-000004"
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-000002", "step-000004"]
    ckpt = latest_dir(root)
    ranks = [f"__{r}_0.distcp" for r in range(8)]
    assert sorted(os.listdir(ckpt)) == sorted([".metadata", "meta.json", *ranks])
    meta = read_meta(ckpt)
    assert meta["step"] == 4 and meta["model"]["d_model"] == 32
    model = read_states(ckpt)["model"]
    from mini3d.models.transformer import GPT

    ref = dict(GPT(CFG, SEED).named_parameters())
    assert sorted(model) == sorted(ref)  # full, unsharded tensors under the reference names
    assert all(model[n].shape == ref[n].shape for n in ref)
    # every rank wrote its own share: each of a stage's 4 files holds ~1/4 of the stage's bytes
    for stage in (0, 1):
        sizes = [meta["files"][f]["bytes"] for f in ranks if meta["files"][f]["stage"] == stage]
        assert len(sizes) == 4 and max(sizes) < 1.3 * min(sizes), sizes
        assert sum(os.path.getsize(os.path.join(ckpt, f)) for f in ranks) == sum(
            meta["files"][f]["bytes"] for f in ranks)


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_no_rank_holds_its_stages_full_state_on_the_host(runs):
    # (ShareStats, counted as the writer keeps each share: a rank holds its 1/4 of the stage plus
    # one full tensor in flight, never the stage's weights and moments whole)
    by_stage = {}
    for coords, stats in runs["save_stats"]:
        by_stage.setdefault(coords["pp"], []).append(stats)
        assert stats["kept_bytes"] <= stats["full_bytes"] / 4 + stats["largest_full_bytes"], stats
        assert stats["peak_host_bytes"] <= stats["kept_bytes"] + stats["largest_full_bytes"], stats
        assert stats["peak_host_bytes"] < stats["full_bytes"] / 2, stats
    for stage, stats in by_stage.items():  # and the shares add up to the stage's full state
        assert len(stats) == 4 and sum(s["kept_bytes"] for s in stats) <= stats[0]["full_bytes"]
        assert sum(s["kept_bytes"] for s in stats) > 0.9 * stats[0]["full_bytes"], (stage, stats)


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_a_resume_reads_only_what_its_rank_needs(runs):
    """Each resuming rank reads from the files only the stored chunks its share needs
    (LazyStates.stats, DCP's own reads counted): under dp4 ZeRO-1 the tensors its optimizer shard
    holds (state.in_shard; the all-gather after the restore brings the rest), under tp4 the rows
    its column- and vocab-parallel slices take (rank_share). Reading every tensor, as each rank did
    before, reads the whole checkpoint on every rank; the resumed losses (above) show that what
    was left unread (NaN) never reached the model."""
    # measured: dp4 25-30% of the stored bytes per rank (a quarter, plus the tensors that straddle
    # two shards); tp4 72-76% (a row-parallel weight, split along dim 1, is read whole)
    bound = {"dp4": 0.35, "tp4": 0.85}
    for name, stats in runs["load_stats"].items():
        stored = stats[0]["bytes_stored"]
        assert all(s["bytes_stored"] == stored for s in stats)
        assert max(s["bytes_read"] for s in stats) < bound[name] * stored, (name, stats)
    assert sum(s["bytes_read"] for s in runs["load_stats"]["dp4"]) < 1.3 * stored


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_dcp_tools_read_a_mini3d_checkpoint_as_the_one_process_model(runs, tmp_path):
    # torch's own DCP converter gives the full tensors under the reference names, and the one-process
    # model built from them computes the loss the 8-rank run reported at the step after the save
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from mini3d.data.corpus import Batches, load_tokens
    from mini3d.models.transformer import GPT

    out = str(tmp_path / "full.pt")
    dcp_to_torch_save(os.path.join(runs["root"], "step-000002"), out)
    full = torch.load(out, weights_only=True)
    states = read_states(os.path.join(runs["root"], "step-000002"))
    assert sorted(full["model"]) == sorted(states["model"])
    assert all(torch.equal(full["model"][n], states["model"][n]) for n in states["model"])
    assert all(torch.equal(full["optim"][n][m], states["optim"][n][m]) for n in states["optim"]
               for m in ("exp_avg", "exp_avg_sq"))
    model = GPT(CFG, SEED)
    model.load_state_dict(full["model"], strict=False)
    assert set(dict(model.named_parameters())) <= set(full["model"])
    x, y = Batches(load_tokens(), 16, 16, SEED).global_batch_at(2)  # the batch of step 3
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert loss == pytest.approx(runs["full"][2], abs=1e-5)


def _train_cmd(*args):
    return [sys.executable, "-m", "mini3d", "train", *MODEL_FLAGS, "--global-batch", "16",
            "--seq-len", "16", "--seed", str(SEED), "--no-progress", *args]


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(runs, tmp_path):
    root = str(tmp_path / "run")
    shutil.copytree(runs["root"], root)  # latest -> step-000004
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MINI3D_TEST_PAUSE_IN_SAVE="60")
    # pp=2: two rank files are written by two ranks, each pausing 60 s after its file
    proc = subprocess.Popen(_train_cmd("--pp", "2", "--micro-batches", "2", "--steps", "5",
                                       "--resume", root, "--save", root),
                            env=env, cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tmp = os.path.join(root, ".tmp-step-000005")
    try:
        deadline = time.monotonic() + 120
        while not (os.path.isdir(tmp) and any(n.endswith(".distcp") for n in os.listdir(tmp))):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks (same session)
        proc.wait(30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(root, "step-000005"))
    assert pathlib.Path(root, "latest").read_text().strip() == "step-000004"
    assert latest_dir(root) == os.path.join(root, "step-000004")
    assert read_states(latest_dir(root))["model"]  # loadable
    # and a resume from it is accepted (checks run in-process; no training started)
    ckpt, problems = cli.check_resume(root, CFG, 6)
    assert ckpt == os.path.join(root, "step-000004") and problems == []
    # the next save removes the half-written directory
    from mini3d.checkpoint.store import CheckpointWriter

    CheckpointWriter(root, 6).begin()
    assert not os.path.exists(tmp) and os.path.isdir(os.path.join(root, ".tmp-step-000006"))


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_resume_of_another_model_shape_exits_2_naming_both_values(runs, capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(cli, "launch_train", boom)
    code = cli.main(["train", *MODEL_FLAGS, "--layers", "6", "--heads", "8", "--steps", "6",
                     "--resume", runs["root"]])
    err = capsys.readouterr().err
    assert code == 2
    assert "--layers 6 (it has n_layers=4)" in err  # the checkpoint is the model: flags name it
    assert "--heads 8 (it has n_heads=4)" in err
    assert "Nothing was started" in err
    # the matching shape passes these checks (and would start processes)
    with pytest.raises(AssertionError, match="a process was started"):
        cli.main(["train", *MODEL_FLAGS, "--steps", "6", "--seed", str(SEED), "--global-batch", "16",
                  "--seq-len", "16", "--resume", runs["root"]])  # the same run: no --allow-change


class NotATensor:
    """Only plain pickle can rebuild this; torch.load(weights_only=True) must refuse it."""


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_loading_uses_weights_only(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = str(tmp_path / "ck")
    shutil.copytree(os.path.join(runs["root"], "step-000004"), ckpt)
    # DCP's index is a pickle: a foreign class in it is refused (the tensor data DCP reads with
    # torch.load(weights_only=True))
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump((md, NotATensor()), f)
    with pytest.raises(pickle.UnpicklingError, match="refused to load"):
        read_states(ckpt)
    # an older checkpoint of stage files (as `mini3d import-hf` writes) loads weights_only too
    old = str(tmp_path / "old")
    os.makedirs(old)
    dcp_to_torch_save(os.path.join(runs["root"], "step-000004"), os.path.join(old, "stage0.pt"))
    shutil.copy(os.path.join(runs["root"], "step-000004", "meta.json"), old)
    assert sorted(read_states(old)["model"]) == sorted(read_states(latest_dir(runs["root"]))["model"])
    part = torch.load(os.path.join(old, "stage0.pt"), weights_only=True)
    part["payload"] = NotATensor()
    torch.save(part, os.path.join(old, "stage0.pt"))
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only"):
        read_states(old)
    # every torch.load in the checkpoint code is weights_only (Trainer.load goes through read_states)
    import inspect
    import re

    from mini3d.checkpoint import dcp_read, sharded, store as checkpoint
    from mini3d.run import saving, train

    for mod in (checkpoint, train, saving, sharded, dcp_read):
        calls = re.findall(r"torch\.load\(.*", inspect.getsource(mod))
        assert all("weights_only=True" in c for c in calls), (mod.__name__, calls)
        assert calls or mod is not checkpoint, mod.__name__
