"""`verify_checkpoint` for a sharded (DCP) checkpoint (mini3d/checkpoint/sharded.py): every file
against the sha256 and size meta.json records, DCP's `.metadata` index (a pickle: opened only once
its checksum matched, and then through the restricted unpickler of dcp_read.safe_metadata), the
tensor index meta.json records per rank file against that index, and each stage's saved step
against meta.json's. `check_file` (a file against its recorded size and sha256) serves both formats.
"""

from __future__ import annotations

import hashlib
import os

from mini3d.checkpoint.dcp_read import METADATA, LazyStates, dcp_files, is_dcp, safe_metadata, split_key


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_file(path: str, want) -> str | None:
    """Why the file at `path` is not the one meta.json recorded (missing, size, sha256), or None."""
    if not os.path.isfile(path):
        return f"{path} is missing (meta.json lists it)"
    if want and os.path.getsize(path) != want.get("bytes"):
        return (f"{path} holds {os.path.getsize(path)} bytes, meta.json records "
                f"{want.get('bytes')} (truncated or replaced)")
    if want and _sha256(path) != want.get("sha256"):
        return f"{path}: sha256 differs from meta.json's (the file was changed or corrupted)"
    return None


def _index_problems(ckpt: str, files: dict, shapes: dict) -> list[str]:
    out, listed = [], set()
    for name, want in sorted(files.items()):
        index = want.get("tensors") if isinstance(want, dict) else None
        for n, shape in sorted((index if isinstance(index, dict) else {}).items()):
            listed.add(n)
            if n not in shapes:
                out.append(f"{ckpt}/meta.json's index of {name} lists tensor {n}, which the "
                           f"checkpoint's {METADATA} does not hold")
            elif list(shape) != shapes[n]:
                out.append(f"{ckpt}/meta.json records shape {list(shape)} for {n} in {name}, "
                           f"the checkpoint's {METADATA} holds {shapes[n]} (meta.json was edited)")
    for n in sorted(set(shapes) - listed):
        out.append(f"{ckpt}/meta.json's index lacks tensor {n} (the checkpoint's {METADATA} holds "
                   f"shape {shapes[n]})")
    return out


def verify_dcp(ckpt: str, meta: dict) -> tuple[list[str], dict, dict]:
    """(problems, {model tensor: global shape}, {tensor: file}) of a DCP checkpoint."""
    files = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    names = sorted(set(files) | set(dcp_files(ckpt)) | {METADATA})
    out = []
    for name in names:
        path = os.path.join(ckpt, name)
        if name not in files:
            out.append(f"{path} is not listed in meta.json (an unrecorded or foreign file)")
        elif not os.path.isfile(path):
            out.append(f"{path} is missing (meta.json lists it)")
        else:
            why = check_file(path, files[name])
            if why:
                out.append(why)
    if out:  # the pickled index is opened only once its checksum matched meta.json's
        return out, {}, {}
    try:
        md = safe_metadata(ckpt)
        sizes = {k: list(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    except Exception as e:  # a refused class, a broken pickle: all the same to us
        return [f"{ckpt}/{METADATA} is not a loadable checkpoint index ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:80] if str(e) else ''})"], {}, {}
    shapes = {split_key(k)[1]: v for k, v in sizes.items() if (split_key(k) or ("",))[0] == "model"}
    out += _index_problems(ckpt, {f: w for f, w in files.items() if f != METADATA}, shapes)
    steps = [k for k in sizes if k.startswith("step.")]
    for k, v in (LazyStates(ckpt).read(steps) if steps else {}).items():
        if int(v) != meta["step"]:
            out.append(f"{ckpt}/meta.json records step {meta['step']}, but {k[5:]} was saved at "
                       f"step {int(v)} (meta.json was edited)")
    where = {n: f for f, w in files.items() for n in (w.get("tensors") or {} if isinstance(w, dict) else {})}
    return out, shapes, where


__all__ = ["verify_dcp", "is_dcp", "check_file"]
