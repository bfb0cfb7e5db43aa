import json
import math
import os
import subprocess
import sys

import pytest

from mini3d import cli
from mini3d.config import PRESETS, Plan
from mini3d.data.corpus import load_tokens, unigram_entropy
from mini3d.run.train import make_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "mini3d", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.mark.timeout(300)
def test_train_20_steps_loss_falls_and_is_reproducible(tmp_path):
    log = tmp_path / "log.jsonl"
    r = run_cli("train", "--steps", "20", "--log-jsonl", str(log), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "done: 20 steps" in r.stdout
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in recs] == list(range(1, 21))
    for x in recs:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "peak_mem_bytes"} <= set(x)
        assert x["step_time_s"] > 0 and x["tokens_per_s"] > 0 and x["peak_mem_bytes"] > 0
    first = sum(x["loss"] for x in recs[:3]) / 3
    last = sum(x["loss"] for x in recs[-3:]) / 3
    assert first > math.log(256) - 0.5  # starts near uniform over bytes
    assert last < first - 1.0, (first, last)
    # same seed, same losses (second run in-process through the same launcher)
    again = cli.launch_train(make_spec(PRESETS["tiny"], Plan(), steps=20, seed=3), 1, "cpu", 120)
    assert [x["loss"] for x in again[0]["records"]] == [x["loss"] for x in recs]


def test_unigram_entropy_of_corpus_is_sane():
    h = unigram_entropy(load_tokens())
    assert 2.5 < h < 4.0  # English text in bytes: about 3 nats


@pytest.mark.parametrize("argv,needles", [
    (["--world-size", "4", "--tp", "2"], ["world size 4 != tp*pp*dp = 2*1*1 = 2"]),
    (["--tp", "3"], ["tp=3 does not divide n_heads=4"]),
    (["--pp", "5", "--micro-batches", "5", "--global-batch", "10"], ["pp=5", "exceeds n_layers=4"]),
    (["--dp", "2", "--global-batch", "6", "--micro-batches", "2"],
     ["global_batch=6 does not split into dp=2 x micro_batches=2"]),
    (["--data", "/no/such/file.txt"], ["/no/such/file.txt", "does not exist"]),
    (["--schedule", "zigzag"], ["schedule='zigzag' is unknown"]),
    (["--grad-clip", "-1"], ["grad_clip=-1.0 must be >= 0"]),
    (["--attention", "flash9"], ["attention='flash9' is unknown (choose explicit, sdpa)"]),
])
def test_bad_input_exits_2_naming_values_before_any_process(argv, needles, capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(cli, "launch_train", boom)
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    assert "Nothing was started" in err


@pytest.mark.timeout(120)
def test_bad_input_exit_code_from_the_console():
    r = run_cli("train", "--tp", "3", "--heads", "4")
    assert r.returncode == 2 and "tp=3 does not divide n_heads=4" in r.stderr
