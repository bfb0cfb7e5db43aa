"""Small real runs, single process: tokenizers, `mini3d prepare` shards, memory-mapped data, the lr
schedule's closed form, `mini3d sample`, and the bad inputs of all of these (exit 2, naming values).
The multi-process parts (validation across layouts, resume of the schedule, sampling from two
layouts' checkpoints) are in tests/test_runs_parity.py."""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mini3d import cli
from mini3d.optim import LRSchedule
from mini3d.data.tokenizer import TokenizerError, get_tokenizer, train_bpe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 123\n\tdef f(x): return x ** 2\n"


def run_cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "mini3d", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def corpus(path, n_bytes: int) -> str:
    """A text file of about n_bytes from CPython's own help text (no download)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    with open(path, "w") as f:
        f.write((text * (n_bytes // len(text) + 1))[:n_bytes])
    return str(path)


# ---- tokenizers ---------------------------------------------------------------------------------
def local_tiktoken_file(path) -> str:
    """A gpt2-style BPE rank file in tiktoken's format: the 256 bytes plus a few merges."""
    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er"]
    ranks = [bytes([i]) for i in range(256)] + merges
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks))
    return str(path)


def test_each_tokenizer_round_trips_text(tmp_path):
    bpe = train_bpe([TEXT * 20], 300, str(tmp_path / "tokenizer.json"))
    for name in ("bytes", local_tiktoken_file(tmp_path / "gpt2ish.tiktoken"), bpe.name):
        tok = get_tokenizer(name)
        ids = tok.encode(TEXT)
        assert tok.decode(ids) == TEXT, name
        assert max(ids) < tok.vocab_size, name
    assert get_tokenizer("bytes").vocab_size == 256
    tik = get_tokenizer(str(tmp_path / "gpt2ish.tiktoken"))
    assert tik.vocab_size == 256 + 8 + 1  # the merges and <|endoftext|>
    assert len(tik.encode(" the the")) == 2  # the merges are used
    assert bpe.vocab_size == 300 and len(bpe.encode(TEXT)) < len(TEXT.encode())


def test_gpt2_offline_is_a_clear_error(tmp_path, monkeypatch):
    import tiktoken.load

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    with pytest.raises(TokenizerError, match="TIKTOKEN_CACHE_DIR") as e:
        get_tokenizer("gpt2")
    assert "empty-cache" in str(e.value) and ".tiktoken" in str(e.value)


# ---- the lr schedule ----------------------------------------------------------------------------
def test_lr_schedule_values_equal_the_closed_form():
    lr, lo, w, d = 1e-3, 1e-4, 10, 110
    cos = LRSchedule("cosine", lr, w, d, lo)
    lin = LRSchedule("linear", lr, w, d, lo)
    const = LRSchedule("constant", lr, w, d, lo)
    for s in (0, 4, 9):  # warmup: lr * (s + 1) / w, the same for every kind
        assert cos.at(s) == lin.at(s) == const.at(s) == pytest.approx(lr * (s + 1) / w, rel=1e-12)
    assert cos.at(10) == pytest.approx(lr) and cos.at(60) == pytest.approx((lr + lo) / 2)
    assert cos.at(35) == pytest.approx(lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lin.at(60) == pytest.approx((lr + lo) / 2) and lin.at(35) == pytest.approx(lr - (lr - lo) / 4)
    assert cos.at(110) == cos.at(500) == pytest.approx(lo) == lin.at(200)
    assert const.at(50) == const.at(500) == lr
    # a resume warns only when the checkpoint's schedule gives other rates than the flags'
    assert not const.differs_from(LRSchedule("constant", lr, w, 999, 0.0))
    assert cos.differs_from(LRSchedule("cosine", lr, w, 999, lo)) and cos.differs_from(lin)


# ---- prepare, shards, train --data DIR ------------------------------------------------------------
def test_interrupted_prepare_leaves_nothing_train_accepts_and_resumes_to_the_same_shards(
        tmp_path, monkeypatch, capsys):
    """Prepare is killed in the middle of writing its 4th shard file (the write is cut short and
    the process dies): no header, train refuses the directory (exit 2), the .part file is not a
    shard; prepare run again resumes and produces exactly the shards of an uninterrupted run."""
    from mini3d.data import shards

    src = corpus(tmp_path / "corpus.txt", 3_000_000)
    out, fresh = tmp_path / "shards", tmp_path / "fresh"
    args = ["prepare", src, "--tokenizer", "bytes", "--val-fraction", "0.1", "--shard-tokens",
            "200000", "--no-progress"]
    real_write, calls = shards._write_atomic, []

    def killed_mid_write(path, data):
        calls.append(path)
        if len(calls) == 7:  # train-00000, val-00000, progress, train-00001, val, progress, train-00002
            with open(path + ".part", "wb") as f:
                f.write(data[:len(data) // 2])
            raise KeyboardInterrupt  # the process dies here
        real_write(path, data)

    monkeypatch.setattr(shards, "_write_atomic", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        cli.main([*args, "--out", str(out)])
    monkeypatch.setattr(shards, "_write_atomic", real_write)
    assert (out / "train-00002.bin.part").exists() and not (out / "header.json").exists()
    assert cli.main(["train", "--data", str(out), "--steps", "1"]) == 2
    assert "without header.json" in capsys.readouterr().err
    assert cli.main([*args, "--out", str(out)]) == 0
    assert "resuming" in capsys.readouterr().err
    assert cli.main([*args, "--out", str(fresh)]) == 0
    header = json.loads((out / "header.json").read_text())
    assert header == json.loads((fresh / "header.json").read_text())
    for s in header["train"]["shards"] + header["val"]["shards"]:
        assert (out / s["file"]).read_bytes() == (fresh / s["file"]).read_bytes(), s
    assert len(header["train"]["shards"]) > 3
    assert header["train"]["tokens"] + header["val"]["tokens"] == os.path.getsize(src)  # bytes
    assert header["val"]["tokens"] == pytest.approx(0.1 * os.path.getsize(src), rel=0.01)
    assert not (out / "progress.json").exists()
    # a shard cut short after the header was written is refused too
    with open(out / header["train"]["shards"][0]["file"], "r+b") as f:
        f.truncate(10)
    assert cli.main(["train", "--data", str(out), "--steps", "1"]) == 2
    assert "rerun mini3d prepare" in capsys.readouterr().err


def test_prepare_with_a_tokenizer_file_copies_it_and_the_shards_decode_back(tmp_path):
    from mini3d.data.shards import read_header, tokenizer_name

    src = tmp_path / "t.txt"
    src.write_text(TEXT * 300)
    vocab = local_tiktoken_file(tmp_path / "gpt2ish.tiktoken")
    out = tmp_path / "data"
    assert cli.main(["prepare", str(src), "--out", str(out), "--tokenizer", vocab,
                     "--val-fraction", "0", "--no-progress"]) == 0
    header = read_header(str(out))
    assert header["tokenizer"] == "tokenizer.tiktoken" and header["vocab_size"] == 265
    tok = get_tokenizer(tokenizer_name(str(out), header))
    ids = np.fromfile(out / header["train"]["shards"][0]["file"], dtype=header["dtype"])
    assert tok.decode(ids.tolist()) == TEXT * 300 and header["val"]["tokens"] == 0


@pytest.mark.timeout(300)
def test_prepare_bpe_then_train_eval_save_and_sample(tmp_path):
    src = corpus(tmp_path / "corpus.txt", 2_000_000)
    out, ck, log = tmp_path / "bpe", tmp_path / "ck", tmp_path / "log.jsonl"
    r = run_cli("prepare", src, "--out", str(out), "--train-tokenizer", "400", "--no-progress")
    assert r.returncode == 0, r.stderr
    header = json.loads((out / "header.json").read_text())
    assert header["vocab_size"] == 400 and header["dtype"] == "uint16"
    assert header["tokenizer"] == "tokenizer.json" and (out / "tokenizer.json").exists()
    r = run_cli("train", "--data", str(out), "--steps", "12", "--eval-every", "6", "--eval-batches", "2",
                "--lr-schedule", "cosine", "--warmup-steps", "3", "--weight-decay", "0.1",
                "--save", str(ck), "--save-every", "4", "--keep-last", "2", "--log-jsonl", str(log),
                "--grad-clip", "1.0", "--tensorboard", str(tmp_path / "tb"), "--sample-every", "6")
    assert r.returncode == 0, r.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert {"train/loss", "val/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
            "perf/peak_mem_bytes"} <= set(tb.Tags()["scalars"])
    assert [e.step for e in tb.Scalars("val/loss")] == [6, 12]
    assert "float32" in r.stdout and "val loss" in r.stdout and "process RSS" in r.stdout, r.stdout
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in recs if "val_loss" in x] == [6, 12]
    assert all("lr" in x for x in recs) and recs[0]["lr"] == pytest.approx(3e-3 / 3)
    assert "step 10/12" in r.stderr  # plain progress lines: stderr is not a terminal here
    assert "sample at step 6: " in r.stderr and "sample at step 12: " in r.stderr
    assert sorted(os.listdir(ck)) == ["latest", "step-000008", "step-000012"]  # --keep-last 2
    meta = json.loads((ck / "step-000012" / "meta.json").read_text())
    assert meta["model"]["vocab_size"] == 400  # the vocabulary followed the tokenizer
    assert meta["tokenizer"] == str(out / "tokenizer.json")
    assert meta["lr_schedule"] == {"kind": "cosine", "lr": 3e-3, "warmup_steps": 3, "decay_steps": 12,
                                   "min_lr": 0.0}
    greedy = [run_cli("sample", str(ck), "--prompt", "The ", "--max-new-tokens", "20", "--top-k", "1",
                      "--seed", str(s)) for s in (0, 1)]
    assert greedy[0].returncode == 0, greedy[0].stderr
    assert greedy[0].stdout.startswith("The ") and greedy[0].stdout == greedy[1].stdout  # greedy


def _shard_dir(path, n: int) -> None:
    """A one-shard byte-tokenized training set of `n` random tokens in directory `path`."""
    os.makedirs(path, exist_ok=True)
    tokens = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint16)
    tokens.tofile(os.path.join(path, "train-00000.bin"))
    header = {"format": "mini3d-shards/1", "tokenizer": "bytes", "vocab_size": 256, "dtype": "uint16",
              "train": {"tokens": n, "shards": [{"file": "train-00000.bin", "tokens": n}]},
              "val": {"tokens": 0, "shards": []}}
    with open(os.path.join(path, "header.json"), "w") as f:
        json.dump(header, f)


def _train_on_big_shard(path: str, small: str) -> tuple[int, int]:
    """(peak RSS growth over a 2-step run on the shard directory `path`, the shard's bytes). The
    same run on the small shard directory `small` goes first, so that the code and the memory of
    a training step are already counted (a rank forked from mini3d.launch.zygote's server faults
    torch's pages in as it first runs them) and the growth is the data's."""
    import resource

    from mini3d.config import Plan, model_from_preset
    from mini3d.run.train import make_spec, train_worker

    def run(data):
        train_worker(make_spec(model_from_preset("tiny"), Plan(global_batch=4, seq_len=64), steps=2,
                               data=data))

    run(small)
    size = os.path.getsize(os.path.join(path, "train-00000.bin"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run(path)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, size


@pytest.mark.timeout(120)
def test_rank_memory_does_not_grow_with_the_shard(tmp_path):
    """A 128 MiB shard (64Mi tokens) trained on for 2 steps of 4 windows of 64 tokens: the rank's
    peak RSS grows by far less than the shard, because only the windows of its micro-batches are
    paged in (a reader that loads the whole shard per window, tried by hand, grew by 4.5 GB). A
    window of 128 bytes may map a whole page-cache folio of the file (up to 2 MiB on current
    kernels: 3 x 8 windows of batch 8 mapped 44 MiB here), so the 8 windows may map up to 16 MiB;
    the bound, a quarter of the shard, is twice that and an eighth of a whole-shard read."""
    from mini3d.launch.launcher import launch

    n = 1 << 26
    _shard_dir(tmp_path / "big", n)
    _shard_dir(tmp_path / "small", 1 << 16)
    (growth, size), = launch(_train_on_big_shard, 1, str(tmp_path / "big"), str(tmp_path / "small"),
                             device="cpu", timeout=100)
    assert size == 2 * n
    assert growth < size / 4, (growth / 2**20, size / 2**20)


def test_mfu_uses_the_known_peak_of_the_gpu(monkeypatch):
    import torch

    from mini3d.config import PRESETS, Plan
    from mini3d.cost.flops import model_flops
    from mini3d.run.report import model_flops_utilisation, peak_flops_per_rank

    assert peak_flops_per_rank(torch.device("cpu"), "bf16") is None  # no MFU on CPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops_per_rank(torch.device("cuda", 0), "bf16") == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-40GB")
    assert peak_flops_per_rank(torch.device("cuda", 0), "float32") == 19.5e12
    plan = Plan(tp=2, dp=4, global_batch=32, seq_len=1024)
    cfg = PRESETS["gpt2-small"]
    assert model_flops_utilisation(cfg, plan, 0.5, 989e12) == pytest.approx(
        model_flops(cfg, plan) / 0.5 / (8 * 989e12))


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needles", [
    (["train", "--tokenizer", "sentencepiece-xl"], ["--tokenizer 'sentencepiece-xl'", "no such file"]),
    (["train", "--vocab", "200"], ["vocab_size=200 is smaller than tokenizer 'bytes'", "(256)"]),
    (["train", "--eval-every", "5"], ["eval_every=5 needs a validation split", "--data None"]),
    (["train", "--lr-schedule", "step"], ["lr_schedule='step' is unknown"]),
    (["train", "--min-lr", "1", "--lr", "0.1"], ["min_lr=1.0 must be in [0, lr=0.1]"]),
    (["train", "--seq-len", "256"], ["seq_len=256 exceeds the model's max_seq_len=128"]),
    (["train", "--sample-every", "5", "--pp", "2", "--micro-batches", "2"], ["--sample-every 5 needs pp=1"]),
    (["prepare", "/no/such/dir", "--out", "/tmp/x"], ["INPUT '/no/such/dir' does not exist"]),
    (["prepare", __file__, "--out", "/tmp/x", "--train-tokenizer", "100"], ["--train-tokenizer 100"]),
    (["prepare", __file__, "--out", "/tmp/x", "--val-fraction", "1.5"], ["--val-fraction 1.5"]),
    (["sample", "/no/such/ckpt"], ["CKPT '/no/such/ckpt'"]),
])
def test_bad_input_exits_2_naming_values(argv, needles, capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(cli, "launch_train", boom)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    assert "Nothing was started" in err


def test_missing_header_and_max_seq_len(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "launch_train", lambda *a, **k: pytest.fail("started"))
    assert cli.main(["train", "--data", str(tmp_path)]) == 2
    assert f"--data {str(tmp_path)!r} is a directory without header.json" in capsys.readouterr().err
    # --max-seq-len raises the limit that refused --seq-len 256 above; a --vocab far above the
    # tokenizer's warns about the unused parameters
    assert cli.main(["train", "--seq-len", "256", "--max-seq-len", "256", "--vocab", "50257",
                     "--dry-run"]) == 0
    assert "6.4M parameters of the embedding and head are never used" in capsys.readouterr().err
