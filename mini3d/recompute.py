"""Activation recomputation (time for memory) on top of `torch.utils.checkpoint`, and a ledger that
measures what each layer keeps for backward.

Policies (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"):

* `none`: every layer keeps all the tensors its backward needs.
* `selective`: only the attention core (scores, softmax, weighted sum of values) is recomputed in
  backward. It holds the a*s^2 term (the (T, T) attention matrix per head) but costs few FLOPs, so this
  saves much memory for little time.
* `full`: each transformer block keeps only its input and recomputes the whole block in backward
  (about one extra forward pass: ~33% more compute).

The activation ledger uses `torch.autograd.graph.saved_tensors_hooks` to see every tensor autograd
saves, attributes it to the module running at that moment (tracked with forward pre-hooks), and counts
each storage once (q, k and v are views of one qkv output; parameters are not activations).

Per-layer bytes for this model in float32 with no dropout (computed by
`mini3d.cost.memory.layer_activation_bytes`, which the tests compare with this ledger) (s tokens, b sequences, h hidden, a heads,
t tensor-parallel ranks), adapting Korthikanti's 16-bit count s*b*h*(34 + 5*a*s/h):

    none:      s*b*h*(16 + 48/t) + 4*a*s^2*b/t     (t=1: 64*s*b*h + 4*a*s^2*b)
    selective: s*b*h*(16 + 48/t)                   (the attention matrix is not kept)
    full:      4*s*b*h                             (only the block input)

Term by term at t=1: LayerNorm inputs 2 x 4sbh, their outputs (inputs of qkv and fc) 2 x 4sbh, the
qkv output (q, k, v) 12sbh, the attention matrix 4*a*s^2*b, the out-projection input 4sbh, the GELU
input and output (fc output, proj input) 2 x 16sbh. Korthikanti's 34 and 5 become 2 x (34 - 2) = 64
and 2 x (5 - 3) = 4 once the three dropout tensors (masks and the dropped attention) are removed and
2-byte values become 4-byte ones. Small terms (LayerNorm mean/rstd, the causal mask) are left out.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

POLICIES = ("none", "selective", "full")


def _checkpointed(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return checkpoint(fn, *args, use_reentrant=False)

    wrapper.recomputed = True
    return wrapper


def apply_recompute(model: nn.Module, policy: str) -> nn.Module:
    """Apply a recomputation policy in place to every transformer block of a mini3d GPT (or stage)."""
    if policy not in POLICIES:
        raise ValueError(f"recompute={policy!r} is unknown (choose {', '.join(POLICIES)})")
    if policy == "none":
        return model
    for block in model.blocks.values():
        if policy == "selective":
            if not getattr(block.attn.core, "recomputed", False):
                block.attn.core = _checkpointed(block.attn.core)
        else:
            if not getattr(block.forward, "recomputed", False):
                block.forward = _checkpointed(block.forward)
    return model


class ActivationLedger:
    """Measures bytes saved for backward, by module category, while active (a context manager)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.by_category: collections.Counter = collections.Counter()
        self._stack: list[str] = []
        # (address, size) of each storage counted in this forward -> the storage itself, held so that
        # its memory cannot be handed out again within the forward: a tensor saved by a graph that
        # is dropped mid-forward (a router's temporary) would otherwise free an address a later,
        # different tensor of the same size gets, and be taken for it (the count then depended on
        # the allocator's history)
        self._seen: dict = {}
        self._params = {p.data_ptr() for p in model.parameters()}
        self._handles = []

    def _category(self, name: str) -> str:
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) >= 2:
            layer = f"layer{parts[1]}"
            if len(parts) == 2:
                return f"{layer}.block"
            return f"{layer}.{parts[2]}"
        return parts[0] or "model"

    def _enter(self, name):
        def pre(_module, _inputs):
            self._stack.append(self._category(name))
        return pre

    def _exit(self, _module, _inputs, _output):
        if self._stack:
            self._stack.pop()

    def _pack(self, t: torch.Tensor):
        if t.data_ptr() not in self._params:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in self._seen:
                self._seen[key] = storage
                self.by_category[self._stack[-1] if self._stack else "model"] += storage.nbytes()
        return t

    def _new_forward(self, _module, _inputs):
        # Storage is deduplicated within one forward (views of one tensor count once), not across
        # micro-batches: once a backward has freed the previous micro-batch's tensors, the allocator
        # hands their addresses out again, and equal (address, size) keys would hide new tensors.
        self._seen.clear()

    def __enter__(self):
        self._handles.append(self.model.register_forward_pre_hook(self._new_forward))
        for name, mod in self.model.named_modules():
            if name:
                self._handles.append(mod.register_forward_pre_hook(self._enter(name)))
                self._handles.append(mod.register_forward_hook(self._exit))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def layer_bytes(self, layer_id) -> int:
        """All bytes attributed to one transformer block (its sub-modules included)."""
        prefix = f"layer{layer_id}."
        return sum(v for k, v in self.by_category.items() if k.startswith(prefix))

    @property
    def total(self) -> int:
        return sum(self.by_category.values())


@contextlib.contextmanager
def measure_activations(model: nn.Module):
    ledger = ActivationLedger(model)
    with ledger:
        yield ledger
