"""Worker for tests/test_checkpoint_verify.py (importable by spawned processes)."""

import os


def resume_and_watch_loads(spec: dict) -> dict:
    """train_worker(spec) on a resume spec, recording every file the load opens (DCP's rank files
    and its `.metadata` index), the bytes of each batch read, and whether the RNG state after the
    load is the one the checkpoint holds."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystem

    import mini3d.checkpoint.dcp_read as dcp_read
    import mini3d.run.saving as saving

    opened, batches, rng = [], [], []
    stream, index, read, restore = (FileSystem.create_stream, dcp_read.safe_metadata,
                                    dcp_read.LazyStates.read, saving.restore_rng)

    def spy_stream(self, path, mode):
        if "r" in mode:
            opened.append(os.path.basename(str(path)))
        return stream(self, path, mode)

    def spy_index(ckpt):
        opened.append(".metadata")
        return index(ckpt)

    def spy_read(self, keys):
        out = read(self, keys)
        batches.append(sum(t.numel() * t.element_size() for t in out.values()))
        return out

    def spy_restore(state):
        restore(state)
        rng.append(state is not None and torch.equal(torch.get_rng_state(), state))

    FileSystem.create_stream, dcp_read.safe_metadata = spy_stream, spy_index
    dcp_read.LazyStates.read, saving.restore_rng = spy_read, spy_restore
    try:
        out = saving_worker(spec)
    finally:
        FileSystem.create_stream, dcp_read.safe_metadata = stream, index
        dcp_read.LazyStates.read, saving.restore_rng = read, restore
    return {"rank": out["rank"], "opened": opened, "batches": len(batches),
            "largest_batch": max(batches), "rng_restored": rng}


def saving_worker(spec):
    import mini3d.run.train as train

    return train.train_worker(spec)
