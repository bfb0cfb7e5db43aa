"""A checkpoint checked before anything trusts it: `verify_checkpoint(ckpt, cfg)` compares every
stage file with the sha256, size and tensor shapes its `meta.json` records (and with the model's
own shapes when `cfg` is given), meta.json with its own digest and its step and tensor index with
what the files hold, and `shape_mismatch` names the model fields a resume would change.
The launcher calls both before any worker starts, so a flipped byte, a truncated or missing file,
a garbage or edited meta.json or another model's checkpoint is exit 2 naming the file.
"""

from __future__ import annotations

import os

import torch

from mini3d.checkpoint.store import META_SHA, meta_digest, read_meta, stage_files
from mini3d.checkpoint.verify_dcp import check_file, is_dcp, verify_dcp


def shape_mismatch(meta: dict, cfg_dict: dict) -> list[str]:
    """Model fields that differ between a checkpoint and the requested model, each naming both values."""
    fields = ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", "d_ff")
    family = ("family", "n_kv_heads", "tie_embeddings", "activation", "rope_base", "norm_eps",
              "explicit_head_dim", "qk_norm", "qkv_bias")
    saved = meta["model"]
    return [f"{k}: checkpoint has {saved.get(k)}, the flags ask for {cfg_dict.get(k)}"
            for k in fields + family
            if (k in fields or k in saved) and saved.get(k) != cfg_dict.get(k)]


def reference_shapes(cfg) -> dict:
    """{reference name: shape} of the full model `cfg` describes (built on the meta device)."""
    from mini3d.models.transformer import GPT

    with torch.device("meta"):
        return {n: list(p.shape) for n, p in GPT(cfg, init=False).named_parameters()}


def _read_meta(ckpt: str) -> tuple[dict | None, list[str]]:
    try:
        meta = read_meta(ckpt)
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "model" not in meta:
            return None, [f"{ckpt}/meta.json lacks the step or the model config (not a mini3d "
                          f"checkpoint?)"]
    except FileNotFoundError:
        return None, [f"{ckpt}/meta.json is missing"]
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return None, [f"{ckpt}/meta.json is not valid JSON ({str(e).splitlines()[0][:80]})"]
    return meta, []


def _load_file(path: str, want) -> tuple[dict | None, str | None]:
    """(the loaded stage file, None) or (None, why not): size and checksum first, then the load."""
    why = check_file(path, want)
    if why:
        return None, why
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True), None
    except Exception as e:  # a refused pickle, a broken zip, no "model": all the same to us
        return None, (f"{path} is not a loadable checkpoint file ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:80] if str(e) else ''})")


def _against_meta(ckpt: str, meta: dict, name: str, part: dict, want) -> list[str]:
    """meta.json's step and tensor index for stage file `name` against what the file holds."""
    out, held = [], {k: list(v.shape) for k, v in part["model"].items()}
    if isinstance(part.get("step"), int) and part["step"] != meta["step"]:
        out.append(f"{ckpt}/meta.json records step {meta['step']}, but {name} was saved at step "
                   f"{part['step']} (meta.json was edited)")
    if isinstance(want, dict):
        index = want.get("tensors") if isinstance(want.get("tensors"), dict) else {}
        for n in sorted(set(held) | set(index)):
            if n not in index:
                out.append(f"{ckpt}/meta.json's index of {name} lacks tensor {n} (the file holds "
                           f"shape {held[n]})")
            elif n not in held:
                out.append(f"{ckpt}/meta.json's index of {name} lists tensor {n}, which the file "
                           f"does not hold")
            elif list(index[n]) != held[n]:
                out.append(f"{ckpt}/meta.json records shape {list(index[n])} for {n} in {name}, "
                           f"the file holds {held[n]} (meta.json was edited)")
    return out


def _against_model(ckpt: str, cfg, shapes: dict, where: dict) -> list[str]:
    ref, out = reference_shapes(cfg), []
    for n in sorted(ref):
        if n not in shapes:
            out.append(f"{ckpt} holds no tensor {n} (the model needs shape {ref[n]})")
        elif shapes[n] != ref[n]:
            out.append(f"{ckpt}/{where.get(n, 'stage*.pt')}: {n} has shape {shapes[n]}, "
                       f"the model needs {ref[n]}")
    return out


def _stage_files(ckpt: str, meta: dict) -> tuple[list[str], dict, dict]:
    """(problems, {name: shape}, {name: file}) of a checkpoint of stage files."""
    files, out, shapes = meta.get("files"), [], {}
    names = sorted(set(files if isinstance(files, dict) else ()) | set(stage_files(ckpt)))
    if not names:
        return [f"{ckpt} holds no stage*.pt file"], {}, {}
    for name in names:
        want = files.get(name) if isinstance(files, dict) else None
        part, why = _load_file(os.path.join(ckpt, name), want)
        if why:
            out.append(why)
            continue
        shapes.update({k: list(v.shape) for k, v in part["model"].items()})
        out += _against_meta(ckpt, meta, name, part, want)
    where = {n: f for f in names for n in ((files or {}).get(f) or {}).get("tensors", ())}
    return out, shapes, where


def verify_checkpoint(ckpt: str, cfg=None) -> list[str]:
    """Every reason `ckpt` cannot be resumed, each naming the file: meta.json missing, not valid
    JSON or not matching its own digest, a stage file missing, of another size or checksum than
    meta.json records, not loadable, of another step or tensor index than meta.json says, or (with
    `cfg`) holding tensors that are missing or of another shape than the model needs.
    Reads every byte (for the checksums) but loads tensors memory-mapped. A sharded (DCP)
    checkpoint is checked the same way by `verify_dcp` (mini3d/checkpoint/verify_dcp.py)."""
    import dataclasses

    meta, out = _read_meta(ckpt)
    if meta is None:
        return out
    out, shapes, where = (verify_dcp if is_dcp(ckpt) else _stage_files)(ckpt, meta)
    if META_SHA in meta and meta[META_SHA] != meta_digest(meta):
        out.append(f"{ckpt}/meta.json differs from its own digest ({META_SHA}): the metadata "
                   f"was edited or corrupted")
    if cfg is not None and not out and not shape_mismatch(meta, dataclasses.asdict(cfg)):
        out = _against_model(ckpt, cfg, shapes, where)  # (another config: shape_mismatch's, by field)
    return out[:5] + ([f"... and {len(out) - 5} more"] if len(out) > 5 else [])


__all__ = ["verify_checkpoint", "shape_mismatch", "reference_shapes"]
