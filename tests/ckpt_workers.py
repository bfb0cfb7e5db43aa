"""Worker for tests/test_checkpoint_verify.py (importable by spawned processes)."""

import os


def resume_and_watch_loads(spec: dict) -> dict:
    """train_worker(spec) on a resume spec, recording every torch.load (file, mmap, weights_only)
    and whether the RNG state after the load is the one the checkpoint holds."""
    import torch

    import mini3d.run.train as train

    calls, rng = [], []
    load, restore = torch.load, train.restore_rng

    def spy_load(path, *a, **k):
        calls.append((os.path.basename(str(path)), k.get("mmap"), k.get("weights_only")))
        return load(path, *a, **k)

    def spy_restore(state):
        restore(state)
        rng.append(state is not None and torch.equal(torch.get_rng_state(), state))

    torch.load, train.restore_rng = spy_load, spy_restore
    try:
        out = train.train_worker(spec)
    finally:
        torch.load, train.restore_rng = load, restore
    return {"rank": out["rank"], "calls": calls, "rng_restored": rng}
