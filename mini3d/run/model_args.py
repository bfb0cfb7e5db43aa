"""Command-line flags that describe a model family, shared by every command that describes a model
(`mini3d train`, `estimate`, `plan`): the engine's CLI and the cost model's CLI both read them here,
so neither imports the other."""

from __future__ import annotations

import argparse

from mini3d.config import FAMILIES, PlanError
from mini3d.models.config import FAMILY_FEATURES


def add_family_args(g):
    """--family --kv-heads --rope-base --tie-embeddings: the model family's fields (shared by
    every command that describes a model: train, estimate, plan)."""
    g.add_argument("--family", choices=FAMILIES, help="gpt2 (LayerNorm, GELU, learned positions), "
                   "llama (RMSNorm, SwiGLU, rotary positions, grouped-query attention), qwen2 "
                   "(llama + q/k/v biases) or qwen3 (llama + q/k RMSNorm, explicit head dim)")
    g.add_argument("--kv-heads", type=int, help="key/value heads (llama; default: --heads)")
    g.add_argument("--rope-base", type=float, help="rotary position base theta (llama)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share the token embedding with the output head")
    add_attention_variant_args(g)
    add_moe_args(g)


# ---- h-fam: the qwen attention variants (until the flag builder generates them from the fields)
VARIANT_FLAGS = (("head_dim", "explicit_head_dim"), ("qk_norm", "qk_norm"), ("qkv_bias", "qkv_bias"))


def add_attention_variant_args(g):
    """--head-dim --qk-norm --qkv-bias (ModelConfig.explicit_head_dim, qk_norm, qkv_bias)."""
    g.add_argument("--head-dim", type=int, help="width of one attention head (default "
                   "hidden / heads; qwen3's is 128)")
    g.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="RMSNorm over each query and key head before the rotation (qwen3)")
    g.add_argument("--qkv-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases on the q, k and v projections (qwen2)")


def variant_overrides(args, family) -> dict:
    """The fields the variant flags set (only those given); a family's own feature turned off
    (`--family qwen2 --no-qkv-bias`) is a PlanError: that model is the llama family."""
    over = {field: getattr(args, attr) for attr, field in VARIANT_FLAGS
            if getattr(args, attr, None) is not None}
    feature = FAMILY_FEATURES.get(family)
    if feature is not None and over.get(feature) is False:
        raise PlanError([f"--family {family} --no-{feature.replace('_', '-')}: {family} is the "
                         f"llama family with {feature} on (use --family llama)"])
    return over
# ---- end h-fam


def family_overrides(args) -> dict:
    """The ModelConfig fields the family flags set (only those given)."""
    over = {k: v for k, v in (("family", args.family), ("n_kv_heads", args.kv_heads),
                              ("rope_base", args.rope_base),
                              ("tie_embeddings", args.tie_embeddings)) if v is not None}
    over.update(moe_overrides(args))
    if "family" in over:  # the family's own activation, and full attention unless --kv-heads
        over["activation"] = ""
        over.setdefault("n_kv_heads", 0)
    over.update(variant_overrides(args, over.get("family")))
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
