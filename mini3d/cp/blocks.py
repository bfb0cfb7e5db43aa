"""Attention on one (query block, key/value block) pair, returning the log-sum-exp, and the rule
that combines two such partial results; the pieces ring attention is built from.

For queries q and one block of keys/values (k, v), with scores s = q k^T * scale:

    lse = log sum_j exp(s_j)              (per query row)
    out = sum_j exp(s_j - lse) v_j        (the block's softmax-weighted values)

Two blocks A and B of the same queries combine exactly (the log-sum-exp rule of flash attention and
ring attention): lse = logaddexp(lse_A, lse_B), out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B.

The backward of one block, given the FINAL out and lse of the whole row (flash-attention style, so
nothing (T, T) is kept between blocks): p = exp(s - lse), dv = p^T dout, dp = dout v^T,
ds = p * (dp - rowsum(dout * out)), dq = ds k * scale, dk = ds^T q * scale. Summing these over all
blocks gives the gradients of full attention.

Two implementations: "explicit" writes the block math out (any device), "sdpa" calls the fused CPU
flash-attention kernel, which returns the log-sum-exp. F.scaled_dot_product_attention does not
return it, so the private ops `aten::_scaled_dot_product_flash_attention_for_cpu` (and its
`_backward`) are used: checked for at import, used on CPU tensors only, and the explicit math is the
fallback wherever they are absent (other devices, other torch versions).
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten
_HAS_CPU_FLASH = (hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu")
                  and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least: bf16 is widened, float64 (parity runs) stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (_wide(q) @ _wide(k).transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _fused(q) -> bool:
    return _HAS_CPU_FLASH and q.device.type == "cpu"


def block_forward(q, k, v, causal: bool, kind: str, scale: float):
    """(out, lse) of q against one key/value block: out (B, nh, Tq, hd) float32, lse (B, nh, Tq)."""
    if kind == "sdpa" and _fused(q):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
        return _wide(out), _wide(lse)
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ _wide(v), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial results of the same queries over disjoint key blocks (see above)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, kind: str, scale: float):
    """(dq, dk, dv) contributions of one key/value block, from the row's final `out` and `lse`."""
    if kind == "sdpa" and _fused(q):
        dt = q.dtype
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(dt).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.to(dt).contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
        return _wide(dq), _wide(dk), _wide(dv)
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1))  # (B, nh, Tq, Tk); masked entries are exp(-inf) = 0
    dout, out = _wide(dout), _wide(out)
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ _wide(v).transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return (ds @ _wide(k)) * scale, (ds.transpose(-2, -1) @ _wide(q)) * scale, dv
