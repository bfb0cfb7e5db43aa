"""Sharded checkpoints in torch.distributed.checkpoint (DCP) format: every rank writes its own share.

Design. A rank still gathers its stage's tensors one at a time, as `gather_full_state` does (all-gather
over the ZeRO axis, `unshard_like` over tp, `gather_experts` over ep: afterwards every rank of the
pipeline stage holds the full tensor, briefly), but it keeps only ITS share: the contiguous range of
dim-0 rows `[i*R//n, (i+1)*R//n)`, where n is the number of ranks of the stage (tp x cp x dp x ep)
and i its position among them; uneven splits are fine and a tensor of fewer rows than ranks leaves
some ranks without a share. The share is cloned to host memory and the full tensor dropped before
the next one is gathered, so a rank's host memory peaks at ~1/n of its stage's state plus one
tensor in flight (`gather_shares` counts it: `ShareStats`), never the stage's full state.

Each share is declared to DCP as a chunk of the global tensor (`Share`: global shape, row offset;
`__create_write_items__` is DCP's hook, planner_helpers._create_write_items, and `_SharePlanner`
resolves the chunk's data; a DTensor would need a device mesh matching mini3d's own process
groups). `dcp.save` then writes one file per rank, `__{rank}_0.distcp`, and the coordinator the
`.metadata` index (all through one gloo group of the checkpoint's own, mini3d/run/saving.py), so
any DCP tool (`dcp.load`, `format_utils.dcp_to_torch_save`) reads back full
tensors under the reference names, nested as a stage file was: `model.<name>`,
`optim.<name>.exp_avg` / `.exp_avg_sq` (and buffers under `model.`), plus `rng.stage{k}` /
`step.stage{k}` from the first rank of each stage. A tensor two stages hold (a tied head is saved
as the embedding it equals) is written by the lower stage only.

The files travel through `_HashingFS`: each stream is hashed as DCP writes it (no read-back), a
full disk surfaces as ENOSPC (and MINI3D_TEST_DISK_FULL_AFTER=N simulates one per file), and each
rank leaves a `.sum.json` sidecar that the leader merges into meta.json (store.CheckpointWriter).

Loading (mini3d/checkpoint/dcp_read.py). `LazyStates` hands `restore_full_state` full tensors on
demand, read with `dcp.load(no_dist=True)` in batches of at most MINI3D_CKPT_READ_BYTES (256 MiB) in
the order the restore asks for them: a rank reads only the tensors its own parameters need
(under ZeRO, only those its optimizer shard holds: state.in_shard), and of a tensor split along
dim 0 under tp or ep only the rows its slice takes (`LazyStates.rows`, from hf_read.rank_share:
DCP then reads just the stored chunks overlapping them). A tensor split along dim 1 (a
row-parallel weight) is read whole and sliced. What was read is counted (`LazyStates.stats`,
collected as "load"). The
pickled `.metadata` is opened only after its sha256 matched meta.json's (verify.py), and then
through `safe_metadata`'s restricted unpickler; tensor data is read by DCP's FileSystemReader with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from mini3d.checkpoint.dcp_read import METADATA


@dataclass
class Share:
    """Rows [row, row + local.shape[0]) of a tensor of `shape`: one rank's chunk, for DCP."""
    local: torch.Tensor
    shape: torch.Size
    row: int

    def __create_write_items__(self, fqn, obj):
        offsets = torch.Size([self.row] + [0] * (len(self.shape) - 1))
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=self.local.size())
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, size=self.shape,
                                                      properties=TensorProperties.create_from_tensor(
                                                          self.local)))]


class _SharePlanner(DefaultSavePlanner):
    """DCP's planner, resolving a `Share`'s chunk to its host tensor (DCP's lookup knows only
    Tensor, ShardedTensor and DTensor values)."""

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        return obj.local if isinstance(obj, Share) else super().lookup_object(index)


@dataclass
class ShareStats:
    """What one rank kept: its shares' bytes, the largest full tensor it gathered, and the most
    host bytes it held at once (shares so far + the full tensor in flight)."""
    kept_bytes: int = 0
    largest_full_bytes: int = 0
    peak_host_bytes: int = 0
    full_bytes: int = 0  # the stage's full state, for comparison
    shares: int = 0


def stage_layout(topo, group) -> tuple[int, int, list[int]]:
    """(position of this rank among its stage's ranks, their number, the pp index of every rank)."""
    import torch.distributed as dist

    stages = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, topo.pp.index, group=group)
    mine = [r for r, s in enumerate(stages) if s == topo.pp.index]
    return mine.index(dist.get_rank(group)), len(mine), stages


def gather_shares(chunks, optimizer, topo, pos: int, n: int, skip=frozenset()):
    """This rank's shares of its chunks' full weights, moments and buffers as a nested DCP state
    dict ({"model": {name: Share}, "optim": {name: {moment: Share}}}), the optimizer step and the
    `ShareStats`. Collective over the stage's gathers; names in `skip` (held by a lower stage)
    are gathered (the collectives need every rank) but not kept."""
    from mini3d.checkpoint.state import _buffers, full_tensors, optimizer_step

    stats = ShareStats()
    model, optim = {}, {}

    def keep(value, where, key):
        value = value.detach()
        rows = value.shape[0] if value.dim() else 1
        lo, hi = pos * rows // n, (pos + 1) * rows // n
        nbytes = value.numel() * value.element_size()
        stats.full_bytes += nbytes
        stats.largest_full_bytes = max(stats.largest_full_bytes, nbytes)
        stats.peak_host_bytes = max(stats.peak_host_bytes, stats.kept_bytes + nbytes)
        if hi <= lo:
            return
        # a copy of the share alone (never a view: the full tensor is freed, and the training's
        # next step may not change a share an asynchronous save still writes)
        local = (value[lo:hi] if value.dim() else value).to("cpu", copy=True).contiguous()
        where[key] = Share(local, value.shape, lo) if value.dim() else local
        stats.kept_bytes += local.numel() * local.element_size()
        stats.shares += 1

    for name, key, value in full_tensors(chunks, optimizer, topo):  # (collective: drained whole)
        if name in skip:
            continue
        if key == "weight":
            keep(value, model, name)
        else:
            keep(value, optim.setdefault(name, {}), key)
    for name, b in _buffers(chunks).items():
        if name not in skip:
            keep(b, model, name)
    return {"model": model, "optim": optim}, optimizer_step(optimizer), stats


class _HashingStream(io.RawIOBase):
    """A file DCP writes through: hashed as it goes; MINI3D_TEST_DISK_FULL_AFTER=N fails like a
    full disk once N bytes are written (tests)."""

    def __init__(self, f, fs, path):
        self.f, self.fs, self.path, self.sha, self.n = f, fs, path, hashlib.sha256(), 0
        limit = os.environ.get("MINI3D_TEST_DISK_FULL_AFTER")
        self.limit = int(limit) if limit else None

    def writable(self):
        return True

    def write(self, b):
        try:
            if self.limit is not None and self.n + len(b) > self.limit:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            k = self.f.write(b)
        except OSError as e:
            self.fs.error = self.fs.error or e
            raise
        self.sha.update(memoryview(b).cast("B")[:k])
        self.n += k
        return k

    def tell(self):
        return self.n

    def fileno(self):
        return self.f.fileno()

    def flush(self):
        self.f.flush()

    def close(self):
        if not self.closed:
            self.f.flush()
            self.fs.sums[os.path.basename(str(self.path)).removesuffix(".tmp")] = {
                "sha256": self.sha.hexdigest(), "bytes": self.n}
        super().close()


class _HashingFS(FileSystem):
    def __init__(self):
        super().__init__()
        self.sums, self.error = {}, None

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        with open(path, mode) as f:
            s = _HashingStream(f, self, path)
            try:
                yield s
            finally:
                s.close()


def write_shares(directory: str, state: dict, group, pp_index: int) -> dict:
    """`dcp.save` of this rank's shares into `directory` over `group`; returns {file: sums},
    each with the stage and the {name: global shape} index of the model tensors it holds."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=1, sync_files=True)
    writer.fs = _HashingFS()
    try:
        dcp.save(state, storage_writer=writer, planner=_SharePlanner(), process_group=group)
    except BaseException as e:  # CheckpointException is a BaseException: a failure on ANY rank
        err = writer.fs.error or next((x for x, _ in getattr(e, "failures", {}).values()
                                       if getattr(x, "errno", None) == errno.ENOSPC), None)
        if getattr(err, "errno", None) == errno.ENOSPC:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from e
        raise
    tensors = {n: list(s.shape) for n, s in state.get("model", {}).items()}
    return {f: {**s, **({} if f == METADATA else {"stage": pp_index, "tensors": tensors})}
            for f, s in writer.fs.sums.items()}


__all__ = ["Share", "ShareStats", "gather_shares", "write_shares", "stage_layout", "METADATA"]
