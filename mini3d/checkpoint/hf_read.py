"""A Hugging Face directory read tensor by tensor, and by a rank only where its share lies.

`HFSource` opens a directory's safetensors files (one, or the shards of
`model.safetensors.index.json`) with `safetensors.safe_open`, which memory-maps them and reads
nothing until asked. `HFState(source, cfg, wanted)` is a read-only mapping {mini3d name: full-shaped
float32 tensor}, one tensor built per access: each mini3d tensor is a set of `Block`s, each one an
HF tensor placed in it (the names and the layouts are mini3d.checkpoint.hf_names': q/k/v rows
concatenated, GPT-2's Conv1D transposed, MoE experts stacked one per row or cut out of the fused
gate_up tensor), and a block is read with `safe_open(...).get_slice(name)[...]` over the box
`wanted[name]` selects in it, so only those bytes are read.

`wanted` is what `mini3d train --init-from-hf` asks for (`rank_share`): the tensors of this rank's
model chunks (its pipeline stage), and in each its ep rows (experts) and tp indices (a column or
row block; the fused qkv's q, k and v rows land in three separate HF tensors, each read over its
own rows). The rest of a full-shaped tensor is NaN, never read: `restore_full_state` slices the
same share out of it (no edit of its own needed), and a slicing that reached past the share would
show as NaN in the loss rather than as plausible weights. Without `wanted` (`mini3d import-hf`)
every tensor is read whole, one at a time.

Why by hand: safetensors reads slices but knows nothing of mini3d's names; torch.distributed.checkpoint
reads its own format, not a Hugging Face directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch

from mini3d.checkpoint.hf_config import HFError
from mini3d.checkpoint.hf_names import OURS, PER_EXPERT, names
from mini3d.config import ModelConfig


class HFSource:
    """The tensors of a local HF directory, by name, opened lazily (a context manager)."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.files = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            self.files = None  # one file: its own keys
        else:
            raise HFError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")
        self.path, self.open = path, {}
        if self.files is None:
            self.files = dict.fromkeys(self._file("model.safetensors").keys(), "model.safetensors")

    def _file(self, name: str):
        from safetensors import safe_open  # (looked up here: tests watch what is read through it)

        if name not in self.open:
            self.open[name] = safe_open(os.path.join(self.path, name), framework="pt")
        return self.open[name]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part `box` of tensor `name` (only those bytes are read), in host memory (a
        slice is built on torch's default device, meta under MINI3D_STRICT_DEVICE=1)."""
        with torch.device("cpu"):
            return self._file(self.files[name]).get_slice(name)[box]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.open.clear()  # (safe_open's handles close when dropped)


class StateSource:
    """An HF state dict held in memory (a transformers model's `state_dict()`), read through the
    same recipes as a directory: one mapping from HF names to mini3d's, for files and dicts."""

    def __init__(self, hf: dict):
        self.hf = hf

    def __contains__(self, name: str) -> bool:
        return name in self.hf

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.hf[name].shape)

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        return self.hf[name][box]


class Block(NamedTuple):
    """full[dst + k] = view[src + k] for k in the box `size`, where view is HF tensor `hf`,
    transposed (GPT-2's Conv1D) and/or with a leading axis of one (an expert stacked at row dst[0])."""
    hf: str
    dst: tuple
    size: tuple
    src: tuple
    transposed: bool = False
    stacked: bool = False


class Recipe(NamedTuple):
    shape: tuple
    blocks: list
    zeros: bool = False  # a tensor HF does not hold (an aux-loss-free expert bias starts at zero)


def _need(source: HFSource, name: str, ours: str) -> tuple:
    if name not in source:
        raise HFError(f"the checkpoint has no tensor {name!r} (needed for {ours})")
    return source.shape(name)


def _whole(source, name: str, ours: str, transposed: bool = False) -> Recipe:
    shape = _need(source, name, ours)
    shape = shape[::-1] if transposed else shape
    return Recipe(shape, [Block(name, (0,) * len(shape), shape, (0,) * len(shape), transposed)])


def _rows(source, theirs: list, ours: str) -> Recipe:
    """The HF tensors `theirs` concatenated along dim 0 (q, k, v rows of a fused qkv)."""
    blocks, row = [], 0
    for name in theirs:
        shape = _need(source, name, ours)
        blocks.append(Block(name, (row,) + (0,) * (len(shape) - 1), shape, (0,) * len(shape)))
        row += shape[0]
    return Recipe((row,) + tuple(shape[1:]), blocks)


def _moe(source, cfg: ModelConfig, i: int) -> dict:
    """Layer i's experts, router and expert bias, from either expert layout (see hf_names)."""
    b, h = f"blocks.{i}.mlp.", f"model.layers.{i}."
    out = {}
    if h + "mlp.experts.gate_up_proj" in source:  # transformers 5's fused experts
        e, two_f, d = source.shape(h + "mlp.experts.gate_up_proj")
        f = two_f // 2
        for k, ours in enumerate(OURS[:2]):  # gate rows first, then up
            out[b + ours] = Recipe((e, f, d), [Block(h + "mlp.experts.gate_up_proj", (0, 0, 0),
                                                     (e, f, d), (0, k * f, 0))])
        out[b + OURS[2]] = _whole(source, h + "mlp.experts.down_proj", b + OURS[2])
        router = h + "mlp.gate.weight"
    else:
        prefix, theirs = PER_EXPERT[cfg.family]
        for n, ours in zip(theirs, OURS):
            blocks = []
            for j in range(cfg.n_experts):
                name = h + f"{prefix}.experts.{j}.{n}.weight"
                shape = _need(source, name, b + ours)
                blocks.append(Block(name, (j, 0, 0), (1, *shape), (0, 0, 0), stacked=True))
            out[b + ours] = Recipe((cfg.n_experts, *shape), blocks)
        router = h + prefix + ".gate.weight"
    out[b + "router.weight"] = _whole(source, router, b + "router.weight")
    out[b + "expert_bias"] = (_whole(source, h + "mlp.gate.e_score_correction_bias", b + "expert_bias")
                              if cfg.mla else Recipe((cfg.n_experts,), [], zeros=True))
    return out


def recipes(source: HFSource, cfg: ModelConfig) -> dict:
    """{mini3d name: Recipe} of every tensor of `cfg` (shapes from the files' headers only); a
    missing HF tensor is HFError naming it and the mini3d tensor it is needed for."""
    out = {}
    for ours, theirs, transposed in names(cfg):
        out[ours] = (_rows(source, theirs, ours) if len(theirs) > 1
                     else _whole(source, theirs[0], ours, transposed))
    for i in range(cfg.n_layers):
        if cfg.is_moe_layer(i):
            out.update(_moe(source, cfg, i))
    return out


def _read_block(source: HFSource, blk: Block, full: torch.Tensor, select) -> None:
    """Copy into `full` the part of block `blk` that `select` (per dim: indices or None) needs."""
    box = []
    for k, (lo, n) in enumerate(zip(blk.dst, blk.size)):
        a, b = lo, lo + n
        if select is not None and select[k] is not None:
            idx = select[k][(select[k] >= lo) & (select[k] < lo + n)]
            if not len(idx):
                return  # nothing of this block is in the share
            a, b = int(idx.min()), int(idx.max()) + 1
        box.append((a, b))
    src = [slice(s + a - d, s + b - d) for (a, b), s, d in zip(box, blk.src, blk.dst)]
    if blk.stacked:
        src = src[1:]
    if blk.transposed:
        src = src[::-1]
    t = source.read(blk.hf, tuple(src))
    t = t.t() if blk.transposed else t
    t = t.unsqueeze(0) if blk.stacked else t
    full[tuple(slice(a, b) for a, b in box)] = t.float()


class HFState(Mapping):
    """{mini3d name: full-shaped float32 tensor}, read on access (see the module docstring)."""

    def __init__(self, source: HFSource, cfg: ModelConfig, wanted: dict | None = None):
        self.source, self.recipes, self.wanted = source, recipes(source, cfg), wanted

    def __getitem__(self, name: str) -> torch.Tensor:
        r = self.recipes[name]
        select = None if self.wanted is None else self.wanted.get(name)
        if r.zeros:
            return torch.zeros(r.shape, device="cpu")  # (host: the strict-device mode makes bare tensors meta)
        # the whole tensor is read into an uninitialised one; a share into NaN, one parameter at
        # a time (restore_full_state asks for them in turn), as materialize_reference draws them
        full = (torch.empty(r.shape, device="cpu") if select is None
                else torch.full(r.shape, float("nan"), device="cpu"))
        for blk in r.blocks:
            _read_block(self.source, blk, full, select)
        return full

    def __iter__(self):
        return iter(self.recipes)

    def __len__(self) -> int:
        return len(self.recipes)


def from_hf_state(hf: dict, cfg: ModelConfig) -> dict:
    """mini3d's full named state from an HF state dict (float32, contiguous); a missing tensor is
    HFError naming it and the mini3d tensor it is needed for."""
    return {name: t.contiguous() for name, t in HFState(StateSource(hf), cfg).items()}


def rank_share(chunks, topo) -> dict:
    """{mini3d name: per-dim indices (None: all)} of what this rank's chunks hold: its stage's
    tensors, in each its experts (ep, dim 0) and its tp indices (vocab padding past the tensor
    selects nothing). A name held twice (a tied head next to the embedding) asks for both."""
    from mini3d.ep import expert_slice
    from mini3d.models.transformer import canonical_name
    from mini3d.tp.parallelize import is_tp_sharded

    out: dict = {}
    for chunk in chunks:
        for n, p in chunk.named_parameters():
            select = [None] * p.dim()
            if getattr(p, "ep_expert", False) and topo.ep.size > 1:
                s = expert_slice(chunk.cfg.n_experts, topo.ep.size, topo.ep.index)
                select[0] = torch.arange(s.start, s.stop, device="cpu")  # (host: see read)
            if is_tp_sharded(p):
                select[p.tp_dim] = p.tp_index.chunk(topo.tp.size)[topo.tp.index].cpu()
            name = canonical_name(n, chunk.cfg)
            if name in out:  # the union of both selections, dim by dim
                select = [None if a is None or b is None else torch.unique(torch.cat([a, b]))
                          for a, b in zip(out[name], select)]
            out[name] = select
    return out


__all__ = ["HFSource", "HFState", "StateSource", "Block", "Recipe", "from_hf_state", "recipes",
           "rank_share"]
