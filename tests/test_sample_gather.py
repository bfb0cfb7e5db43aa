"""`--sample-every` gathers the weights only (no AdamW moments) and only the reporting rank keeps
them: over tp2 x dp2 with ZeRO-1 (the optimizer states sharded over dp, so a moment gathered
would be an all-gather of its own) the collectives of a sample move a third of the bytes of the
whole-state gather it used (weights, exp_avg, exp_avg_sq: three float32 tensors each) in a third
of the calls, the ranks other than tp/dp rank 0 keep nothing, and the text is the one the
whole-state gather gives (tests/sample_workers.py computes both in the same run)."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(240)
def test_a_sample_gathers_the_weights_alone_and_only_the_reporter_keeps_them():
    from mini3d.config import Plan, model_from_preset
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec
    from tests.sample_workers import sample_and_watch_gathers

    cfg = model_from_preset("tiny", d_model=32, d_ff=64, n_layers=2, name="tiny-sample")
    plan = Plan(tp=2, dp=2, zero=1, global_batch=4, seq_len=16)
    spec = make_spec(cfg, plan, steps=2, sample_every=1)
    results = launch(sample_and_watch_gathers, 4, spec, device="cpu", timeout=200)
    for r in results:
        reporter = r["coords"]["tp"] == 0 and r["coords"]["dp"] == 0
        assert len(r["samples"]) == 2, r
        for s in r["samples"]:
            n_weights, n_moments = s["old_kept"]
            assert n_moments > 0 and n_weights > 0  # (after a step: the moments exist)
            assert s["kept"] == [(n_weights if reporter else 0, 0)], (r["coords"], s)
            assert s["calls"] > 0 and 3 * s["calls"] == s["old_calls"], (r["coords"], s)
            assert 3 * s["bytes"] == s["old_bytes"], (r["coords"], s)
            assert s["text"] == s["old_text"] and (len(s["text"]) > 0) == reporter, s
