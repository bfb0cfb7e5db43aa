"""Worker for tests/test_hf_share.py (importable by spawned processes): what a rank reads of a
Hugging Face directory, seen through safetensors itself."""


class _SliceSpy:
    def __init__(self, s, name, reads):
        self.s, self.name, self.reads = s, name, reads

    def __getitem__(self, box):
        t = self.s[box]
        self.reads.append((self.name, t.numel() * t.element_size()))
        return t

    def __getattr__(self, attr):  # get_shape, get_dtype
        return getattr(self.s, attr)


class ReadSpy:
    """A `safe_open` handle that records each tensor read (name, bytes): a slice or a whole one."""

    def __init__(self, f, reads):
        self.f, self.reads = f, reads

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.reads.append((name, t.numel() * t.element_size()))
        return t

    def get_tensors(self):  # (safetensors.torch.load_file: the whole file)
        out = self.f.get_tensors()
        self.reads.extend((n, t.numel() * t.element_size()) for n, t in out.items())
        return out

    def get_slice(self, name):
        return _SliceSpy(self.f.get_slice(name), name, self.reads)

    def __getattr__(self, attr):  # keys, metadata
        return getattr(self.f, attr)


def watching_reads(reads):
    """Patch `safe_open` where mini3d and safetensors' own `load_file` look it up; returns the undo."""
    import safetensors
    import safetensors.torch as st

    real = safetensors.safe_open

    def spy(*a, **k):
        return ReadSpy(real(*a, **k), reads)

    safetensors.safe_open = st.safe_open = spy

    def undo():
        safetensors.safe_open = st.safe_open = real
    return undo


def init_from_hf_and_watch_reads(spec) -> dict:
    """train_worker(spec) (a --init-from-hf run), recording what `init_from_hf` reads."""
    import mini3d.checkpoint.hf as hf
    from mini3d.run.train import train_worker

    reads, seen, init = [], {}, hf.init_from_hf

    def watched(trainer, hf_dir):
        del reads[:]
        init(trainer, hf_dir)
        seen["reads"] = list(reads)

    undo = watching_reads(reads)
    hf.init_from_hf = watched
    try:
        out = train_worker(spec)
    finally:
        undo()
        hf.init_from_hf = init
    return {"coords": out["coords"], "reads": seen.get("reads"),
            "losses": [r["loss"] for r in out["records"]] if out["reporter"] else None}
