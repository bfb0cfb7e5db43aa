"""The trainer's checkpoint save and load: sharded DCP saves (mini3d/checkpoint/sharded.py), optionally
in the background (`--async-save`), and loads from either checkpoint format.

Save. Every rank gathers its stage's tensors one at a time and keeps its share (collective over the
training's own groups, in the step loop's thread); the leader prepares the temporary directory;
every rank then writes its share with `dcp.save` over a gloo process group of its own (created at
the first save, by every rank at the same point), so that DCP's plan exchange never interleaves
with training's collectives and CPU shares need no NCCL. The commit (meta.json, rename, `latest`,
prune) follows once every rank's write is done.

Async (`--async-save`). The write runs in a background thread over the already-staged host shares
while training goes on (the shares are copies: the next steps cannot change them); the commit waits
for it at the next save, at the end of training and before an exit on a signal (which ends the
loop). A crash mid-write leaves only the temporary directory: `latest` names the previous
checkpoint. The hang watchdog sees no pending op of the background thread (DCP's collectives are
not mini3d's traced ones); the wait for it runs inside `diag.saving`, on the save's clock.
"""

from __future__ import annotations

import threading

import torch

from mini3d import comm
from mini3d.checkpoint.store import CheckpointWriter, prune_checkpoints, read_meta, read_states, restore_rng
from mini3d.checkpoint.state import MOMENTS, _buffers, _names, restore_full_state, restore_order


class _Ckpt:
    """This rank's checkpoint context: its gloo group, its place in its stage, what it skips."""

    def __init__(self, trainer):
        import torch.distributed as dist

        from mini3d.checkpoint.sharded import stage_layout

        self.group = dist.new_group(backend="gloo")
        self.pos, self.n, stages = stage_layout(trainer.topo, self.group)
        mine = set(_names(trainer.chunks).values()) | set(_buffers(trainer.chunks))
        held = [None] * len(stages)
        dist.all_gather_object(held, sorted(mine), group=self.group)
        k = trainer.topo.pp.index
        self.skip = frozenset(n for n in mine if any(stages[r] < k and n in held[r]
                                                     for r in range(len(stages))))
        self.pending = None  # (thread, writer, meta, keep_last, [error]) of a background write


def _ctx(trainer) -> _Ckpt:
    if getattr(trainer, "_ckpt", None) is None:
        trainer._ckpt = _Ckpt(trainer)
    return trainer._ckpt


def save(trainer, root: str, step: int, meta: dict, keep_last: int = 0, background: bool = False):
    """Collective: every rank writes its share of its stage's full state; the leader commits."""
    from mini3d.checkpoint.sharded import gather_shares

    ck, topo = _ctx(trainer), trainer.topo
    finish_pending(trainer)  # the previous background write first: one save in flight at a time
    state, opt_step, stats = gather_shares(trainer.chunks, trainer.optimizer, topo, ck.pos, ck.n,
                                           ck.skip)
    trainer.last_save_stats = stats
    if ck.pos == 0:  # the stage's first rank: its RNG state and step (as its stage file had)
        k = topo.pp.index
        state["rng"] = {f"stage{k}": torch.get_rng_state()}
        state["step"] = {f"stage{k}": torch.tensor(step, device="cpu")}
    writer = CheckpointWriter(root, step)
    if topo.rank == 0:
        writer.begin()
    comm.barrier(topo.axes["world"])
    meta = {**meta, "optim_step": opt_step, "format": "dcp"}
    if not background:
        writer.write_shares(state, ck.group, topo.pp.index)
        _commit(trainer, writer, meta, keep_last)
        return
    error = []

    def write():
        try:
            writer.write_shares(state, ck.group, topo.pp.index)
        except BaseException as e:  # raised in the step loop's thread at the commit
            error.append(e)

    thread = threading.Thread(target=write, name=f"mini3d-save-{step}", daemon=True)
    thread.start()
    ck.pending = (thread, writer, meta, keep_last, error)


def finish_pending(trainer):
    """Wait for this rank's background write, then commit it (collective; nothing if none)."""
    ck = getattr(trainer, "_ckpt", None)
    if ck is None or ck.pending is None:
        return
    thread, writer, meta, keep_last, error = ck.pending
    ck.pending = None
    thread.join()
    if error:
        raise error[0]
    _commit(trainer, writer, meta, keep_last)


def pending_step(trainer) -> int | None:
    """The step of this rank's background write in flight, if any."""
    ck = getattr(trainer, "_ckpt", None)
    return ck.pending[1].step if ck is not None and ck.pending is not None else None


def _commit(trainer, writer, meta, keep_last):
    world = trainer.topo.axes["world"]
    comm.barrier(world)  # every rank's files and sidecars are in
    if trainer.topo.rank == 0:
        writer.commit(meta)
        if keep_last:
            prune_checkpoints(writer.root, keep_last)
    comm.barrier(world)


def load(trainer, ckpt: str) -> int:
    """Restore from a checkpoint written by any layout, in either format; returns the step."""
    from mini3d.checkpoint.dcp_read import LazyStates, Prefixed, is_dcp, rng_key

    meta = read_meta(ckpt)
    if not is_dcp(ckpt):  # a stage-file checkpoint (older, or `mini3d import-hf`)
        mine = [n for chunk in trainer.chunks for n, _ in chunk.named_parameters()]
        states = read_states(ckpt, mine)  # only the files holding this rank's tensors, once, mmap
        restore_full_state(trainer.chunks, trainer.optimizer, trainer.topo, states["model"],
                           states["optim"], states["optim_step"])
        restore_rng(states["rng"])
        return int(meta["step"])
    states = LazyStates(ckpt, restore_order(trainer.chunks, trainer.optimizer),
                        rows=_rows_needed(trainer))
    restore_full_state(trainer.chunks, trainer.optimizer, trainer.topo, Prefixed(states, "model."),
                       Prefixed(states, "optim.", MOMENTS), int(meta.get("optim_step", 0)))
    key = rng_key(ckpt, set(_names(trainer.chunks).values()))
    if key in states:
        restore_rng(states.read([key])[key])
    trainer.last_load_stats = states.stats()
    return int(meta["step"])


def _rows_needed(trainer) -> dict:
    """{flat key: (lo, hi)}: the dim-0 rows of each tensor this rank's parameters take (its experts
    under ep, its rows of a column-parallel or vocab-parallel weight under tp: hf_read.rank_share,
    the same selection an HF init reads), for its weights and both moments."""
    from mini3d.checkpoint.hf_read import rank_share

    rows = {}
    for name, select in rank_share(trainer.chunks, trainer.topo).items():
        if select and select[0] is not None and len(select[0]):
            box = (int(select[0].min()), int(select[0].max()) + 1)
            rows.update({k: box for k in (f"model.{name}", *(f"optim.{name}.{m}" for m in MOMENTS))})
    return rows


__all__ = ["save", "load", "finish_pending", "pending_step"]
