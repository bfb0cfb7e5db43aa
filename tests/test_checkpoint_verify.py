"""Checkpoints that cannot lie: per-file checksums and shapes verified before any worker starts
(exit 2 naming the file), a complete checkpoint after a kill at any moment of a save, a full disk
reported as such with the partial directory removed (also when the write runs in the background,
--async-save), and loads that read only the files a rank needs, in bounded batches, with the RNG
state put back. The checkpoints are sharded (DCP: a `__{rank}_0.distcp` file per rank and the
`.metadata` index).

One 2-rank job (pp=2) writes the checkpoints every test starts from; the corruption table runs
the CLI's checks in-process (no process may start: `launch_train` is replaced by a tripwire)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from mini3d import cli
from mini3d.checkpoint.store import CheckpointWriter, latest_dir, read_states, seal_meta
from mini3d.checkpoint.verify import verify_checkpoint
from mini3d.config import Plan, model_from_preset
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec
from tests.ckpt_workers import resume_and_watch_loads

FLAGS = ["--hidden", "32", "--global-batch", "4", "--seq-len", "16", "--no-progress"]
CFG = model_from_preset("tiny", d_model=32, d_ff=128, name="tiny+custom")
PLAN = Plan(pp=2, micro_batches=2, global_batch=4, seq_len=16)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ck") / "ck")
    assert cli.main(["train", *FLAGS, "--pp", "2", "--micro-batches", "2", "--steps", "2",
                     "--save", root, "--save-every", "1"]) == 0
    return root


def _no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(cli, "launch_train", boom)


def _flip_byte(ckpt):
    path = os.path.join(ckpt, "__1_0.distcp")
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data
    Path(path).write_bytes(bytes(data))
    return "__1_0.distcp: sha256 differs"


def _truncate(ckpt):
    path = os.path.join(ckpt, "__0_0.distcp")
    os.truncate(path, os.path.getsize(path) // 2)
    return "__0_0.distcp holds"


def _missing(ckpt):
    os.remove(os.path.join(ckpt, "__1_0.distcp"))
    return "__1_0.distcp is missing"


def _garbage_meta(ckpt):
    Path(ckpt, "meta.json").write_text("{not json")
    return "meta.json is not valid JSON"


def _meta_without_step(ckpt):
    meta = json.loads(Path(ckpt, "meta.json").read_text())
    del meta["step"]
    Path(ckpt, "meta.json").write_text(json.dumps(meta))
    return "meta.json lacks the step"


def _edit_meta(ckpt, edit, reseal=False):
    """Edit meta.json in place; with `reseal`, record its new digest too (a tool that knows it)."""
    meta = json.loads(Path(ckpt, "meta.json").read_text())
    edit(meta)
    Path(ckpt, "meta.json").write_text(json.dumps(seal_meta(meta) if reseal else meta))


def _rewrite_index(ckpt, edit):
    """Rewrite DCP's `.metadata` with `edit(metadata)` applied and record its new checksum in
    meta.json, as a tool (or an attacker) that knows the format would: only the shape check /
    the restricted unpickler can refuse it."""
    import hashlib
    import pickle

    from mini3d.checkpoint.dcp_read import safe_metadata

    md = edit(safe_metadata(ckpt))
    path = os.path.join(ckpt, ".metadata")
    Path(path).write_bytes(pickle.dumps(md))
    _edit_meta(ckpt, lambda meta: meta["files"][".metadata"].update(
        sha256=hashlib.sha256(Path(path).read_bytes()).hexdigest(), bytes=os.path.getsize(path)),
        reseal=True)


def _first_2d(meta):
    tensors = meta["files"]["__0_0.distcp"]["tensors"]
    return tensors, next(n for n in sorted(tensors) if len(tensors[n]) == 2)


def _meta_shape(ckpt, reseal=False):
    def edit(meta):
        tensors, name = _first_2d(meta)
        tensors[name][0] -= 1
    _edit_meta(ckpt, edit, reseal)
    tensors, name = _first_2d(json.loads(Path(ckpt, "meta.json").read_text()))
    return f"meta.json records shape {tensors[name]} for {name} in __0_0.distcp"


def _meta_shape_resealed(ckpt):
    return _meta_shape(ckpt, reseal=True)


def _meta_step(ckpt, reseal=False):
    _edit_meta(ckpt, lambda meta: meta.update(step=1), reseal)
    return "meta.json records step 1, but stage0 was saved at step 2"


def _meta_step_resealed(ckpt):
    return _meta_step(ckpt, reseal=True)


def _meta_index_emptied(ckpt):
    _edit_meta(ckpt, lambda meta: meta["files"]["__1_0.distcp"].update(tensors={}), reseal=True)
    return "meta.json's index lacks tensor"


def _meta_other_field(ckpt):
    _edit_meta(ckpt, lambda meta: meta.update(seed=meta.get("seed", 0) + 1))
    return "meta.json differs from its own digest (meta_sha256)"


def _foreign_file(ckpt):
    Path(ckpt, "__7_0.distcp").write_bytes(b"not ours")
    return "__7_0.distcp is not listed in meta.json"


def _mis_shaped(ckpt):
    """The index (and meta.json's, resealed) of another model: only the model check refuses it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    meta = json.loads(Path(ckpt, "meta.json").read_text())
    tensors, name = _first_2d(meta)

    def edit(md):
        t = md.state_dict_metadata[f"model.{name}"]
        t.size = torch.Size([t.size[0] - 1, *t.size[1:]])
        t.chunks = [ChunkStorageMetadata(c.offsets, torch.Size([min(c.sizes[0], t.size[0] - c.offsets[0]),
                                                                *c.sizes[1:]])) for c in t.chunks]
        return md
    _rewrite_index(ckpt, edit)
    _edit_meta(ckpt, lambda meta: meta["files"]["__0_0.distcp"]["tensors"][name].__setitem__(
        0, tensors[name][0] - 1), reseal=True)
    return f"__0_0.distcp: {name} has shape"


class NotATensor:
    pass


def _malicious(ckpt):
    _rewrite_index(ckpt, lambda md: (md, NotATensor()))
    return ".metadata is not a loadable checkpoint index (UnpicklingError"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("corrupt", [_flip_byte, _truncate, _missing, _garbage_meta,
                                     _meta_without_step, _mis_shaped, _malicious, _meta_shape,
                                     _meta_shape_resealed, _meta_step, _meta_step_resealed,
                                     _meta_index_emptied, _meta_other_field, _foreign_file])
def test_a_damaged_checkpoint_is_refused_before_any_worker_starts(root, tmp_path, capsys,
                                                                  monkeypatch, corrupt):
    ckpt = str(tmp_path / "step-000002")
    shutil.copytree(os.path.join(root, "step-000002"), ckpt)
    assert verify_checkpoint(ckpt, CFG) == []  # intact, before
    needle = corrupt(ckpt)
    _no_launch(monkeypatch)
    code = cli.main(["train", *FLAGS, "--pp", "2", "--micro-batches", "2", "--steps", "4",
                     "--resume", ckpt])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and "Nothing was started" in err, err


def _save_forever(root: str):
    """Child: save checkpoints of steps 1..3 in turn (the same step again every third save)."""
    part = {"model": {"w": torch.arange(20000.0)}, "optim": {}, "optim_step": 1}
    k = 0
    while True:
        k += 1
        w = CheckpointWriter(root, 1 + k % 3)
        w.begin()
        w.write("stage0.pt", part)
        w.write("stage1.pt", part)
        w.commit({"step": 1 + k % 3, "model": {}})


@pytest.mark.timeout(120)
def test_a_kill_at_any_moment_of_a_save_leaves_a_complete_checkpoint(tmp_path):
    root = str(tmp_path / "ck")
    rng = random.Random(0)
    moments = []
    for trial in range(40):
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child never returns)
            try:
                _save_forever(root)
            finally:
                os._exit(0)
        time.sleep(0.05 + rng.random() * 0.3 if trial else 0.5)  # the first one lands a save
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        ckpt = latest_dir(root)
        assert ckpt is not None, f"no checkpoint after kill {trial}: {os.listdir(root)}"
        assert verify_checkpoint(ckpt) == [], (trial, os.listdir(root))
        assert torch.equal(read_states(ckpt)["model"]["w"], torch.arange(20000.0))
        moments.append((json.loads(Path(ckpt, "meta.json").read_text())["step"],
                        any(n.startswith(".tmp-") for n in os.listdir(root))))
    # the kills landed in many moments: during writes (a .tmp- directory left), between saves,
    # and with each of the three steps the latest one
    assert sum(mid for _, mid in moments) >= 5 and sum(not mid for _, mid in moments) >= 1
    assert {step for step, _ in moments} == {1, 2, 3}


def _tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


@pytest.mark.timeout(200)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async-save"])
def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(tmp_path, capfd, monkeypatch,
                                                                background):
    """A real full disk (a 1.4 MB tmpfs: one ~1.2 MB checkpoint fits, the second does not) when the
    test may mount one, else the checkpoint writer's own simulation (MINI3D_TEST_DISK_FULL_AFTER)
    on a resumed job. With --async-save the write that fails runs in the background: the failure
    surfaces at the commit (the end of the run), and the previous checkpoint stays latest."""
    root = str(tmp_path / "disk")
    mounted = _tmpfs(root, "1400k")
    run = ["train", *FLAGS, "--pp", "2", "--micro-batches", "2", "--save", root,
           *(["--async-save"] if background else [])]
    try:
        if mounted:
            code = cli.main([*run, "--steps", "2", "--save-every", "1"])
        else:
            assert cli.main([*run, "--steps", "1"]) == 0
            capfd.readouterr()
            monkeypatch.setenv("MINI3D_TEST_DISK_FULL_AFTER", "100000")
            code = cli.main([*run, "--steps", "2", "--resume", root])
        err = capfd.readouterr().err
        assert code == 1, err
        first = err.strip().splitlines()[0]
        assert first.startswith(f"mini3d train: no space left on {root} while writing checkpoint "
                                f"step 2"), err
        assert sorted(os.listdir(root)) == ["latest", "step-000001"]  # no .tmp-step-000002 left
        assert latest_dir(root) == os.path.join(root, "step-000001")
        assert verify_checkpoint(latest_dir(root), CFG) == []
    finally:
        if mounted:
            subprocess.run(["umount", "-l", root], capture_output=True)


@pytest.mark.timeout(200)
def test_a_rank_reads_only_its_shares_in_bounded_batches(root, monkeypatch):
    # batches of at most 20 kB: a rank reads its stage's tensors in many small dcp.loads
    monkeypatch.setenv("MINI3D_CKPT_READ_BYTES", "20000")
    spec = make_spec(CFG, PLAN, steps=2, resume=os.path.join(root, "step-000001"))
    results = launch(resume_and_watch_loads, 2, spec, device="cpu", timeout=150)
    for r in results:  # pp rank k holds stage k: it reads rank k's file, and the index once
        assert set(r["opened"]) == {".metadata", f"__{r['rank']}_0.distcp"}, r
        assert r["opened"].count(".metadata") == 1, r
        assert r["batches"] > 5 and r["largest_batch"] <= 20000 + 16384, r  # (+ one tensor)
        assert r["rng_restored"] == [True], r
