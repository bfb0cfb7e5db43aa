"""Model-state ledger: the bytes this rank holds in parameters, gradients, master weights and
optimizer state, read from the live tensors.

Each tensor is charged by its *storage* (the allocation it lives in), and each storage once, in the
category order below: a float32 master shard that is a view of the flat parameter buffer costs
nothing extra, and a gradient that is a view of a bucket buffer is charged with the bucket. Freed
ZeRO-3 buffers (storage resized to 0) count 0. `optimizer_scalars` holds per-tensor scalars such as
AdamW's `step` counter (4 bytes per flat group), kept apart so the per-parameter categories compare
exactly with the ZeRO paper's formulas. The categories are those of the memory estimator:
parameters, gradients, optimizer state (masters and moments).
"""

from __future__ import annotations

import torch

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states", "optimizer_scalars")


class GradMeter:
    """The gradient bytes a data-parallel wrapper holds right now (`now`) and the most it held at
    any moment since `reset()` (`peak`).

    The wrapper calls `hold(key, tensor)` when it allocates a gradient buffer (bucket buffers,
    shards, reduce-scatter outputs, ZeRO-3 accumulation buffers) and `release(key)`
    when it lets one go; each tensor is charged by its storage's size, as the ledger charges it.
    Only the wrapper's own buffers count: the gradient autograd hands to a hook for one parameter
    (freed as soon as the hook has moved it) is the same transient for every ZeRO stage."""

    def __init__(self):
        self._held: dict = {}
        self.now = 0
        self.peak = 0

    def hold(self, key, tensor: torch.Tensor | None):
        nbytes = 0 if tensor is None else tensor.untyped_storage().nbytes()
        self.now += nbytes - self._held.get(key, 0)
        self._held[key] = nbytes
        self.peak = max(self.peak, self.now)

    def release(self, key):
        self.now -= self._held.pop(key, 0)

    def reset(self):
        """Start a new measurement window (a step): the peak restarts from what is held now."""
        self.peak = self.now


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()


def model_state_ledger(module, optimizer=None) -> dict:
    """{category: bytes, ..., "total": bytes} for `module` (a plain module or a mini3d dp wrapper)
    and `optimizer` (a mini3d ShardedOptimizer or a plain torch.optim optimizer)."""
    tensors = {c: [] for c in CATEGORIES}
    inner = getattr(module, "module", module)
    tensors["parameters"] += [p for p in inner.parameters()]
    tensors["gradients"] += [p.grad for p in inner.parameters() if p.grad is not None]
    for src in (module, optimizer):
        if src is not None and hasattr(src, "state_tensors"):
            for c, ts in src.state_tensors().items():
                tensors[c] += ts
    if optimizer is not None and not hasattr(optimizer, "state_tensors"):  # plain torch.optim
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors["master_weights"].append(p)
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        key = "optimizer_states" if v.numel() == p.numel() else "optimizer_scalars"
                        tensors[key].append(v)
    seen, out = set(), {}
    for c in CATEGORIES:
        total = 0
        for t in tensors[c]:
            key, nbytes = _storage_key(t)
            if nbytes == 0 or key in seen:
                continue
            seen.add(key)
            total += nbytes
        out[c] = total
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out
