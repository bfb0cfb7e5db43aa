"""Features that are right alone but were wrong in pairs (issue 28): each layout below equals the
one-process run of the same flags (same seed, same unsharded weights) over several AdamW steps in
float32: the logged losses, the logged `grad_norm` (before clipping) and the validation losses.

Two launches: one 4-process job runs every layout in turn (tests/threed_workers.run_specs; the job
tests/conftest.py four_rank_job shares with tests/test_3d.py and test_cp_train.py), one
1-process job runs the references. Every spec comes from the `mini3d train` flags themselves
(`mini3d.cli.validated_train`), so what is tested is what the command line runs:

* tied embeddings with pp=2 and cp=2 or dp=2, ZeRO-0/1/2: the tied matrix's gradient is the sum of
  its two pipeline ends, assembled over ZeRO's own shard group (cp x dp, not dp alone);
* `--eval-every` with cp > 1 (and tp, pp): validation batches are cut into the zig-zag chunks;
* `--grad-clip` with cp x dp under ZeRO-0/1/2/3: the global norm spans exactly the ranks that hold
  distinct gradient pieces; the clip binds (every norm > 0.5), so a wrong norm changes the losses;
* the loss and validation means over cp x dp (every layout logs them), and weight decay (0.1 on
  every layout; on the tied embedding's two ends too in one) on ZeRO's cp x dp shards.

Tolerances: the layouts differ from one process only in float32 summation order (ring attention's
log-sum-exp merge, dp averages, tp all-reduces, chunked micro-batch means): ~1e-6 per loss after
4 steps (measured <= 7e-7 on losses, 1.4e-6 relative on norms); 2e-5 absolute on losses and 1e-4
relative on norms leave a margin while a wrong reduction is far outside it: the tied gradient
assembled over dp alone gave a step-2 loss of 5.1072 against 5.0783, a clip norm summed over dp
alone moves the losses by 5e-4 (Adam is nearly scale-free, so clipping moves them little) and the
norm itself leaves out the other cp rank's shards.
"""

from __future__ import annotations

import pathlib

import pytest

from mini3d.launch.launcher import launch
from mini3d.run.train import reporter_records
from tests.test_3d import SHARED_4_RANK_TIMEOUT
from tests.threed_workers import run_specs

COMMON = ["--steps", "4", "--seq-len", "32", "--global-batch", "8", "--micro-batches", "2",
          "--seed", "3", "--eval-every", "2", "--eval-batches", "2", "--weight-decay", "0.1",
          "--no-progress"]
TIED = ["--tie-embeddings", "--family", "llama"]
CLIP = ["--grad-clip", "0.5"]
# (name, the reference's flags, the layout's flags): 4 ranks each
LAYOUTS = [
    ("tied-cp2-pp2-zero1", TIED, ["--cp", "2", "--pp", "2", "--zero", "1"]),
    ("tied-dp2-pp2-zero1", TIED, ["--dp", "2", "--pp", "2", "--zero", "1"]),
    ("tied-cp2-pp2-zero0", TIED, ["--cp", "2", "--pp", "2", "--zero", "0"]),
    ("tied-cp2-pp2-zero2-clip-decay-emb", TIED + CLIP + ["--decay-embeddings"],
     ["--cp", "2", "--pp", "2", "--zero", "2"]),
    ("eval-cp2-tp2", [], ["--cp", "2", "--tp", "2"]),
    *[(f"clip-cp2-dp2-zero{z}", CLIP, ["--cp", "2", "--dp", "2", "--zero", str(z)])
      for z in (0, 1, 2, 3)],
]
REFERENCES = sorted({tuple(ref) for _, ref, _ in LAYOUTS})


def spec_of(flags: list, data: str, run_dir: str):
    """The RunConfig `mini3d train FLAGS` would run (validated as the command line does)."""
    from mini3d.cli import build_parser, validated_train

    args = build_parser().parse_args(["train", *flags, *COMMON, "--data", data, "--device", "cpu",
                                      "--run-dir", run_dir])
    job = validated_train(args)
    assert not isinstance(job, int), (flags, job)
    return job[0]


def four_rank_parts(tmp_dir: str) -> list[tuple]:
    """This module's part of the shared 4-rank launch (tests/conftest.py four_rank_job): prepares
    the corpus under tmp_dir (in this process), then the LAYOUTS runs on it."""
    from pydoc_data.topics import topics

    from mini3d import cli

    root = pathlib.Path(tmp_dir)
    src = root / "corpus.txt"
    src.write_text("".join(topics[k] for k in sorted(topics))[:200_000])
    data = str(root / "data")
    assert cli.main(["prepare", str(src), "--out", data, "--val-fraction", "0.2",
                     "--no-progress"]) == 0
    return [("specs", [spec_of(ref + lay, data, str(root / name)) for name, ref, lay in LAYOUTS])]


FOUR_RANK_TIMEOUT = 500
# the first test using `runs` may pay for the shared 4-rank launch, then for the 1-rank one
RUNS_TIMEOUT = SHARED_4_RANK_TIMEOUT + 240


@pytest.fixture(scope="module")
def runs(four_rank_job):
    tmp_dir, (four,) = four_rank_job[__name__]
    root = pathlib.Path(tmp_dir)
    refs = [spec_of(list(ref), str(root / "data"), str(root / f"ref{i}"))
            for i, ref in enumerate(REFERENCES)]
    one = launch(run_specs, 1, refs, device="cpu", timeout=200)
    out = {name: reporter_records([r[i] for r in four]) for i, (name, _, _) in enumerate(LAYOUTS)}
    ref = {r: reporter_records([x[i] for x in one]) for i, r in enumerate(REFERENCES)}
    return out, {name: ref[tuple(r)] for name, r, _ in LAYOUTS}


def _check(got: list, want: list, name: str):
    assert [r["step"] for r in got] == [1, 2, 3, 4], name
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=2e-5), name
    val = lambda recs: [r["val_loss"] for r in recs if "val_loss" in r]  # noqa: E731
    assert len(val(want)) == 2 and val(got) == pytest.approx(val(want), abs=2e-5), name
    if "grad_norm" in want[0]:
        norms = [r["grad_norm"] for r in want]
        assert min(norms) > 0.5, (name, norms)  # the clip binds at every step
        assert [r["grad_norm"] for r in got] == pytest.approx(norms, rel=1e-4), name


@pytest.mark.timeout(RUNS_TIMEOUT)
@pytest.mark.parametrize("name", [n for n, _, _ in LAYOUTS if n.startswith("tied")])
def test_tied_embeddings_with_pipeline_and_cp_or_dp_equal_one_process(runs, name):
    _check(runs[0][name], runs[1][name], name)


@pytest.mark.timeout(RUNS_TIMEOUT)
def test_validation_with_cp_and_tp_equals_one_process(runs):
    _check(runs[0]["eval-cp2-tp2"], runs[1]["eval-cp2-tp2"], "eval-cp2-tp2")


@pytest.mark.timeout(RUNS_TIMEOUT)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_grad_clip_with_cp_and_dp_equals_one_process(runs, zero):
    name = f"clip-cp2-dp2-zero{zero}"
    _check(runs[0][name], runs[1][name], name)


@pytest.mark.parametrize("flags", [
    ["--cp", "2", "--pp", "2"],
    # above RECORD_MAX_PARAMS: the narrow copy's short sequence must still split into 2*cp chunks
    ["--model", "gpt2-124m", "--seq-len", "128", "--cp", "4", "--pp", "2", "--tp", "2",
     "--sequence-parallel"],
])
def test_dry_run_proves_a_cp_pipeline_step(capsys, flags):
    """The recorded step feeds each cp rank its zig-zag chunks (the pipeline's boundary shape is a
    cp rank's (b, s/cp, h)), as train_worker does."""
    from mini3d import cli

    code = cli.main(["train", "--dry-run", *flags, "--micro-batches", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    cp = flags[flags.index("--cp") + 1]
    assert "communication: deadlock-free" in out and f" cp={cp} pp=2" in out, out
