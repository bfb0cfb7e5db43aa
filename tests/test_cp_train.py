"""Context parallelism in the trainer: cp layouts equal the single-process reference (loss and
every gradient over several AdamW steps, float64 with test_3d's tight F64 bounds), and Plan's
cp checks.

One 4-process gloo job runs every layout (tests/cp_workers.run_cp_layouts; then, in the same job,
the checkpoint runs below; the job is shared with tests/test_3d.py and test_pairs.py: tests/conftest.py
four_rank_job): cp=2 and cp=4 alone,
tp2 x cp2 (with sequence parallelism), cp2 x pp2 (1F1B, sdpa block math, full recompute; and
interleaved), cp2 x dp2 with ZeRO-1, ZeRO-3, and ZeRO-2 in bf16 (test_3d's bf16 tolerances). The reference and the tolerances are those of tests/test_3d.py (same model,
seed, batches): the layouts differ from it only in summation order (ring hops and the log-sum-exp
combination add ~1e-7 relative per op; see test_cp.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini3d.config import Plan
from tests.test_3d import (BF16, BASE, CFG, F64, SEED, SHARED_4_RANK_TIMEOUT, STEPS, check_bf16,
                           check_float32, reference)

F64_BASE = {**BASE, "dtype": "float64"}  # exact layouts: float64, test_3d's F64 bounds

CASES = [
    ("cp2", Plan(cp=2, micro_batches=2, **F64_BASE)),
    ("cp4", Plan(cp=4, **F64_BASE)),
    ("tp2-cp2-sp", Plan(tp=2, cp=2, micro_batches=2, sequence_parallel=True, **F64_BASE)),
    ("cp2-pp2-1f1b-sdpa-full", Plan(cp=2, pp=2, micro_batches=2, attention="sdpa",
                                    recompute="full", **F64_BASE)),
    ("cp2-dp2-zero1", Plan(cp=2, dp=2, zero=1, micro_batches=2, **F64_BASE)),
    ("cp2-pp2-interleaved-v2", Plan(cp=2, pp=2, schedule="interleaved", virtual_stages=2,
                                          micro_batches=2, **F64_BASE)),
    ("cp2-dp2-zero3", Plan(cp=2, dp=2, zero=3, micro_batches=2, **F64_BASE)),
    ("cp2-dp2-zero2-bf16", Plan(cp=2, dp=2, zero=2, micro_batches=2, dtype="bf16", **BASE)),
]


def checkpoint_specs(root: str) -> list[dict]:
    """test_cp_checkpoints_save_and_resume_in_any_layout's runs: cp2 x dp2 ZeRO-1 saves at steps 2
    and 4 under `root`, then resumes step 2 in the same layout and as cp=4."""
    import os

    from mini3d.run.train import make_spec

    step2 = os.path.join(root, "step-000002")
    mk = lambda plan, **kw: make_spec(CFG, plan, steps=4, seed=SEED, **kw)  # noqa: E731
    saver = Plan(cp=2, dp=2, zero=1, micro_batches=2, **BASE)
    return [mk(saver, save=root, save_every=2), mk(saver, resume=step2),
            mk(Plan(cp=4, **BASE), resume=step2)]


def four_rank_parts(tmp_dir: str) -> list[tuple]:
    """This module's part of the shared 4-rank launch (tests/conftest.py four_rank_job, with
    tests/test_3d.py's and test_pairs.py's 4-rank runs): the cp layouts of CASES, then
    checkpoint_specs(tmp_dir/run)."""
    import os

    cases = [{"name": n, "plan": dataclasses.asdict(p)} for n, p in CASES]
    return [("cp_layouts", cases, dataclasses.asdict(CFG)),
            ("specs", checkpoint_specs(os.path.join(tmp_dir, "run")))]


FOUR_RANK_TIMEOUT = 400


@pytest.fixture(scope="module")
def four_rank_runs(four_rank_job):
    """(root, every rank's run_cp_layouts results of CASES, every rank's checkpoint_specs(root)
    results), from the shared 4-rank launch."""
    import os

    tmp_dir, (layouts, checkpoints) = four_rank_job[__name__]
    return os.path.join(tmp_dir, "run"), layouts, checkpoints


@pytest.mark.timeout(SHARED_4_RANK_TIMEOUT)
def test_cp_layouts_equal_the_reference(four_rank_runs):
    results = four_rank_runs[1]
    refs = {"float64": reference(STEPS, dtype=torch.float64), "bf16": reference(STEPS)}
    for name, plan in CASES:
        ref = refs[plan.dtype]
        mine = [r for per_rank in results for r in per_rank if r["name"] == name]
        assert mine, name
        losses = {tuple(r["losses"]) for r in mine}
        assert len(losses) == 1, (name, losses)
        tol = F64["loss"] if plan.dtype == "float64" else BF16["loss"]
        assert list(losses.pop()) == pytest.approx(ref[0], abs=tol), name
        if plan.dtype == "float64":
            check_float32(name, plan, results, ref, bounds=F64)
        else:
            check_bf16(name, plan, results, ref)
        # the ring really ran: per layer and micro-batch 3cp-2 sends (see test_cp.py)
        layers = CFG.n_layers // plan.pp
        want = (3 * plan.cp - 2) * layers * plan.micro_batches * STEPS * (2 if plan.recompute == "full" else 1)
        assert all(r["cp_sends"] >= (3 * plan.cp - 2) * layers * plan.micro_batches * STEPS
                   and r["cp_sends"] <= want for r in mine), (name, [r["cp_sends"] for r in mine])


def test_cp_plan_problems_name_the_values():
    assert not Plan(cp=2, **BASE).problems(CFG, 2)
    msg = " ".join(Plan(cp=3, global_batch=16, seq_len=16).problems(CFG, 3))
    assert "cp=3 needs seq_len=16 to split into 2*cp = 6 equal chunks" in msg
    msg = " ".join(Plan(cp=2, tp=2, **BASE).problems(CFG, 2))
    assert "world size 2 != tp*cp*pp*dp = 2*2*1*1 = 4" in msg
    msg = " ".join(Plan(cp=2, recompute="selective", **BASE).problems(CFG, 2))
    assert "ring attention" in msg and "--recompute none or full" in msg
    assert "cp=0 must be a positive integer" in " ".join(Plan(cp=0, **BASE).problems(CFG))


@pytest.mark.timeout(300)
def test_train_cli_with_cp_matches_the_reference_run(tmp_path, capsys):
    """`mini3d train --cp 2 --seq-len 128` and `--tp 2 --cp 2 --pp 2` give the losses of the
    one-process run within 1e-4 (float32; measured ~1e-6: summation order only)."""
    import json

    from mini3d import cli
    from mini3d.config import PRESETS
    from mini3d.run.train import make_spec

    common = ["--seq-len", "128", "--global-batch", "4", "--micro-batches", "2", "--steps", "3",
              "--seed", "1", "--no-progress"]
    ref = cli.launch_train(make_spec(PRESETS["tiny"], Plan(seq_len=128, global_batch=4,
                                                             micro_batches=2), steps=3, seed=1),
                           1, "cpu", 120)
    want = [r["loss"] for r in ref[0]["records"]]
    for layout in (["--cp", "2"], ["--tp", "2", "--cp", "2", "--pp", "2"]):
        log = tmp_path / f"{'-'.join(layout)}.jsonl"
        assert cli.main(["train", *layout, *common, "--log-jsonl", str(log)]) == 0
        assert "cp2" in capsys.readouterr().out
        got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        assert got == pytest.approx(want, abs=1e-4), (layout, got, want)


def test_train_cli_refuses_a_cp_that_does_not_split_the_sequence(capsys):
    from mini3d import cli

    assert cli.main(["train", "--cp", "3", "--seq-len", "128"]) == 2
    err = capsys.readouterr().err
    assert "cp=3 needs seq_len=128 to split into 2*cp = 6 equal chunks" in err
    assert "Nothing was started" in err


@pytest.mark.timeout(SHARED_4_RANK_TIMEOUT)
def test_cp_checkpoints_save_and_resume_in_any_layout(four_rank_runs):
    """One 4-process job (shared with the layouts above): cp2 x dp2 ZeRO-1 saves at steps 2 and 4
    (the ZeRO shards are gathered over cp x dp; one cp rank writes), then resumes step 2 in the same
    layout (bitwise the same losses) and as cp=4 (float32 summation order only: 1e-5, as
    tests/test_checkpoint.py)."""
    import os

    from mini3d.run.train import reporter_records

    root, _, out = four_rank_runs
    step2 = os.path.join(root, "step-000002")
    losses = [[r["loss"] for r in reporter_records([x[i] for x in out])] for i in range(3)]
    full, same, cp4 = losses
    assert len(full) == 4 and same == full[2:]
    assert cp4 == pytest.approx(full[2:], abs=1e-5) and abs(full[2] - full[3]) > 1e-3
    # sharded: every rank wrote its share of the full state (and rank 0 the DCP index)
    assert sorted(os.listdir(step2)) == sorted([".metadata", "meta.json",
                                                *(f"__{r}_0.distcp" for r in range(4))])
