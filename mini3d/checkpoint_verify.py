"""A checkpoint checked before anything trusts it: `verify_checkpoint(ckpt, cfg)` compares every
stage file with the sha256, size and tensor shapes its `meta.json` records (and with the model's
own shapes when `cfg` is given), and `shape_mismatch` names the model fields a resume would change.
The launcher calls both before any worker starts, so a flipped byte, a truncated or missing file,
a garbage meta.json or another model's checkpoint is exit 2 naming the file.
"""

from __future__ import annotations

import hashlib
import os

import torch

from .checkpoint import read_meta, stage_files


def shape_mismatch(meta: dict, cfg_dict: dict) -> list[str]:
    """Model fields that differ between a checkpoint and the requested model, each naming both values."""
    fields = ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", "d_ff")
    family = ("family", "n_kv_heads", "tie_embeddings", "activation", "rope_base", "norm_eps")
    saved = meta["model"]
    return [f"{k}: checkpoint has {saved.get(k)}, the flags ask for {cfg_dict.get(k)}"
            for k in fields + family
            if (k in fields or k in saved) and saved.get(k) != cfg_dict.get(k)]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def reference_shapes(cfg) -> dict:
    """{reference name: shape} of the full model `cfg` describes (built on the meta device)."""
    from .model import GPT

    with torch.device("meta"):
        return {n: list(p.shape) for n, p in GPT(cfg, init=False).named_parameters()}


def verify_checkpoint(ckpt: str, cfg=None) -> list[str]:
    """Every reason `ckpt` cannot be resumed, each naming the file: meta.json missing or not valid
    JSON, a stage file missing, of another size or checksum than meta.json records, not loadable,
    or (with `cfg`) holding tensors that are missing or of another shape than the model needs.
    Reads every byte (for the checksums) but loads tensors memory-mapped."""
    try:
        meta = read_meta(ckpt)
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "model" not in meta:
            return [f"{ckpt}/meta.json lacks the step or the model config (not a mini3d checkpoint?)"]
    except FileNotFoundError:
        return [f"{ckpt}/meta.json is missing"]
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return [f"{ckpt}/meta.json is not valid JSON ({str(e).splitlines()[0][:80]})"]
    files = meta.get("files")
    names = sorted(set(files if isinstance(files, dict) else ()) | set(stage_files(ckpt)))
    out, shapes = [], {}
    if not names:
        return [f"{ckpt} holds no stage*.pt file"]
    for name in names:
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            out.append(f"{path} is missing (meta.json lists it)")
            continue
        want = files.get(name) if isinstance(files, dict) else None
        if want and os.path.getsize(path) != want.get("bytes"):
            out.append(f"{path} holds {os.path.getsize(path)} bytes, meta.json records "
                       f"{want.get('bytes')} (truncated or replaced)")
            continue
        if want and _sha256(path) != want.get("sha256"):
            out.append(f"{path}: sha256 differs from meta.json's (the file was changed or corrupted)")
            continue
        try:
            part = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            shapes.update({k: list(v.shape) for k, v in part["model"].items()})
        except Exception as e:  # a refused pickle, a broken zip, no "model": all the same to us
            out.append(f"{path} is not a loadable checkpoint file ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:80] if str(e) else ''})")
    import dataclasses

    if cfg is not None and not out and not shape_mismatch(meta, dataclasses.asdict(cfg)):
        ref = reference_shapes(cfg)  # (another config is shape_mismatch's to report, by field)
        where = {n: f for f in names for n in ((files or {}).get(f) or {}).get("tensors", ())}
        for n in sorted(ref):
            if n not in shapes:
                out.append(f"{ckpt} holds no tensor {n} (the model needs shape {ref[n]})")
            elif shapes[n] != ref[n]:
                out.append(f"{ckpt}/{where.get(n, 'stage*.pt')}: {n} has shape {shapes[n]}, "
                           f"the model needs {ref[n]}")
        out = out[:5] + ([f"... and {len(out) - 5} more"] if len(out) > 5 else [])
    return out


__all__ = ["verify_checkpoint", "shape_mismatch", "reference_shapes"]
