"""Reading a sharded (DCP) checkpoint (the format and the design are in mini3d/checkpoint/sharded.py).

`LazyStates` hands `restore_full_state` full tensors on demand, read with `dcp.load(no_dist=True)` in
batches of at most MINI3D_CKPT_READ_BYTES (default 256 MiB) in the order the restore asks for them:
a rank reads only the tensors its parameters need, never its whole stage at once.
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
    """DCP's reader with the index read once (through `safe_metadata`), not once per batch."""

    def __init__(self, ckpt):
        super().__init__(ckpt)
        self.md = safe_metadata(ckpt)

    def read_metadata(self, *a, **k):
        if getattr(self.md, "storage_meta", None) is not None:
            self.md.storage_meta.load_id = self.load_id
        return self.md


@dataclass
class LazyStates:
    """Full tensors of a DCP checkpoint by flat key ("model.<name>", "optim.<name>.exp_avg"),
    read in bounded batches in the order `order` lists them (misses start a new batch there)."""
    ckpt: str
    order: list = field(default_factory=list)
    budget: int = 0
    reader: object = None
    batch: dict = field(default_factory=dict)
    batches: int = 0

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

    def read(self, keys) -> dict:
        out = {k: torch.empty(self.sizes[k].size, dtype=self.sizes[k].properties.dtype, device="cpu")
               for k in keys}  # (explicitly: MINI3D_STRICT_DEVICE makes the default device meta)
        with warnings.catch_warnings():  # "assuming ... a single process": so it is (no_dist)
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=self.reader, no_dist=True)
        return out


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
