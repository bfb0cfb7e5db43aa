"""Checkpoints: written atomically, loaded with `weights_only=True`, resumable into another layout.

Format. A checkpoint directory `ROOT/step-000123/` holds one file per pipeline stage
(`stage{k}.pt`: full, unsharded tensors keyed by the reference model's parameter names: weights and
AdamW moments) and `meta.json` (step, model config, plan, RNG state, data position). Because every
tensor is stored at its full shape under its reference name, loading into a *different* tp x pp x dp
layout is the same operation as starting from the reference model: each rank slices what it holds.

Atomicity. Files are first written into `ROOT/.tmp-step-000123/` (each through a `.part` file and
`os.replace`), then the leader renames that directory to `step-000123` and finally replaces the one-line
`ROOT/latest` file with `os.replace`. A crash at any moment leaves `latest` naming the previous complete
checkpoint; half-written temporary directories are ignored and cleaned by the next save.

Why not `torch.distributed.checkpoint` (DCP)? DCP reshards DTensors; mini3d's shards are plain tensors
whose layout (heads split inside a fused qkv, padded vocabulary, flat ZeRO shards) DCP cannot describe
without DTensor, and for the model sizes mini3d targets a full-state file per stage is small and lets any
layout load any checkpoint. DCP would be the choice for sharded saves of very large models.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

LATEST = "latest"


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
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        os.makedirs(self.tmp)

    def write(self, name: str, obj):
        part = os.path.join(self.tmp, name + ".part")
        with open(part, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, os.path.join(self.tmp, name))
        pause = os.environ.get("MINI3D_TEST_PAUSE_IN_SAVE")  # tests kill a save mid-way
        if pause:
            import time

            time.sleep(float(pause))

    def commit(self, meta: dict):
        with open(os.path.join(self.tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        if os.path.exists(self.final):
            shutil.rmtree(self.final)
        os.rename(self.tmp, self.final)
        latest_tmp = os.path.join(self.root, LATEST + ".part")
        with open(latest_tmp, "w") as f:
            f.write(step_dir_name(self.step) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(self.root, LATEST))
        _fsync_dir(self.root)


def latest_dir(root: str) -> str | None:
    """The newest complete checkpoint under `root` (or `root` itself if it is one), else None."""
    if os.path.isfile(os.path.join(root, "meta.json")):
        return root
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    return path if os.path.isfile(os.path.join(path, "meta.json")) else None


def read_meta(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "meta.json")) as f:
        return json.load(f)


def read_states(ckpt: str) -> dict:
    """Merge every stage file into one {name: tensor} model dict and one {name: {moment: tensor}}."""
    model, optim = {}, {}
    for name in sorted(os.listdir(ckpt)):
        if name.startswith("stage") and name.endswith(".pt"):
            part = torch.load(os.path.join(ckpt, name), map_location="cpu", weights_only=True)
            model.update(part["model"])
            optim.update(part.get("optim", {}))
    return {"model": model, "optim": optim}


def shape_mismatch(meta: dict, cfg_dict: dict) -> list[str]:
    """Model fields that differ between a checkpoint and the requested model, each naming both values."""
    fields = ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", "d_ff")
    saved = meta["model"]
    return [f"{k}: checkpoint has {saved[k]}, the flags ask for {cfg_dict[k]}"
            for k in fields if saved.get(k) != cfg_dict.get(k)]


# ---------------------------------------------------------------------------------------------
# Between the sharded training state of one rank and the full, named state of a checkpoint.

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state


def _names(chunks) -> dict:
    """{parameter: reference name} over this rank's model chunks (names are the full model's)."""
    return {p: n for chunk in chunks for n, p in chunk.named_parameters()}


def gather_full_state(chunks, optimizer, topo) -> tuple[dict, dict, int]:
    """(weights, moments, optimizer step) of this rank's chunks at full shape, keyed by reference
    name. Weights come from the fp32 master copies (so bf16 runs resume exactly). Collective over
    the dp and tp axes: every rank must call it."""
    from . import comm
    from .tp import unshard_like

    names = _names(chunks)
    weights, moments, step = {}, {}, 0
    sharded = optimizer.wrapper.stage >= 1
    for (group, _, _), master in zip(optimizer.shards, optimizer.masters):
        state = optimizer.inner.state.get(master, {})
        if "step" in state:
            step = int(state["step"])
        tensors = {"weight": master.detach()}
        tensors.update({k: state[k] for k in MOMENTS if k in state})
        for key, shard in tensors.items():
            full = shard
            if sharded:
                full = torch.empty(group.padded, dtype=shard.dtype, device=shard.device)
                comm.all_gather(full, shard.contiguous(), topo.dp_cp)  # ZeRO's shard group
            for p, local in group.views(full):
                value = unshard_like(p, local.float(), topo).cpu()
                if key == "weight":
                    weights[names[p]] = value
                else:
                    moments.setdefault(names[p], {})[key] = value
    return weights, moments, step


@torch.no_grad()
def restore_full_state(chunks, optimizer, topo, weights: dict, moments: dict, step: int):
    """Load full, named weights and AdamW moments into this rank's (tp-sliced, dp-sharded) state."""
    from .tp import shard_like

    names = _names(chunks)
    sharded = optimizer.wrapper.stage >= 1
    fused = bool(optimizer.inner.defaults.get("fused"))  # fused AdamW keeps `step` on the device
    for (group, pshard, _), master in zip(optimizer.shards, optimizer.masters):
        def local_flat(source, key=None):
            flat = torch.zeros(group.padded, dtype=torch.float32, device=master.device)
            for p, view in group.views(flat):
                full = source[names[p]] if key is None else source[names[p]][key]
                view.copy_(shard_like(p, full.to(master.device), topo))
            return flat[group.lo:group.hi] if sharded else flat

        master.copy_(local_flat(weights))
        if master.data_ptr() != pshard.data_ptr():
            pshard.copy_(master)  # bf16 parameters from the restored fp32 masters
        if moments and step > 0:
            optimizer.inner.state[master] = {
                "step": torch.tensor(float(step), device=master.device if fused else "cpu"),
                **{k: local_flat(moments, k).clone() for k in MOMENTS}}
    optimizer.wrapper.after_step()  # ZeRO-1/2: every rank re-gathers the parameters it updated
