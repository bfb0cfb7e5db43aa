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
    add_moe_args(g)


def family_overrides(args) -> dict:
    """The ModelConfig fields the family flags set (only those given)."""
    over = {k: v for k, v in (("family", args.family), ("n_kv_heads", args.kv_heads),
                              ("rope_base", args.rope_base),
                              ("tie_embeddings", args.tie_embeddings)) if v is not None}
    over.update(moe_overrides(args))
    if "family" in over:  # the family's own activation, and full attention unless --kv-heads
        over["activation"] = ""
        over.setdefault("n_kv_heads", 0)
    return over


# ---- mixture-of-experts flags (h-moe), by hand until h-flags generates them from the docstrings
MOE_FLAGS = (("--experts", "n_experts", int), ("--top-k", "top_k", int), ("--moe-ffn", "moe_ffn", int),
             ("--shared-experts", "n_shared_experts", int), ("--moe-every", "moe_every", int),
             ("--dense-layers", "dense_layers", int), ("--router", "router", str),
             ("--aux-loss-coef", "aux_loss_coef", float), ("--z-loss-coef", "z_loss_coef", float),
             ("--capacity-factor", "capacity_factor", float),
             ("--router-bias-rate", "router_bias_rate", float))


def add_moe_args(g):
    """--experts --top-k ... : the ModelConfig MoE fields, each help its field's docstring."""
    from mini3d.models.config import ModelConfig
    import inspect

    docs = _field_docs(inspect.getsource(ModelConfig))
    for flag, field, kind in MOE_FLAGS:
        g.add_argument(flag, type=kind, dest=_dest(field), metavar={int: "N", float: "X"}.get(kind, "KIND"),
                       help=docs.get(field, "").replace("%", "%%"))


def moe_overrides(args) -> dict:
    return {field: v for _, field, _ in MOE_FLAGS if (v := getattr(args, _dest(field), None)) is not None}


def _dest(field: str) -> str:
    """The argparse name of a MoE field (prefixed: no clash with the other commands' flags)."""
    return field.replace("n_", "moe_n_", 1) if field.startswith("n_") else "moe_" + field


def _field_docs(source: str) -> dict:
    """{field: the string literal on the line after it} from a dataclass's source."""
    lines, out = source.splitlines(), {}
    for a, b in zip(lines, lines[1:]):
        if ":" in a and "=" in a and b.strip().startswith('"""'):
            out[a.split(":")[0].strip()] = b.strip().strip('"')
    return out
