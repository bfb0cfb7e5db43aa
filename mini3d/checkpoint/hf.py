"""Hugging Face interop: GPT-2 and Llama checkpoints in and out, through the `safetensors` library.

    mini3d import-hf HF_DIR CKPT_DIR      a local HF directory -> a mini3d checkpoint at step 0
    mini3d export-hf CKPT DIR             a mini3d checkpoint (any layout) -> a directory that
                                          transformers' `from_pretrained` loads
    mini3d train --init-from-hf HF_DIR    start a run from the HF weights directly

An HF directory is `config.json` plus `model.safetensors`, or several shards listed by
`model.safetensors.index.json`. Nothing is downloaded. The mapping is one table per family
(`_names`): mini3d's parameter name <-> HF's, and whether the tensor is transposed (GPT-2's
Conv1D stores (in, out)) or split (Llama's separate q/k/v projections are the rows of mini3d's
fused qkv). A tied head has no tensor of its own on either side.

The mini3d checkpoint is written with `mini3d.checkpoint.store.CheckpointWriter` in its usual layout
(full tensors keyed by reference name, no optimizer state), so `train --resume` reads it into any
tp x pp x dp layout, like any other checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from mini3d.config import ModelConfig, Plan, model_from_dict


class HFError(ValueError):
    """A directory or configuration mini3d cannot convert; the message says what and why."""


# ------------------------------------------------------------------------------ configurations

def config_from_hf(d: dict, name: str = "hf") -> ModelConfig:
    """The ModelConfig of an HF `config.json` (GPT2LMHeadModel or LlamaForCausalLM)."""
    kind = d.get("model_type")
    if kind == "gpt2":
        act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
        if d.get("activation_function", "gelu_new") not in act:
            raise HFError(f"activation_function={d['activation_function']!r} is not supported")
        if d.get("scale_attn_by_inverse_layer_idx") or d.get("scale_attn_weights") is False:
            raise HFError("GPT-2 attention scaling variants are not supported")
        h = d["n_embd"]
        return ModelConfig(d["n_layer"], h, d["n_head"], d["vocab_size"], d["n_positions"],
                           d.get("n_inner") or 4 * h, name=name, family="gpt2",
                           tie_embeddings=d.get("tie_word_embeddings", True),
                           norm_eps=d.get("layer_norm_epsilon", 1e-5),
                           activation=act[d.get("activation_function", "gelu_new")])
    if kind == "llama":
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise HFError(f"rope type {kind!r} is not supported (mini3d implements the default "
                          f"rotary embedding and Llama 3.1's rescaling, 'llama3')")
        scaling = () if kind == "default" else (
            float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]))
        base = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        h, nh = d["hidden_size"], d["num_attention_heads"]
        if d.get("head_dim", h // nh) != h // nh:
            raise HFError(f"head_dim={d['head_dim']} != hidden_size / heads = {h // nh}")
        if d.get("attention_bias") or d.get("mlp_bias") or d.get("hidden_act", "silu") != "silu":
            raise HFError("Llama variants with biases or another activation are not supported")
        return ModelConfig(d["num_hidden_layers"], h, nh, d["vocab_size"],
                           d.get("max_position_embeddings", 2048), d["intermediate_size"],
                           name=name, family="llama",
                           n_kv_heads=d.get("num_key_value_heads") or nh, rope_base=float(base),
                           rope_scaling=scaling,
                           tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                           norm_eps=d.get("rms_norm_eps", 1e-6))
    raise HFError(f"model_type={kind!r} is not supported (mini3d converts gpt2 and llama)")


def config_to_hf(cfg: ModelConfig) -> dict:
    """An HF `config.json` for `cfg` (written by hand: exporting needs no transformers)."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": "float32", "dtype": "float32"}
    if cfg.family == "gpt2":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[cfg.activation]
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.n_layers,
                "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_positions": cfg.max_seq_len,
                "n_inner": cfg.d_ff, "activation_function": act,
                "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout,
                "embd_pdrop": cfg.dropout, "attn_pdrop": 0.0, **common}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling:
        factor, low, high, n = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_base, "factor": factor,
                "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": n}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.d_model,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_base, "rope_parameters": rope,  # (transformers >= 5)
            **({"rope_scaling": dict(rope)} if cfg.rope_scaling else {}),  # (transformers 4)
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, **common}


# ------------------------------------------------------------------------------ tensors

def _names(cfg: ModelConfig) -> list[tuple[str, list[str], bool]]:
    """(mini3d name, HF names whose rows it concatenates, transposed?) for every tensor."""
    gpt2 = cfg.family == "gpt2"
    out = [("embed.wte.weight", ["transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"],
            False)]
    if gpt2:
        out.append(("embed.wpe.weight", ["transformer.wpe.weight"], False))
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", (f"transformer.h.{i}." if gpt2 else f"model.layers.{i}.")
        if gpt2:
            pairs = [("ln1", "ln_1"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                     ("ln2", "ln_2"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]
            for ours, theirs in pairs:
                conv = not ours.startswith("ln")  # GPT-2's Conv1D weight is (in, out)
                out.append((b + ours + ".weight", [h + theirs + ".weight"], conv))
                out.append((b + ours + ".bias", [h + theirs + ".bias"], False))
            continue
        a = h + "self_attn."
        out += [(b + "ln1.weight", [h + "input_layernorm.weight"], False),
                (b + "attn.qkv.weight", [a + "q_proj.weight", a + "k_proj.weight",
                                         a + "v_proj.weight"], False),
                (b + "attn.proj.weight", [a + "o_proj.weight"], False),
                (b + "ln2.weight", [h + "post_attention_layernorm.weight"], False),
                (b + "mlp.gate.weight", [h + "mlp.gate_proj.weight"], False),
                (b + "mlp.fc.weight", [h + "mlp.up_proj.weight"], False),
                (b + "mlp.proj.weight", [h + "mlp.down_proj.weight"], False)]
    ln_f = "transformer.ln_f." if gpt2 else "model.norm."
    out.append(("head.ln_f.weight", [ln_f + "weight"], False))
    if gpt2:
        out.append(("head.ln_f.bias", [ln_f + "bias"], False))
    if not cfg.tie_embeddings:
        out.append(("head.out.weight", ["lm_head.weight"], False))
    return out


def from_hf_state(hf: dict, cfg: ModelConfig) -> dict:
    """mini3d's full named state from an HF state dict (float32, contiguous)."""
    out = {}
    for ours, theirs, transposed in _names(cfg):
        missing = [n for n in theirs if n not in hf]
        if missing:
            raise HFError(f"the checkpoint has no tensor {missing[0]!r} (needed for {ours})")
        t = torch.cat([hf[n] for n in theirs]) if len(theirs) > 1 else hf[theirs[0]]
        out[ours] = (t.t() if transposed else t).float().contiguous()
    return out


def to_hf_state(state: dict, cfg: ModelConfig) -> dict:
    """The HF state dict of mini3d's full named state (the inverse of `from_hf_state`)."""
    out = {}
    for ours, theirs, transposed in _names(cfg):
        t = state[ours].t() if transposed else state[ours]
        if len(theirs) == 1:
            out[theirs[0]] = t.contiguous()
            continue
        sizes = [cfg.d_model, cfg.kv_dim, cfg.kv_dim]  # q, k, v rows of the fused qkv
        for name, part in zip(theirs, t.split(sizes)):
            out[name] = part.contiguous()
    return out


def read_hf_dir(path: str) -> tuple[ModelConfig, dict]:
    """(config, mini3d full named state) of a local HF directory, sharded or not."""
    from safetensors.torch import load_file

    cfg = hf_config(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise HFError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")
    hf = {}
    for name in files:
        hf.update(load_file(os.path.join(path, name)))
    return cfg, from_hf_state(hf, cfg)


def hf_config(path: str) -> ModelConfig:
    """Only the ModelConfig of an HF directory (no tensors read); a config.json that is not JSON,
    not an object or lacks a field is HFError naming the file and what is wrong."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            d = json.load(f)
    except OSError as e:
        missing = "has no config.json (is it a Hugging Face model directory?)"
        raise HFError(f"{path!r} " + (missing if isinstance(e, FileNotFoundError)
                                      else f"cannot be read: {e.strerror} (config.json)")) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HFError(f"{cfg_path!r} is not valid JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(d, dict):
        raise HFError(f"{cfg_path!r} holds a {type(d).__name__}, not a JSON object")
    try:
        return config_from_hf(d, name=os.path.basename(os.path.normpath(path)))
    except KeyError as e:
        raise HFError(f"{cfg_path!r} lacks the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise HFError(f"{cfg_path!r} holds a value of the wrong kind ({e})") from None


# ------------------------------------------------------------------------------ checkpoints

def import_hf(hf_dir: str, ckpt_root: str, seed: int = 0) -> str:
    """Write the HF model at `hf_dir` as a mini3d checkpoint at step 0 under `ckpt_root`; returns
    the checkpoint directory. One stage file (the full model, no optimizer state)."""
    from mini3d.checkpoint.store import CheckpointWriter, latest_dir

    cfg, weights = read_hf_dir(hf_dir)
    writer = CheckpointWriter(ckpt_root, 0)
    writer.begin()
    writer.write("stage0.pt", {"model": weights, "optim": {}, "optim_step": 0, "step": 0})
    writer.commit({"step": 0, "model": dataclasses.asdict(cfg), "plan": Plan().to_dict(),
                   "seed": seed, "data_position": 0, "source": os.path.abspath(hf_dir)})
    return latest_dir(ckpt_root)


def export_hf(ckpt: str, out_dir: str) -> ModelConfig:
    """Write the mini3d checkpoint `ckpt` (a root with `latest`, or one step directory, of any
    layout) as an HF directory: config.json + model.safetensors (float32)."""
    from safetensors.torch import save_file

    from mini3d.checkpoint.store import latest_dir, read_meta, read_states

    step_dir = latest_dir(ckpt)
    if step_dir is None:
        raise HFError(f"{ckpt!r} holds no complete mini3d checkpoint")
    cfg = model_from_dict(read_meta(step_dir)["model"])
    state = to_hf_state(read_states(step_dir)["model"], cfg)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg), f, indent=1)
    return cfg


def init_from_hf(trainer, hf_dir: str) -> None:
    """Give a freshly built Trainer (any layout) the HF weights: each rank slices its share."""
    from mini3d.checkpoint.store import restore_full_state

    _, weights = read_hf_dir(hf_dir)
    restore_full_state(trainer.chunks, trainer.optimizer, trainer.topo, weights, {}, 0)


# ------------------------------------------------------------------------------ command line

def _run(fn):
    def run(args) -> int:
        from mini3d.exits import EXIT_BAD_INPUT, dir_target

        try:
            for problem in dir_target("the output directory", getattr(args, "ckpt_dir", None)
                                      or getattr(args, "out_dir", None)):
                raise HFError(problem)
            return fn(args)
        except ImportError as e:
            print(f"mini3d {args.command}: {e.name} is needed (pip install 'mini3d[hf]')",
                  file=sys.stderr)
        except (HFError, OSError, KeyError) as e:
            print(f"mini3d {args.command}: bad input: {e}. Nothing was written.", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run


def cmd_import(args) -> int:
    path, cfg = import_hf(args.hf_dir, args.ckpt_dir), hf_config(args.hf_dir)
    print(f"wrote {path}: {cfg.family} model, {cfg.n_params():,} parameters, step 0 "
          f"(mini3d train --resume {args.ckpt_dir} ...)")
    return 0


def cmd_export(args) -> int:
    cfg = export_hf(args.ckpt, args.out_dir)
    print(f"wrote {args.out_dir}: {cfg.family} model, {cfg.n_params():,} parameters "
          f"(transformers' from_pretrained loads it)")
    return 0


def register(subparsers) -> None:
    """Add `import-hf` and `export-hf` to an argparse subparsers object."""
    p = subparsers.add_parser("import-hf", help="a Hugging Face GPT-2 / Llama directory -> a checkpoint")
    p.add_argument("hf_dir", help="local directory with config.json and *.safetensors")
    p.add_argument("ckpt_dir", help="checkpoint root to write (step 0)")
    p.set_defaults(func=_run(cmd_import))
    p = subparsers.add_parser("export-hf", help="a checkpoint -> a Hugging Face directory")
    p.add_argument("ckpt", help="checkpoint root (its latest step) or one step directory")
    p.add_argument("out_dir", help="directory to write config.json and model.safetensors into")
    p.set_defaults(func=_run(cmd_export))


__all__ = ["config_from_hf", "config_to_hf", "from_hf_state", "to_hf_state", "read_hf_dir",
           "hf_config", "import_hf", "export_hf", "init_from_hf", "HFError"]
