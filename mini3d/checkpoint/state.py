"""Between the sharded training state of one rank and the full, named state of a checkpoint.

`gather_full_state` turns this rank's (tp-sliced, ep-sliced, ZeRO-sharded) fp32 masters and AdamW moments
into full tensors keyed by reference parameter name (only writer ranks keep the host copies);
`restore_full_state` slices full, named tensors back into any layout (from plain dicts, or from the
lazy batched reader of a sharded checkpoint, mini3d/checkpoint/dcp_read.py). Checkpoint saves use
`sharded.gather_shares`, the same gathers keeping only each rank's share; `gather_full_state` serves
whoever needs the whole state at once (sampling during training, tests). The file format, the
atomic commit and the verification are in `mini3d/checkpoint/store.py`.
"""

from __future__ import annotations

import torch


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state


def _names(chunks) -> dict:
    """{parameter: reference name} over this rank's model chunks (names are the full model's; a
    tied head's copy on the last stage is saved and restored as the embedding it equals)."""
    from mini3d.models.transformer import canonical_name

    return {p: canonical_name(n, chunk.cfg) for chunk in chunks for n, p in chunk.named_parameters()}


def _buffers(chunks) -> dict:
    """{name: buffer}: the persistent state outside the optimizer, replicated on every rank (a MoE
    layer's aux-loss-free `expert_bias`), saved and restored next to the weights."""
    return {f"{m}.{k}" if m else k: b for chunk in chunks for m, mod in chunk.named_modules()
            for k, b in mod._buffers.items() if b is not None and k not in mod._non_persistent_buffers_set}


def full_tensors(chunks, optimizer, topo, with_moments: bool = True):
    """Yield (reference name, key, full fp32 tensor) for each of this rank's parameters: key
    "weight" (the fp32 master) or an AdamW moment. Each comes from an all-gather over ZeRO's
    shard group (when the optimizer state is sharded), `unshard_like` over tp and `gather_experts`
    over ep: collective, so every rank must drain the generator with the same `with_moments`,
    whatever it keeps. One flat shard is gathered at a time and dropped before the next."""
    from mini3d import comm
    from mini3d.ep import gather_experts
    from mini3d.tp import unshard_like

    names = _names(chunks)
    sharded = optimizer.wrapper.strategy.shards_optimizer_states
    for (group, _, _), master in zip(optimizer.shards, optimizer.masters):
        state = optimizer.inner.state.get(master, {})
        tensors = {"weight": master.detach()}
        tensors.update({k: state[k] for k in MOMENTS if k in state and with_moments})
        for key, shard in tensors.items():
            full = shard
            if sharded:
                full = torch.empty(group.padded, dtype=shard.dtype, device=shard.device)
                axis = getattr(group, "axis", topo.dp_cp)  # ZeRO's shard group (experts: edp)
                comm.all_gather(full, shard.contiguous(), axis)
            for p, local in group.views(full):
                value = unshard_like(p, local.to(torch.promote_types(local.dtype, torch.float32)), topo)
                yield names[p], key, gather_experts(p, value, topo)  # ep: the full (E, ...) tensor
            del full


def optimizer_step(optimizer) -> int:
    """The optimizer steps taken so far (AdamW's `step`, the same for every parameter; 0 before the
    first)."""
    steps = [state["step"] for state in map(optimizer.inner.state.get, optimizer.masters)
             if state and "step" in state]
    return int(steps[-1]) if steps else 0


def gather_full_state(chunks, optimizer, topo, keep: bool = True, *,
                      with_moments: bool = True) -> tuple[dict, dict, int]:
    """(weights, moments, optimizer step) of this rank's chunks at full shape, keyed by reference
    name. Weights come from the fp32 master copies (so bf16 runs resume exactly). Collective over
    the dp and tp axes (`full_tensors`): every rank must call it, but only a rank with `keep` (a
    writer) builds the full host copies; the others take part in each gather and drop its result
    at once. `with_moments=False` gathers the weights alone (a sample needs no AdamW moments):
    every rank must pass the same value, and the moments come back empty."""
    weights, moments = {}, {}
    for name, key, value in full_tensors(chunks, optimizer, topo, with_moments):
        if not keep:
            continue
        value = value.cpu()
        if key == "weight":
            weights[name] = value
        else:
            moments.setdefault(name, {})[key] = value
    if keep:
        weights.update({n: b.detach().cpu().clone() for n, b in _buffers(chunks).items()})
    return weights, moments, optimizer_step(optimizer)


def in_shard(group, p, sharded: bool) -> bool:
    """Whether this rank's ZeRO shard of flat group `group` holds any of parameter `p` (always,
    without sharding). A restore reads only such parameters: the rest of the flat group is sliced
    away, and the all-gather after the restore brings their values from the ranks that hold them."""
    if not sharded:
        return True
    off = group.offset_of[id(p)]
    return off < group.hi and off + p.numel() > group.lo


def restore_order(chunks, optimizer) -> list[str]:
    """The flat keys ("model.<name>", "optim.<name>.<moment>") `restore_full_state` reads, in its
    order (the lazy reader's batches): the buffers, then each flat group's parameters `in_shard`."""
    names = _names(chunks)
    sharded = optimizer.wrapper.strategy.shards_optimizer_states
    order = [f"model.{n}" for n in _buffers(chunks)]
    for group, _, _ in optimizer.shards:
        mine = [p for p in group.params if in_shard(group, p, sharded)]
        order += [f"model.{names[p]}" for p in mine]
        order += [f"optim.{names[p]}.{m}" for m in MOMENTS for p in mine]
    return order


@torch.no_grad()
def restore_full_state(chunks, optimizer, topo, weights: dict, moments: dict, step: int):
    """Load full, named weights and AdamW moments into this rank's (tp-sliced, dp-sharded) state.
    Only the tensors `restore_order` lists are read (under ZeRO, those of this rank's shard)."""
    from mini3d.ep import slice_experts
    from mini3d.tp import shard_like

    names = _names(chunks)
    for n, b in _buffers(chunks).items():
        if n in weights:  # (checkpoints of models without such state hold none)
            b.copy_(weights[n].to(b.device, b.dtype))
    sharded = optimizer.wrapper.strategy.shards_optimizer_states
    fused = bool(optimizer.inner.defaults.get("fused"))  # fused AdamW keeps `step` on the device
    for (group, pshard, _), master in zip(optimizer.shards, optimizer.masters):
        def local_flat(source, key=None):
            flat = torch.zeros(group.padded, dtype=master.dtype, device=master.device)
            for p, view in group.views(flat):
                if not in_shard(group, p, sharded):
                    continue  # sliced away below: never read
                full = source[names[p]] if key is None else source[names[p]][key]
                # sliced where the full tensor lies (host memory, often a memory map), then moved:
                # only this rank's share crosses to its device, never the whole tensor
                view.copy_(shard_like(p, slice_experts(p, full, topo), topo).to(master.device))
            return flat[group.lo:group.hi] if sharded else flat

        master.copy_(local_flat(weights))
        if master.data_ptr() != pshard.data_ptr():
            pshard.copy_(master)  # bf16 parameters from the restored fp32 masters
        if moments and step > 0:
            optimizer.inner.state[master] = {
                "step": torch.tensor(float(step), device=master.device if fused else "cpu"),
                **{k: local_flat(moments, k).clone() for k in MOMENTS}}
    optimizer.wrapper.after_step()  # ZeRO-1/2: every rank re-gathers the parameters it updated


__all__ = ["MOMENTS", "full_tensors", "gather_full_state", "in_shard", "optimizer_step",
           "restore_full_state", "restore_order"]
