"""Sampling with a key/value cache (mini3d.models.kv_cache) is sampling without one: the same tokens,
token for token, and each step's logits equal to float32 rounding, for both families (gpt2's learned
positions, llama's rotary with grouped-query attention, deepseek's latent attention, whose cache
keeps the latent), a tied head, the sdpa core, and runs that cross the window (max_seq_len), where
the cache recomputes the last window."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini3d.cli import build_parser
from mini3d.config import ModelConfig
from mini3d.models.attention import attention_core, set_attention
from mini3d.models.transformer import GPT
from mini3d.run.sample import generate, sample_problems

GPT2 = ModelConfig(n_layers=3, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16)
LLAMA = dataclasses.replace(GPT2, family="llama", n_kv_heads=2, d_ff=48, tie_embeddings=True)
CASES = {"gpt2": GPT2, "gpt2-tied": dataclasses.replace(GPT2, tie_embeddings=True),
         "llama-gqa-tied": LLAMA, "llama-mqa": dataclasses.replace(LLAMA, n_kv_heads=1,
                                                                   tie_embeddings=False),
         # multi-head latent attention: the cache keeps the latent (models.kv_cache.LatentCache)
         "deepseek-mla": dataclasses.replace(GPT2, family="deepseek", n_kv_heads=4, d_ff=48,
                                             q_lora_rank=12, kv_lora_rank=8, qk_rope_dim=4,
                                             qk_nope_dim=6, v_head_dim=10)}


def model_of(cfg: ModelConfig, core: str = "explicit") -> GPT:
    """A model whose logits are far apart: the reference init (std 0.02) gives near-uniform logits,
    where float32 rounding could flip a greedy argmax; weights of std 0.3 make a clear winner."""
    model = GPT(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return set_attention(model, core)


def both(model, prompt, n, **kw):
    """(cached ids, uncached ids, cached logits per step, uncached logits per step)."""
    got = {True: [], False: []}
    ids = {c: generate(model, prompt, n, kv_cache=c, on_logits=lambda s, lg, c=c: got[c].append(lg),
                       **kw) for c in (True, False)}
    return ids[True], ids[False], torch.stack(got[True]), torch.stack(got[False])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("prompt_len,n_new", [(5, 8), (5, 30), (20, 6)],
                         ids=["inside", "crosses-window", "prompt-past-window"])
def test_greedy_cached_equals_uncached(name, prompt_len, n_new):
    model = model_of(CASES[name])
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 64, (prompt_len,), generator=g).tolist()
    cached, plain, lc, lp = both(model, prompt, n_new, top_k=1)
    assert cached == plain and len(cached) == prompt_len + n_new
    assert lc.shape == (n_new, 64)
    scale = lp.abs().max().item()
    assert scale > 1.0  # logits far apart (see model_of), so a tie cannot hide a difference
    torch.testing.assert_close(lc, lp, rtol=1e-5, atol=1e-5 * scale)  # float32 rounding
    assert all(b.attn.core is attention_core for b in model.blocks.values())  # the cores restored


def test_sampled_and_sdpa_cached_equal_uncached():
    model = model_of(LLAMA, core="sdpa")
    cached, plain, lc, lp = both(model, [1, 2, 3], 25, temperature=0.8, top_k=10, seed=5)
    assert cached == plain
    torch.testing.assert_close(lc, lp, rtol=1e-5, atol=1e-5 * lp.abs().max().item())


def test_cache_holds_the_kv_heads_not_the_repeated_ones():
    from mini3d.models.kv_cache import KVDecoder

    model = model_of(LLAMA)
    with KVDecoder(model) as dec:
        x = torch.tensor([[1, 2, 3, 4]])
        dec(x)
        dec(torch.cat([x, torch.tensor([[5]])], dim=1))
        core = model.blocks["0"].attn.core
        assert core.k.shape == (1, LLAMA.n_kv_heads, LLAMA.max_seq_len, LLAMA.head_dim)
        assert dec.length == 5 and dec.recomputes == 1  # the prompt ran whole, the token alone


def test_sample_has_a_no_kv_cache_flag():
    parser = build_parser()
    assert parser.parse_args(["sample", "ck"]).kv_cache is True
    assert parser.parse_args(["sample", "ck", "--no-kv-cache"]).kv_cache is False
    both_off = parser.parse_args(["sample", "ck", "--no-kv-cache", "--kv-slide"])
    assert sample_problems(both_off) == ["--kv-slide slides the KV cache, which --no-kv-cache "
                                         "turns off"]
    assert sample_problems(parser.parse_args(["sample", "ck", "--kv-slide"])) == []


def banded_core(window: int):
    """Reference sliding-window attention over a whole sequence: query i reads keys i-window+1..i
    (key/value head i // g for query head i), written plainly (repeated heads, one mask)."""
    def core(q, k, v):
        T, g = q.shape[2], q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        ones = torch.ones(T, T, dtype=torch.bool)
        hidden = ones.triu(1) | ones.tril(-window)
        att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        return torch.softmax(att.masked_fill(hidden, float("-inf")), dim=-1) @ v
    return core


@pytest.mark.parametrize("name", ["llama-gqa-tied", "llama-mqa"])
def test_sliding_cache_is_sliding_window_attention(name):
    """`slide=True` past the window equals the whole sequence run at positions 0..n-1 with every
    position reading the last max_seq_len ones, token for token and logits to float32 rounding."""
    from mini3d.models.kv_cache import KVDecoder

    cfg = CASES[name]
    model = model_of(cfg)
    got = []
    ids = generate(model, [3, 1, 4, 1, 5], 40, top_k=1, slide=True,
                   on_logits=lambda s, lg: got.append(lg))
    for block in model.blocks.values():
        block.attn.core = banded_core(cfg.max_seq_len)
    x = torch.tensor([ids])
    with torch.no_grad():  # the banded model's logits for each prefix the sampler extended
        ref = model(x[:, :-1], positions=torch.arange(len(ids) - 1))[0, 4:]
    lc = torch.stack(got)
    assert torch.equal(ref.argmax(-1), x[0, 5:])  # its greedy tokens are the sampler's
    torch.testing.assert_close(lc, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert generate(model_of(cfg), [3, 1, 4, 1, 5], 40, top_k=1)[:cfg.max_seq_len + 1] == \
        ids[:cfg.max_seq_len + 1]  # inside the window sliding and recomputing agree
    with pytest.raises(ValueError, match="rotary"):
        KVDecoder(model_of(GPT2), slide=True)
