"""A key/value cache for single-process decoding: each new token costs one position, not a window.

Without a cache every sampled token runs the model over the whole context again. With one, each
attention layer keeps the keys and values of the positions it has seen (the llama family's after
rotary, and only its n_kv_heads key/value heads under grouped-query attention, never the repeated
ones; the deepseek family's latent instead, `LatentCache`), so the first call processes the prompt and each next call the new token alone, at its own
position: the embedding's learned position (gpt2) and rotary's angle (llama) both come from the
`positions` argument `mini3d.models.transformer.GPT` already takes.

The cache sits in the attention layers' `core` slot (`Attention.core`, where mini3d.models.transformer puts the
scores-softmax-sum): `KVDecoder` swaps a `CachedCore` in for the model's own core while it is open
and puts the original back when it closes. The training path is untouched and pays nothing: no
extra argument, no branch in `mini3d.models.transformer`.

The window. The uncached loop feeds the last `max_seq_len` tokens at positions 0..max_seq_len-1.
Once a context outgrows that window, every kept token changes position (gpt2: its learned position
embedding, added before the first block, changes, so every cached key and value is stale; llama:
rotary's scores depend only on distances, but each block's hidden states would have seen a shorter
context, so deeper layers' keys differ too). Sliding the cache would therefore sample something
else than the uncached model. `KVDecoder` recomputes instead: past the window each step runs the
last `max_seq_len` tokens afresh (the uncached cost; sampled tokens stay equal token for token).
For rotary positions it can slide instead (`slide=True`, `mini3d sample --kv-slide`): the newest
max_seq_len keys stay cached at their own positions and each new token reads them, which is
exactly sliding-window attention (every layer, every position attends to the last max_seq_len
positions, as in Mistral), at the decode cost of one position; its tokens past the window are that
model's, not the cropped loop's.
"""

from __future__ import annotations

import math

import torch


def offset_attention(q, k, v):
    """Causal attention of T new queries at positions S-T..S-1 over S keys at 0..S-1; q (B, nh, T,
    hd), k and v (B, nkv, S, hd). The same arithmetic as `mini3d.models.attention.attention_core` (g = nh / nkv
    query heads of one key/value head stacked along the sequence), with the causal mask shifted by
    the S - T positions already cached; for S == T it is attention_core itself."""
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    q = q.reshape(B, nkv, g * T, hd)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, nkv, g*T, S)
    if T > 1:  # one query (the usual decode step) may read every cached key
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(S - T + 1).repeat(g, 1)
        att = att.masked_fill(causal, float("-inf"))
    y = torch.softmax(att, dim=-1) @ v  # (B, nkv, g*T, v's width: hd, or MLA's v_head_dim)
    return y.view(B, nh, T, v.shape[-1])


class CachedCore:
    """An attention core that writes each call's k and v (B, nkv, T, hd) into preallocated buffers
    of `capacity` positions and attends over everything cached. A call on an empty cache (the
    prompt) goes through the model's own `core` (explicit or sdpa), so it is the uncached model.
    Full, it takes one more position only when `slide` is set: the new k and v overwrite the
    oldest (slot = position % capacity; with one query the order of the keys does not matter)."""

    def __init__(self, core, capacity: int, slide: bool = False):
        self.core, self.capacity, self.slide = core, capacity, slide
        self.k = self.v = None  # (B, nkv, capacity, hd) once the first call shows B, dtype, device
        self.length = 0  # positions seen since the last reset (the cached ones: the last capacity)

    def __call__(self, q, k, v):
        start, T = self.length, k.shape[2]
        if start + T > self.capacity and not (self.slide and T == 1):
            raise ValueError(f"KV cache: {start} cached + {T} new positions > capacity "
                             f"{self.capacity}")
        if self.k is None or self.k.shape[0] != k.shape[0]:
            shape = (k.shape[0], k.shape[1], self.capacity)  # (v may be narrower: deepseek's MLA)
            self.k = torch.empty(shape + k.shape[3:], dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape + v.shape[3:], dtype=v.dtype, device=v.device)
        slot = start % self.capacity
        self.k[:, :, slot:slot + T] = k
        self.v[:, :, slot:slot + T] = v
        self.length = start + T
        if start == 0:
            return self.core(q, k, v)
        n = min(self.length, self.capacity)
        return offset_attention(q, self.k[:, :, :n], self.v[:, :, :n])

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes


class LatentCache:
    """Multi-head latent attention's cache (mini3d.models.mla, the deepseek family): per position
    the normalised kv latent and the rotated rotary key all heads share, kv_lora_rank + qk_rope_dim
    numbers (`mini3d.cost.kv_cache`'s "mla"), not the expanded per-head keys and values. MLA hands
    each call's new latents to `extend`, which stores them and returns every cached position's,
    and kv_b expands them again each step: the same numbers as caching the expanded heads, for
    kv_b's FLOPs over the cached positions (DeepSeek-V2 instead folds kv_b into the query and the
    output projection; mini3d keeps the attention as training computes it). Installed as the
    layer's core too: the prompt runs through the model's own core, later calls attend over the
    cached positions (`offset_attention`). Slides as `CachedCore` does."""

    def __init__(self, core, capacity: int, slide: bool = False):
        self.core, self.capacity, self.slide = core, capacity, slide
        self.latent = self.rope = None  # (B, capacity, kv_rank), (B, 1, capacity, rope)
        self.length, self.prompt = 0, True

    def extend(self, latent, k_rope):
        start, T = self.length, latent.shape[1]
        if start + T > self.capacity and not (self.slide and T == 1):
            raise ValueError(f"KV cache: {start} cached + {T} new positions > capacity "
                             f"{self.capacity}")
        if self.latent is None or self.latent.shape[0] != latent.shape[0]:
            B = latent.shape[0]
            self.latent = latent.new_empty(B, self.capacity, latent.shape[-1])
            self.rope = k_rope.new_empty(B, 1, self.capacity, k_rope.shape[-1])
        slot = start % self.capacity
        self.latent[:, slot:slot + T] = latent
        self.rope[:, :, slot:slot + T] = k_rope
        self.length, self.prompt = start + T, start == 0
        if start == 0:
            return latent, k_rope
        n = min(self.length, self.capacity)
        return self.latent[:, :n], self.rope[:, :, :n]

    def __call__(self, q, k, v):
        return self.core(q, k, v) if self.prompt else offset_attention(q, k, v)

    @property
    def nbytes(self) -> int:
        return 0 if self.latent is None else self.latent.nbytes + self.rope.nbytes


class KVDecoder:
    """Next-token logits of a whole `mini3d.models.transformer.GPT` (one process, eval), with a KV cache.

    `decoder(x)` with the token ids so far, x (B, n), returns the last position's logits (B, V) in
    float32. Each call must extend the previous call's ids (sampling appends a token); the cache
    then runs only the new ones. Used as a context manager it installs the cache on entry and
    restores the model's own attention cores on exit:

        with KVDecoder(model) as next_logits:
            for _ in range(n): x = torch.cat([x, pick(next_logits(x))], dim=1)

    Past the window it recomputes the last window (the default: the uncached loop's tokens), or,
    with `slide=True` (rotary positions only: llama), keeps going one position per token over
    the last max_seq_len cached keys at their own positions: sliding-window attention, whose
    tokens past the window differ from the uncached loop's (see the module docstring).
    """

    def __init__(self, model, slide: bool = False):
        self.model, self.window, self.slide = model, model.cfg.max_seq_len, slide
        self.attns = [block.attn for block in model.blocks.values()]
        if slide and any(attn.rope_base is None for attn in self.attns):
            raise ValueError("KV cache: slide needs rotary positions (the llama family); learned "
                             "positions (gpt2) end at max_seq_len, so past it the window is "
                             "recomputed")
        self.cores = []
        self.offset = 0  # leading ids of x the last reset cropped off (a prompt past the window)
        self.length = 0  # ids of x after the offset the cache has seen (their positions 0..)
        self.recomputes = 0  # calls that ran a whole window (the prompt, and each one past it)

    def __enter__(self):
        self.cores = [attn.core for attn in self.attns]
        for attn, core in zip(self.attns, self.cores):
            if hasattr(attn, "latent_cache"):  # MLA: the latent, not the expanded heads
                attn.core = attn.latent_cache = LatentCache(core, self.window, self.slide)
            else:
                attn.core = CachedCore(core, self.window, self.slide)
        return self

    def __exit__(self, *exc):
        for attn, core in zip(self.attns, self.cores):
            attn.core = core
            if hasattr(attn, "latent_cache"):
                attn.latent_cache = None
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, seen = x.shape[1], self.offset + self.length
        if self.length == 0 or n <= seen or (n > self.window and not self.slide):
            # a prompt, or past the window: the last window afresh (see the module docstring)
            self.offset, self.length, start = max(0, n - self.window), 0, 0
            for attn in self.attns:
                attn.core.length = 0
            self.recomputes += 1
        else:
            start = self.length  # the tokens the cache has not seen, at their positions
        x = x[:, self.offset + start:]
        self.length = start + x.shape[1]
        positions = torch.arange(start, self.length, device=x.device)
        return self.model(x, positions=positions)[:, -1].float()  # (B, V)
