"""What a decoder's key/value cache keeps per token: the one owner of that count.

Generating token by token, every attention layer keeps the keys and values of every position it
has seen, so the cache grows by the same bytes with each token of each sequence:

* full heads (multi-head attention, `"full"`): a key and a value for every query head,
  n_heads * (head_dim + v_head_dim) numbers per token per layer (2 * n_heads * head_dim where
  v is as wide as k);
* grouped-query attention (`"gqa"`, Ainslie et al. 2023): only the n_kv_heads key/value heads a
  group of query heads shares, n_kv_heads * (head_dim + v_head_dim);
* multi-head latent attention (`"mla"`, DeepSeek-V2 / V3): the joint kv latent and the one
  rotary key every head shares, kv_lora_rank + qk_rope_dim numbers, whatever the head count: a
  decoder can fold kv_b's expansion into the query and the output projection (DeepSeek-V2,
  section 2.1.3), so the expanded keys and values are never stored.

mini3d's own single-process cache (mini3d.models.kv_cache) keeps the n_kv_heads keys and values
for gpt2 and llama (`"full"` / `"gqa"`), and for the deepseek family the latent (`"mla"`:
`LatentCache`, which expands it with kv_b again at each step rather than folding kv_b away). tests/test_cost_mla.py measures its buffers against this count. The
course's chapter on experts and its figure call these functions.
"""

from __future__ import annotations

from mini3d.config import ModelConfig

KINDS = ("full", "gqa", "mla")


def own_kind(cfg: ModelConfig) -> str:
    """The attention `cfg` has: mla (deepseek), gqa (fewer key/value heads than query heads) or full."""
    if cfg.mla:
        return "mla"
    return "gqa" if cfg.n_kv_heads < cfg.n_heads else "full"


def kv_cache_elements(cfg: ModelConfig, kind: str | None = None, kv_heads: int | None = None) -> int:
    """Numbers one token adds to one layer's cache under attention `kind` (default: the model's
    own, `own_kind`) with `cfg`'s head widths; `kv_heads` replaces n_kv_heads for "gqa" (e.g. a
    deepseek shape's heads grouped as Llama's 8)."""
    kind = own_kind(cfg) if kind is None else kind
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
    if kind == "mla":
        return cfg.kv_lora_rank + cfg.qk_rope_dim
    v_width = cfg.v_head_dim if cfg.mla else cfg.head_dim
    heads = cfg.n_heads if kind == "full" else (kv_heads or cfg.n_kv_heads)
    return heads * (cfg.head_dim + v_width)


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, element_bytes: int = 2, kind: str | None = None,
                   kv_heads: int | None = None, batch: int = 1) -> int:
    """Bytes of the whole cache of `batch` sequences of `seq_len` tokens: every layer's
    `kv_cache_elements` per token, `element_bytes` each (2: bf16)."""
    return cfg.n_layers * batch * seq_len * kv_cache_elements(cfg, kind, kv_heads) * element_bytes


__all__ = ["KINDS", "own_kind", "kv_cache_elements", "kv_cache_bytes"]
