"""Ring attention's block kernels (issue #34 item 4): on CUDA the fused flash kernel that returns
the log-sum-exp, the CPU path unchanged, the explicit math wherever no kernel applies.

No GPU runs here, so the CUDA kernel is a mock: CPU tensors pass for CUDA ones
(`blocks._device_type`), and `aten::_scaled_dot_product_flash_attention` / `_backward` are stand-ins
with the real ops' signatures (checked against this torch's schemas) that record their arguments and
compute with the CPU flash kernel. The test then checks the choice, what the ring hands the kernel
(the row's final out and lse in the backward, the dense call's placeholders, max_q / max_k) and
that the merged result equals the explicit math on the same bf16 inputs.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from mini3d.cp import blocks

_aten = torch.ops.aten


def _inputs(dtype, hd=16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(1, 2, 8 if i != 1 and i != 2 else 16, hd, generator=g, device="cpu")
                     .to(dtype) for i in range(4))
    return q, k, v, dout


class FakeCudaFlash:
    """The two CUDA ops, computed by the CPU flash kernel, with their call records."""

    def __init__(self):
        self.forward_calls, self.backward_calls = [], []
        self.placeholders = (object(), object(), torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64))

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, is_causal, return_debug_mask,
                                            *, scale=None):
        self.forward_calls.append((tuple(q.shape), tuple(k.shape), dropout_p, is_causal, scale))
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                    scale=scale)
        cum_q, cum_k, seed, offset = self.placeholders
        return out, lse, cum_q, cum_k, q.shape[-2], k.shape[-2], seed, offset, None

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, out, lse, cum_q, cum_k,
                                                     max_q, max_k, dropout_p, is_causal, seed,
                                                     offset, *, scale=None):
        assert (cum_q, cum_k, seed, offset) == self.placeholders or all(
            a is b for a, b in zip((cum_q, cum_k, seed, offset), self.placeholders))
        assert (max_q, max_k) == (q.shape[-2], k.shape[-2]) and dropout_p == 0.0
        assert lse.dtype == torch.float32 and out.dtype == q.dtype
        self.backward_calls.append((tuple(q.shape), tuple(k.shape), is_causal, scale))
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, dropout_p, is_causal, scale=scale)


def test_the_mock_has_the_real_ops_signatures():
    """Same positional arguments in the same order, `scale` keyword-only, as this torch's ops."""
    import inspect

    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"):
        schema = getattr(_aten, name).default._schema
        real = [(a.name, a.kwarg_only) for a in schema.arguments]
        params = [p for p in inspect.signature(getattr(FakeCudaFlash, name)).parameters.values()
                  if p.name != "self"]
        fake = [(p.kind == p.KEYWORD_ONLY) for p in params]
        assert [kw for _, kw in real] == fake, (name, real)
        assert real[-1] == ("scale", True) and params[-1].name == "scale"
        assert len(schema.returns) == (9 if name.endswith("attention") else 3)


@pytest.fixture
def as_cuda(monkeypatch):
    fake = FakeCudaFlash()
    ns = types.SimpleNamespace(
        _scaled_dot_product_flash_attention=fake._scaled_dot_product_flash_attention,
        _scaled_dot_product_flash_attention_backward=fake._scaled_dot_product_flash_attention_backward)
    monkeypatch.setattr(blocks, "_aten", ns)
    monkeypatch.setattr(blocks, "_device_type", lambda q: "cuda")
    monkeypatch.setattr(blocks, "_HAS_CUDA_FLASH", True)
    monkeypatch.setattr(blocks, "_DENSE", {})
    return fake


def test_the_kernel_choice():
    q16, q32 = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16), torch.zeros(1, 1, 4, 16)
    assert blocks.kernel_for(q32, "sdpa") == ("cpu-flash" if blocks._HAS_CPU_FLASH else "explicit")
    assert blocks.kernel_for(q16, "explicit") == "explicit"


def test_cuda_choice(as_cuda):
    bf16, fp16 = torch.bfloat16, torch.float16
    assert blocks.kernel_for(torch.zeros(1, 1, 4, 16, dtype=bf16), "sdpa") == "cuda-flash"
    assert blocks.kernel_for(torch.zeros(1, 1, 4, 256, dtype=fp16), "sdpa") == "cuda-flash"
    assert blocks.kernel_for(torch.zeros(1, 1, 4, 16), "sdpa") == "explicit"  # float32
    assert blocks.kernel_for(torch.zeros(1, 1, 4, 12, dtype=bf16), "sdpa") == "explicit"  # hd % 8
    assert blocks.kernel_for(torch.zeros(1, 1, 4, 264, dtype=bf16), "sdpa") == "explicit"  # hd > 256
    assert blocks.kernel_for(torch.zeros(1, 1, 4, 16, dtype=bf16), "explicit") == "explicit"


def test_two_blocks_through_the_cuda_kernel_equal_the_explicit_math(as_cuda):
    """Queries 8..15 against keys [0..7 | 8..15 causal], merged, then each block's backward from
    the final out and lse: the mocked CUDA kernel is what runs, and it agrees with the explicit
    math on the same bf16 inputs (float32 accumulation both; bound: bf16's input rounding of
    out / dout in the kernel's backward, ~2^-8 relative)."""
    q, k, v, dout = _inputs(torch.bfloat16)
    scale = 1 / math.sqrt(q.shape[-1])
    halves = [(k[..., :8, :], v[..., :8, :], False), (k[..., 8:, :], v[..., 8:, :], True)]
    got = blocks.merge(*blocks.block_forward(q, *halves[0], "sdpa", scale),
                       *blocks.block_forward(q, *halves[1], "sdpa", scale))
    assert len(as_cuda.forward_calls) == 2 and [c[3] for c in as_cuda.forward_calls] == [False, True]
    grads = [blocks.block_backward(dout, q, kk, vv, *got, causal, "sdpa", scale)
             for kk, vv, causal in halves]
    assert len(as_cuda.backward_calls) == 2
    want = blocks.merge(*blocks.block_forward(q, *halves[0], "explicit", scale),
                        *blocks.block_forward(q, *halves[1], "explicit", scale))
    want_grads = [blocks.block_backward(dout, q, kk, vv, *want, causal, "explicit", scale)
                  for kk, vv, causal in halves]
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-3)
    for g, w in zip(grads, want_grads):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    # the backward's dense-call placeholders: one one-token forward, once per device and dtype
    assert len(as_cuda.forward_calls) == 3 and as_cuda.forward_calls[2][0] == (1, 1, 1, 8)
    assert len(blocks._DENSE) == 1
