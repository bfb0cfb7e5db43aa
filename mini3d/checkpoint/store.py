"""Checkpoints: sharded (every rank writes its share), atomic, verified, resumable into another layout.

Format. A checkpoint directory `ROOT/step-000123/` is a torch.distributed.checkpoint (DCP) checkpoint:
one `__{rank}_0.distcp` file per rank holding that rank's share (a range of dim-0 rows) of every full,
unsharded tensor of its pipeline stage, keyed by the reference model's names (`model.<name>`,
`optim.<name>.exp_avg` / `.exp_avg_sq`), DCP's `.metadata` index, and `meta.json` (step, model config,
plan, RNG state, data position). How the shares are cut, written and read back is in
`mini3d/checkpoint/sharded.py`. Because every tensor is stored at its full (global) shape under its
reference name, loading into a *different* tp x pp x dp x ep layout, or into one process, is the
same operation as starting from the reference model: each rank reads and slices what it holds,
and any DCP tool (`dcp.load`, `format_utils.dcp_to_torch_save`) reads the full tensors back.
Older checkpoints (one `stage{k}.pt` file per stage, full tensors; `mini3d import-hf` still writes
that form) keep loading, verifying and sampling as before: every reader here takes both.

Atomicity. Files are first written into `ROOT/.tmp-step-000123/` (DCP's own files, and each stage
file through a `.part` file and `os.replace`), then the leader renames that directory to
`step-000123` and finally replaces the one-line `ROOT/latest` file with `os.replace`. A crash at any
moment leaves `latest` naming the previous complete checkpoint; half-written temporary directories
are ignored and cleaned by the next save. A checkpoint of the same step already in place is first
renamed aside (`.old-step-000123`) and removed only after the new one has its name, so a crash
between the two renames still leaves one (`latest_dir` finds it). With `--async-save` the DCP write
runs in the background and the commit waits for every rank's write (mini3d/run/saving.py).

Verification. Each rank hashes its file as it is written (no read-back) and the leader stores every
file's sha256 and size (and each data file's stage and tensor shapes) in `meta.json["files"]`, and
meta.json its own digest (`meta_sha256`). `verify_checkpoint` checks them all, the step and the
tensor index against the files, and the shapes against the model asked for, before any worker
starts. A full disk is `DiskFull` ("no space left on ROOT while writing checkpoint step N"), and the
partial directory is removed.

Loading. Tensor data is read with `weights_only=True` (DCP's FileSystemReader; stage files with
`mmap=True, weights_only=True`): no pickled code runs. DCP's `.metadata` is a pickle: it is read only
after its sha256 matched meta.json's, and then through a restricted unpickler (sharded.safe_metadata).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

import torch

LATEST = "latest"
SUMS = ".sum.json"  # a writer's sidecar in the temporary directory, merged into meta.json
ASIDE = ".old-"  # prefix of a replaced checkpoint until its successor has its name
META_SHA = "meta_sha256"  # meta.json's digest of itself (all its other fields)


class DiskFull(RuntimeError):
    """The file system of the checkpoint root is full; the partial checkpoint was removed."""


class _HashingFile:
    """The file object torch.save writes through: hashes the bytes as they go, and lets a write
    error such as ENOSPC surface as OSError (torch's own file writer reports it as "unexpected pos").
    MINI3D_TEST_DISK_FULL_AFTER=N fails like a full disk once N bytes are written (tests)."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0
        self.error = None  # torch's zip writer may turn our OSError into "unexpected pos": keep it
        limit = os.environ.get("MINI3D_TEST_DISK_FULL_AFTER")
        self.limit = int(limit) if limit else None

    def write(self, b) -> int:
        try:
            if self.limit is not None and self.bytes + len(b) > self.limit:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = self.f.write(b)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha.update(b)
        self.bytes += len(b)
        return n

    def flush(self):
        self.f.flush()


def _fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


class CheckpointWriter:
    """Collective save: `begin()` on the leader, `write()` on each writer, `commit()` on the leader.

    The caller puts barriers between the phases (begin -> barrier -> write -> barrier -> commit)."""

    def __init__(self, root: str, step: int):
        self.root, self.step = root, step
        self.tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
        self.final = os.path.join(root, step_dir_name(step))

    def begin(self):
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):  # leftovers of an interrupted save
            path = os.path.join(self.root, name)
            if name.startswith(".tmp-"):
                shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(ASIDE):  # a commit died between its renames
                final = os.path.join(self.root, name[len(ASIDE):])
                if os.path.isfile(os.path.join(final, "meta.json")):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(path, final)
        os.makedirs(self.tmp)

    def _full(self, err: OSError):
        shutil.rmtree(self.tmp, ignore_errors=True)  # give the space back now, not at the next save
        return DiskFull(f"no space left on {self.root} while writing checkpoint step {self.step} "
                        f"(the partial checkpoint was removed; the previous one stays)")

    def write(self, name: str, obj):
        part = os.path.join(self.tmp, name + ".part")
        hashed = None
        try:
            with open(part, "wb") as f:
                hashed = _HashingFile(f)
                torch.save(obj, hashed)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, os.path.join(self.tmp, name))
            tensors = {k: list(v.shape) for k, v in (obj.get("model") or {}).items()}
            _write_json(os.path.join(self.tmp, name + SUMS),
                        {"sha256": hashed.sha.hexdigest(), "bytes": hashed.bytes, "tensors": tensors})
        except (OSError, RuntimeError) as e:
            cause = hashed.error if hashed is not None and hashed.error is not None else e
            if getattr(cause, "errno", None) == errno.ENOSPC:
                raise self._full(cause) from e
            raise
        _test_pause()

    def write_shares(self, state: dict, group, pp_index: int):
        """This rank's shares (sharded.gather_shares) as DCP files in the temporary directory,
        with a `.sum.json` sidecar per file this rank wrote. Collective over `group`."""
        from mini3d.checkpoint.sharded import write_shares

        try:
            sums = write_shares(self.tmp, state, group, pp_index)
            for name, entry in sums.items():
                _write_json(os.path.join(self.tmp, name + SUMS), entry)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._full(e) from e
            raise
        _test_pause()

    def commit(self, meta: dict):
        files = {}
        for name in sorted(os.listdir(self.tmp)):
            if name.endswith(SUMS):
                with open(os.path.join(self.tmp, name)) as f:
                    files[name[:-len(SUMS)]] = json.load(f)
                os.remove(os.path.join(self.tmp, name))
        try:
            _write_json(os.path.join(self.tmp, "meta.json"), seal_meta({**meta, "files": files}))
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._full(e) from e
            raise
        _fsync_dir(self.tmp)
        aside = None
        if os.path.exists(self.final):  # the same step again: keep the old one until the new is in
            aside = os.path.join(self.root, ASIDE + step_dir_name(self.step))
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(self.final, aside)
        os.rename(self.tmp, self.final)
        latest_tmp = os.path.join(self.root, LATEST + ".part")
        with open(latest_tmp, "w") as f:
            f.write(step_dir_name(self.step) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(self.root, LATEST))
        _fsync_dir(self.root)
        if aside:
            shutil.rmtree(aside, ignore_errors=True)


def _test_pause():
    pause = os.environ.get("MINI3D_TEST_PAUSE_IN_SAVE")  # tests kill a save mid-way
    if pause:
        import time

        time.sleep(float(pause))


def _write_json(path: str, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def meta_digest(meta: dict) -> str:
    """The sha256 of `meta` without its own digest field, over its canonical JSON (sorted keys)."""
    body = {k: v for k, v in meta.items() if k != META_SHA}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal_meta(meta: dict) -> dict:
    """`meta` with its own digest (`meta_sha256`), as the stage files have theirs in `files`."""
    return {**meta, META_SHA: meta_digest(meta)}


def latest_dir(root: str) -> str | None:
    """The newest complete checkpoint under `root` (or `root` itself if it is one), else None
    (a `root` that is a file or missing holds none)."""
    if not os.path.isdir(root):
        return None
    if os.path.isfile(os.path.join(root, "meta.json")):
        return root
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    for path in (os.path.join(root, name), os.path.join(root, ASIDE + name)):
        if os.path.isfile(os.path.join(path, "meta.json")):  # the aside copy: a crash mid-commit
            return path
    return None


def prune_checkpoints(root: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints under `root` (never the one `latest`
    names); returns the deleted directories. Leader only, after a commit."""
    newest = latest_dir(root)
    steps = sorted(n for n in os.listdir(root) if n.startswith("step-")
                   and os.path.isfile(os.path.join(root, n, "meta.json")))
    doomed = [os.path.join(root, n) for n in steps[:max(0, len(steps) - keep)]]
    doomed = [d for d in doomed if newest is None or os.path.abspath(d) != os.path.abspath(newest)]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def read_meta(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "meta.json")) as f:
        return json.load(f)


def stage_files(ckpt: str, names=None) -> list[str]:
    """The stage files of `ckpt`; with `names`, only those holding one of these tensors (from the
    index in meta.json; every file for a checkpoint without one)."""
    files = sorted(n for n in os.listdir(ckpt) if n.startswith("stage") and n.endswith(".pt"))
    if names is None:
        return files
    try:
        index = read_meta(ckpt).get("files") or {}
    except (OSError, ValueError):
        index = {}
    names = set(names)
    return [f for f in files if f not in index or names & set(index[f].get("tensors", ()))]


def read_parts(ckpt: str, names=None) -> list[dict]:
    """The stage files `stage_files(ckpt, names)` selects, each loaded once, memory-mapped."""
    return [torch.load(os.path.join(ckpt, f), map_location="cpu", weights_only=True, mmap=True)
            for f in stage_files(ckpt, names)]


def read_states(ckpt: str, names=None) -> dict:
    """Merge the stage files into one {name: tensor} model dict, one {name: {moment: tensor}}, the
    optimizer step and the RNG state (of the first file read). A DCP checkpoint is assembled into
    the same full tensors (`dcp.load(no_dist=True)` of the keys for `names`, or of all)."""
    from mini3d.checkpoint.dcp_read import is_dcp, read_full

    if is_dcp(ckpt):
        return read_full(ckpt, names)
    model, optim, step, rng = {}, {}, 0, None
    for part in read_parts(ckpt, names):
        model.update(part["model"])
        optim.update(part.get("optim", {}))
        step = max(step, int(part.get("optim_step", 0)))
        rng = part.get("rng") if rng is None else rng
    return {"model": model, "optim": optim, "optim_step": step, "rng": rng}


def restore_rng(state):
    """Put back the host RNG state a checkpoint's writer saved (nothing for older checkpoints)."""
    if state is not None:
        torch.set_rng_state(state)


# The state's two directions (sharded <-> full, named) live in mini3d/checkpoint/state.py.
from mini3d.checkpoint.state import MOMENTS, _names, gather_full_state, restore_full_state  # noqa: E402,F401
