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

Three implementations: "explicit" writes the block math out (any device); "sdpa" calls a fused
flash-attention kernel that returns the log-sum-exp, which F.scaled_dot_product_attention does not:
on CPU the private `aten::_scaled_dot_product_flash_attention_for_cpu` (and its `_backward`), on
CUDA `aten::_scaled_dot_product_flash_attention` (and its `_backward`: the kernels torch's own ring
attention, torch.distributed.tensor.experimental._attention, builds on), where the flash kernel
takes the inputs (fp16 / bf16, head_dim a multiple of 8 up to 256). `kernel_for` makes the choice;
the explicit math is the fallback wherever a kernel is absent or does not apply (float32 on CUDA,
other devices, other torch versions). The CUDA path is exercised on CPU through a mocked kernel
(tests/test_ring_kernels.py): no GPU ran it in this repository's tests.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten
_HAS_CPU_FLASH = (hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu")
                  and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))
_HAS_CUDA_FLASH = (hasattr(_aten, "_scaled_dot_product_flash_attention")
                   and hasattr(_aten, "_scaled_dot_product_flash_attention_backward"))
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least: bf16 is widened, float64 (parity runs) stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (_wide(q) @ _wide(k).transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _device_type(q) -> str:
    return q.device.type  # (a seam: tests/test_ring_kernels.py takes CPU tensors for CUDA ones)


def kernel_for(q, kind: str) -> str:
    """The block math for queries `q` under attention `kind`: "cpu-flash", "cuda-flash" or
    "explicit" (see the module docstring)."""
    if kind != "sdpa":
        return "explicit"
    device = _device_type(q)
    if device == "cpu" and _HAS_CPU_FLASH:
        return "cpu-flash"
    if (device == "cuda" and _HAS_CUDA_FLASH and q.dtype in _FLASH_DTYPES
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256):
        return "cuda-flash"
    return "explicit"


_DENSE = {}  # device -> the flash kernel's (cum_seq_q, cum_seq_k, philox seed, offset) of a dense call


def _dense_call_state(q):
    """What the CUDA flash backward takes besides the tensors, for a dense (not variable-length),
    dropout-free call: the forward's cumulative-sequence placeholders and rng state, taken once per
    device from a one-token forward (dropout 0 never reads the rng state)."""
    key = (q.device, q.dtype)
    if key not in _DENSE:
        one = q.new_zeros(1, 1, 1, 8)
        res = _aten._scaled_dot_product_flash_attention(one, one, one, 0.0, False, False, scale=1.0)
        _DENSE[key] = (res[2], res[3], res[6], res[7])
    return _DENSE[key]


def block_forward(q, k, v, causal: bool, kind: str, scale: float):
    """(out, lse) of q against one key/value block: out (B, nh, Tq, hd) float32, lse (B, nh, Tq)."""
    kernel = kernel_for(q, kind)
    if kernel == "cpu-flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
        return _wide(out), _wide(lse)
    if kernel == "cuda-flash":
        res = _aten._scaled_dot_product_flash_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale)
        return _wide(res[0]), _wide(res[1])
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
    kernel, dt = kernel_for(q, kind), q.dtype
    if kernel == "cpu-flash":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(dt).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.to(dt).contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
        return _wide(dq), _wide(dk), _wide(dv)
    if kernel == "cuda-flash":
        cum_q, cum_k, seed, offset = _dense_call_state(q)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout.to(dt).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.to(dt).contiguous(), lse.float().contiguous(), cum_q, cum_k, q.shape[-2],
            k.shape[-2], 0.0, causal, seed, offset, scale=scale)
        return _wide(dq), _wide(dk), _wide(dv)
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.unsqueeze(-1))  # (B, nh, Tq, Tk); masked entries are exp(-inf) = 0
    dout, out = _wide(dout), _wide(out)
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ _wide(v).transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return (ds @ _wide(k)) * scale, (ds.transpose(-2, -1) @ _wide(q)) * scale, dv
