"""Worker for tests/test_sample_gather.py (importable by spawned processes): what
`sample_during_training` gathers and keeps on each rank, next to the way it sampled before
(weights and both AdamW moments gathered, every rank keeping them)."""


def _gathered(log) -> tuple[int, int]:
    """(all-gather calls, bytes moved by collectives) so far, over every axis."""
    return (sum(n for (_, op), n in log.count_by_axis_op.items() if op == "all_gather"),
            sum(log.bytes_by_axis.values()))


def sample_and_watch_gathers(spec) -> dict:
    import mini3d.checkpoint.state as state
    import mini3d.run.sample as sample
    from mini3d.run.train import train_worker

    seen, real_gather, real_sample = [], state.gather_full_state, sample.sample_during_training
    kept = []

    def gather(*a, **k):
        weights, moments, step = real_gather(*a, **k)
        kept.append((len(weights), len(moments)))
        return weights, moments, step

    def watched(trainer, tok, seed, n_tokens=48):
        log = trainer.topo.log
        (c0, b0), kept[:] = _gathered(log), []
        text = real_sample(trainer, tok, seed, n_tokens)
        c1, b1 = _gathered(log)
        weights, moments, _ = real_gather(trainer.chunks, trainer.optimizer, trainer.topo)
        c2, b2 = _gathered(log)
        old = ""
        if not (trainer.topo.tp.index or trainer.topo.dp.index or trainer.topo.cp.index):
            model = sample.model_from_weights(trainer.cfg, weights).eval()
            prompt = tok.encode("\n") or [0]
            old = tok.decode(sample.generate(model, prompt, n_tokens, 1.0, 0, seed,
                                             tok.vocab_size)[len(prompt):])
        seen.append({"text": text, "old_text": old, "kept": list(kept),
                     "calls": c1 - c0, "bytes": b1 - b0, "old_calls": c2 - c1, "old_bytes": b2 - b1,
                     "old_kept": (len(weights), len(moments))})
        return text

    state.gather_full_state, sample.sample_during_training = gather, watched
    try:
        out = train_worker(spec)
    finally:
        state.gather_full_state, sample.sample_during_training = real_gather, real_sample
    return {"coords": out["coords"], "samples": seen}
