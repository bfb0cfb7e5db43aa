"""Wrong answers to lse_merge (07b), recompute (07) and explain_hang (08)."""

from __future__ import annotations

import functools
import math

import torch
from torch.utils.checkpoint import checkpoint

from solutions.lse_merge import block_attention as _block

from . import variant


def merge_exp_direct(out_a, lse_a, out_b, lse_b):
    """Weights exp(lse_a) / (exp(lse_a) + exp(lse_b)): overflows for scores in the thousands."""
    ea, eb = torch.exp(lse_a).unsqueeze(-1), torch.exp(lse_b).unsqueeze(-1)
    return (ea * out_a + eb * out_b) / (ea + eb), torch.log(torch.exp(lse_a) + torch.exp(lse_b))


def merge_max(out_a, lse_a, out_b, lse_b):
    """The block with the larger log-sum-exp wins outright (max, not logaddexp)."""
    pick = (lse_a >= lse_b).unsqueeze(-1)
    return torch.where(pick, out_a, out_b), torch.maximum(lse_a, lse_b)


def block_unscaled(q, k, v, causal):
    """Scores q k^T without the 1 / sqrt(d)."""
    return _block(q * math.sqrt(q.shape[-1]), k, v, causal)


def block_mask_diagonal(q, k, v, causal):
    """The causal mask also hides the diagonal (triu(0)): query 0 sees nothing."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _recompute(model, policy, selective, full):
    for block in model.blocks.values():
        (selective if policy == "selective" else full if policy == "full" else (lambda b: None))(block)
    return model


def _wrap_forward(module):
    module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def _wrap_core(block):
    block.attn.core = functools.partial(checkpoint, block.attn.core, use_reentrant=False)


def whole_attention(model, policy):
    """'selective' checkpoints the whole attention module: its projections are rerun too."""
    return _recompute(model, policy, lambda b: _wrap_forward(b.attn), _wrap_forward)


def full_is_selective(model, policy):
    """'full' wraps only the attention core, as 'selective' does."""
    return _recompute(model, policy, _wrap_core, _wrap_core)


def fresh_core(model, policy):
    """'selective' checkpoints mini3d's attention_core, not the function installed in block.attn.core."""
    from mini3d.models.attention import attention_core

    def selective(b):
        b.attn.core = functools.partial(checkpoint, attention_core, use_reentrant=False)
    return _recompute(model, policy, selective, _wrap_forward)


def _pending(logs):
    return [e for evs in logs.values() for e in evs if e["end"] is None]


def last_pending(logs):
    """Explains the most recent pending collective: a consequence of the hang, not its cause."""
    pending = _pending(logs)
    if not pending:
        return None
    last = max(pending, key=lambda e: e["start"])
    key = (last["axis"], last["op"], last["seq"])
    mine = [(r, e) for r in last["group"] for e in logs.get(r, []) if (e["axis"], e["op"], e["seq"]) == key]
    return {"axis": key[0], "op": key[1], "seq": key[2],
            "waiting": sorted({r for r, e in mine if e["end"] is None}),
            "missing": sorted(set(last["group"]) - {r for r, _ in mine})}


def everyone_pending(logs):
    """The right collective, but every rank with anything pending counted as waiting for it."""
    from solutions.explain_hang import explain_hang

    got = explain_hang(logs)
    if got is not None:
        got["waiting"] = sorted({e_rank for e_rank, evs in logs.items() if any(e["end"] is None for e in evs)})
    return got


def empty_when_fine(logs):
    from solutions.explain_hang import explain_hang

    return explain_hang(logs) or {}


WRONG = {
    "lse_merge": [
        ("merge_exp_direct", variant("lse_merge", "exp of the lse overflows", merge=merge_exp_direct)),
        ("merge_max", variant("lse_merge", "max instead of logaddexp", merge=merge_max)),
        ("block_unscaled", variant("lse_merge", "no 1/sqrt(d)", block_attention=block_unscaled)),
        ("block_mask_diagonal", variant("lse_merge", "mask hides the diagonal", block_attention=block_mask_diagonal)),
    ],
    "recompute": [
        ("whole_attention", variant("recompute", "selective = the whole attention module", apply_recompute=whole_attention)),
        ("full_is_selective", variant("recompute", "full wraps only the core", apply_recompute=full_is_selective)),
        ("fresh_core", variant("recompute", "wraps attention_core, not the installed core", apply_recompute=fresh_core)),
    ],
    "explain_hang": [
        ("last_pending", variant("explain_hang", "the last pending collective", explain_hang=last_pending)),
        ("everyone_pending", variant("explain_hang", "every pending rank waits", explain_hang=everyone_pending)),
        ("empty_when_fine", variant("explain_hang", "{} instead of None", explain_hang=empty_when_fine)),
    ],
}
