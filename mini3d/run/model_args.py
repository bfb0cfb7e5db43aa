"""Command-line flags that describe a model family, shared by every command that describes a model
(`mini3d train`, `estimate`, `plan`): the engine's CLI and the cost model's CLI both read them here,
so neither imports the other."""

from __future__ import annotations

import argparse

from mini3d.config import FAMILIES


def add_family_args(g):
    """--family --kv-heads --rope-base --tie-embeddings: the model family's fields (shared by
    every command that describes a model: train, estimate, plan)."""
    g.add_argument("--family", choices=FAMILIES, help="gpt2 (LayerNorm, GELU, learned positions) "
                   "or llama (RMSNorm, SwiGLU, rotary positions, grouped-query attention)")
    g.add_argument("--kv-heads", type=int, help="key/value heads (llama; default: --heads)")
    g.add_argument("--rope-base", type=float, help="rotary position base theta (llama)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share the token embedding with the output head")


def family_overrides(args) -> dict:
    """The ModelConfig fields the family flags set (only those given)."""
    over = {k: v for k, v in (("family", args.family), ("n_kv_heads", args.kv_heads),
                              ("rope_base", args.rope_base),
                              ("tie_embeddings", args.tie_embeddings)) if v is not None}
    if "family" in over:  # the family's own activation, and full attention unless --kv-heads
        over["activation"] = ""
        over.setdefault("n_kv_heads", 0)
    return over
