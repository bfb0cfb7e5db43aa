"""Reading a sharded (DCP) checkpoint (the format and the design are in mini3d/checkpoint/sharded.py).

`LazyStates` hands `restore_full_state` full tensors on demand, read with `dcp.load(no_dist=True)` in
batches of at most MINI3D_CKPT_READ_BYTES (default 256 MiB) in the order the restore asks for them:
a rank reads only the tensors its parameters need (only its ZeRO shard's under ZeRO), and of a
tensor split along dim 0 only its rows (`rows`), never its whole stage at once.
`read_full` is `store.read_states` for this format (full named tensors, for sampling, export, tests).
DCP's `.metadata` is a pickle: `safe_metadata` rebuilds it only from DCP's own classes, and callers
check its sha256 against meta.json first (verify.py); tensor data is read by DCP's FileSystemReader
with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

METADATA = ".metadata"
READ_BYTES_ENV = "MINI3D_CKPT_READ_BYTES"


def is_dcp(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, METADATA)) or any(
        n.endswith(".distcp") for n in _listdir(ckpt))


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def dcp_files(ckpt: str) -> list[str]:
    return sorted(n for n in _listdir(ckpt) if n.endswith(".distcp") or n == METADATA)


_ALLOWED = ("torch.distributed.checkpoint.", ("collections", "OrderedDict"), ("builtins", "set"),
            ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"))


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: rebuilt only from DCP's own dataclasses, torch.Size and
    dtypes (a payload naming anything else is refused) - on top of the sha256 check before it."""

    def find_class(self, module, name):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module.startswith(_ALLOWED[0]) or (module, name) in _ALLOWED[1:]:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} from a checkpoint's {METADATA}")


def safe_metadata(ckpt: str):
    """The DCP index of `ckpt`. Callers check its sha256 against meta.json first (verify.py)."""
    with open(os.path.join(ckpt, METADATA), "rb") as f:
        md = _MetadataUnpickler(f).load()
    return md


class _Reader(dcp.FileSystemReader):
    """DCP's reader with the index read once (through `safe_metadata`), not once per batch, and
    the bytes it reads from the files counted (`bytes_read`: each stored chunk a plan touches is
    read whole, as FileSystemReader reads them)."""

    def __init__(self, ckpt):
        super().__init__(ckpt)
        self.md = safe_metadata(ckpt)
        self.bytes_read = 0

    def read_metadata(self, *a, **k):
        if getattr(self.md, "storage_meta", None) is not None:
            self.md.storage_meta.load_id = self.load_id
        return self.md

    def read_data(self, plan, planner):
        chunks = {r.storage_index for r in plan.items}
        self.bytes_read += sum(self.storage_data[c].length for c in chunks)
        return super().read_data(plan, planner)


class _RowsPlanner(DefaultLoadPlanner):
    """DCP's load planner asking, for the keys in `rows`, only for the dim-0 rows [lo, hi) of the
    global tensor: DCP then reads only the stored chunks (each writer's rows, sharded.py) that
    overlap them, into those rows of the full-shaped tensor handed in."""

    def __init__(self, rows: dict):
        super().__init__()
        self.rows = rows

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import (_create_read_items,
                                                                  create_read_items_for_chunk_list)

        items = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if fqn not in self.rows:
                items += _create_read_items(fqn, md, obj)
                continue
            lo, hi = self.rows[fqn]
            chunk = ChunkStorageMetadata(offsets=torch.Size([lo] + [0] * (obj.dim() - 1)),
                                         sizes=torch.Size([hi - lo, *obj.shape[1:]]))
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        if index.fqn in self.rows:  # the rows asked for start at the chunk's offset
            return obj[index.offset[0]:self.rows[index.fqn][1]]
        return super().lookup_tensor(index)


@dataclass
class LazyStates:
    """Full tensors of a DCP checkpoint by flat key ("model.<name>", "optim.<name>.exp_avg"),
    read in bounded batches in the order `order` lists them (misses start a new batch there).
    `rows` {key: (lo, hi)}: only those dim-0 rows of the key's tensor are needed; the rest of the
    full-shaped tensor is NaN, never read (as hf_read's shares: a slicing that reached past them
    would show as NaN in the loss)."""
    ckpt: str
    order: list = field(default_factory=list)
    budget: int = 0
    reader: object = None
    batch: dict = field(default_factory=dict)
    batches: int = 0
    rows: dict = field(default_factory=dict)

    def __post_init__(self):
        self.reader = _Reader(self.ckpt)
        self.sizes = {k: v for k, v in self.reader.md.state_dict_metadata.items() if hasattr(v, "size")}
        self.budget = self.budget or int(os.environ.get(READ_BYTES_ENV, 256 << 20))

    def __contains__(self, key):
        return key in self.sizes

    def _nbytes(self, key):
        md = self.sizes[key]
        return md.size.numel() * torch._utils._element_size(md.properties.dtype)

    def __getitem__(self, key):
        if key not in self.batch:
            keys = [k for k in (self.order[self.order.index(key):] if key in self.order else [key])
                    if k in self.sizes]
            take, total = [], 0
            for k in keys:
                if take and total + self._nbytes(k) > self.budget:
                    break
                take.append(k)
                total += self._nbytes(k)
            self.batch = self.read(take)
            self.batches += 1
        return self.batch[key]

    def _blank(self, key, part: bool) -> torch.Tensor:
        """The full-shaped host tensor `key` is read into (device explicit: under
        MINI3D_STRICT_DEVICE the default is meta); NaN where a partial read leaves it unread."""
        size, dtype = self.sizes[key].size, self.sizes[key].properties.dtype
        if not part:
            return torch.empty(size, dtype=dtype, device="cpu")
        fill = float("nan") if dtype.is_floating_point else 0
        return torch.full(size, fill, dtype=dtype, device="cpu")

    def read(self, keys) -> dict:
        """{key: full tensor} of `keys`, each read only where `rows` says it is needed."""
        rows = {}
        for k in keys:
            lo, hi = self.rows.get(k, (0, None))
            n = self.sizes[k].size[0] if len(self.sizes[k].size) else 0
            hi = n if hi is None else min(n, hi)
            lo = min(lo, n - 1)  # (rows past the tensor: vocab padding; read one row, not none)
            if n and (lo > 0 or hi < n):
                rows[k] = (lo, max(hi, lo + 1))
        out = {k: self._blank(k, k in rows) for k in keys}
        with warnings.catch_warnings():  # "assuming ... a single process": so it is (no_dist)
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=self.reader, planner=_RowsPlanner(rows), no_dist=True)
        return out

    def stats(self) -> dict:
        """What the reads cost: bytes read from the files, the checkpoint's stored bytes, batches."""
        stored = sum(m.length for m in self.reader.md.storage_data.values())
        return {"bytes_read": self.reader.bytes_read, "bytes_stored": stored, "batches": self.batches}


class Prefixed:
    """A mapping view of `LazyStates` under "model." (weights), "optim." (with `moments`: each
    name maps to a view of its moments) or "optim.<name>." (one name's moments)."""

    def __init__(self, states, prefix, moments=()):
        self.s, self.p, self.moments = states, prefix, moments

    def __contains__(self, name):
        return self.p + name in self.s

    def __getitem__(self, name):
        if self.moments:  # read on use, moment by moment (in the restore's order)
            return Prefixed(self.s, f"{self.p}{name}.")
        return self.s[self.p + name]

    def __len__(self):
        return sum(k.startswith(self.p) for k in self.s.sizes)


def _meta(ckpt: str) -> dict:
    import json  # (store.read_meta's read: store imports this module)

    with open(os.path.join(ckpt, "meta.json")) as f:
        return json.load(f)


def rng_key(ckpt: str, names) -> str | None:
    """The `rng.stage{k}` key a rank holding `names` restores: that of the lowest stage whose files
    hold one of them (as the first stage file read did), else stage 0's."""
    files = (_meta(ckpt).get("files") or {}).values()
    names = None if names is None else set(names)
    stages = [f["stage"] for f in files if isinstance(f, dict) and "stage" in f
              and (names is None or names & set(f.get("tensors", ())))]
    return f"rng.stage{min(stages) if stages else 0}"


def split_key(key: str):
    """("model", name, None) or ("optim", name, moment) of a flat DCP key, else None."""
    from mini3d.checkpoint.state import MOMENTS

    if key.startswith("model."):
        return "model", key[6:], None
    for m in MOMENTS:
        if key.startswith("optim.") and key.endswith("." + m):
            return "optim", key[6:-len(m) - 1], m
    return None


def read_full(ckpt: str, names=None) -> dict:
    """`store.read_states` of a DCP checkpoint: the full tensors of `names` (all by default)."""
    states = LazyStates(ckpt)
    want = None if names is None else set(names)
    keys = [k for k in states.sizes if (split_key(k) or (0, None))[1] is not None
            and (want is None or split_key(k)[1] in want)]
    rng = rng_key(ckpt, names)
    got = states.read(keys + ([rng] if rng in states else []))
    model, optim = {}, {}
    for k in keys:
        kind, name, moment = split_key(k)
        if kind == "model":
            model[name] = got[k]
        else:
            optim.setdefault(name, {})[moment] = got[k]
    return {"model": model, "optim": optim, "optim_step": int(_meta(ckpt).get("optim_step", 0)),
            "rng": got.get(rng)}


__all__ = ["is_dcp", "dcp_files", "safe_metadata", "LazyStates", "Prefixed", "read_full", "rng_key",
           "split_key", "METADATA", "READ_BYTES_ENV"]
