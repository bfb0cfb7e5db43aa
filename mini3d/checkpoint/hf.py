"""Hugging Face interop: GPT-2, Llama, Qwen2 and Qwen3 checkpoints in and out, through the
`safetensors` library.

    mini3d import-hf HF_DIR CKPT_DIR      a local HF directory -> a mini3d checkpoint at step 0
    mini3d export-hf CKPT DIR             a mini3d checkpoint (any layout) -> a directory that
                                          transformers' `from_pretrained` loads
    mini3d train --init-from-hf HF_DIR    start a run from the HF weights directly

An HF directory is `config.json` plus `model.safetensors`, or several shards listed by
`model.safetensors.index.json`. Nothing is downloaded. config.json <-> ModelConfig is
mini3d.checkpoint.hf_config; the tensor names, one table per family, mini3d.checkpoint.hf_names
(mini3d's parameter name <-> HF's, transposed or split); the reading, tensor by tensor and with
`--init-from-hf` only the bytes of a rank's share (its stage, its experts, its tp slices),
mini3d.checkpoint.hf_read.

The mini3d checkpoint is written with `mini3d.checkpoint.store.CheckpointWriter` in its usual layout
(full tensors keyed by reference name, no optimizer state), so `train --resume` reads it into any
tp x pp x dp layout, like any other checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from mini3d.checkpoint.hf_config import HFError, config_from_hf, config_to_hf
from mini3d.checkpoint.hf_names import to_hf_state
from mini3d.checkpoint.hf_read import from_hf_state
from mini3d.config import ModelConfig, Plan, model_from_dict


def read_hf_dir(path: str) -> tuple[ModelConfig, dict]:
    """(config, mini3d full named state) of a local HF directory, sharded or not: every tensor,
    read one at a time (mini3d.checkpoint.hf_read)."""
    from mini3d.checkpoint.hf_read import HFSource, HFState

    cfg = hf_config(path)
    with HFSource(path) as source:
        state = HFState(source, cfg)
        return cfg, {n: state[n] for n in state}


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
    hf_cfg = config_to_hf(cfg)  # (before anything is written: HFError if HF has no such class)
    state = to_hf_state(read_states(step_dir)["model"], cfg)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    return cfg


def init_from_hf(trainer, hf_dir: str) -> None:
    """Give a freshly built Trainer (any layout) the HF weights: each rank reads only its share
    (its stage's tensors, and in them its experts and tp slices: hf_read.rank_share) and
    `restore_full_state` slices that share, one parameter at a time."""
    from mini3d.checkpoint.hf_read import HFSource, HFState, rank_share
    from mini3d.checkpoint.store import restore_full_state

    with HFSource(hf_dir) as source:
        weights = HFState(source, hf_config(hf_dir), rank_share(trainer.chunks, trainer.topo))
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
    p = subparsers.add_parser("import-hf", help="a Hugging Face GPT-2 / Llama / Qwen / Mixtral / DeepSeek-V3 directory -> a checkpoint")
    p.add_argument("hf_dir", help="local directory with config.json and *.safetensors")
    p.add_argument("ckpt_dir", help="checkpoint root to write (step 0)")
    p.set_defaults(func=_run(cmd_import))
    p = subparsers.add_parser("export-hf", help="a checkpoint -> a Hugging Face directory")
    p.add_argument("ckpt", help="checkpoint root (its latest step) or one step directory")
    p.add_argument("out_dir", help="directory to write config.json and model.safetensors into")
    p.set_defaults(func=_run(cmd_export))


__all__ = ["config_from_hf", "config_to_hf", "from_hf_state", "to_hf_state", "read_hf_dir",
           "hf_config", "import_hf", "export_hf", "init_from_hf", "HFError"]
