"""Pipeline runtime parity on gloo: every schedule equals the single-process reference GPT."""

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from mini3d.cost.activations import head_microbatches, inflight_microbatches
from mini3d.launch.launcher import launch
from mini3d.models.transformer import GPT
from mini3d.pp.rules import check
from mini3d.pp.schedules import make_schedule
from tests import pp_workers

CFG = ModelConfig(n_layers=8, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16)
SEED, M, B, T, STEPS, LR = 7, 4, 2, 16, 3, 1e-2
KINDS = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv")


def _batches():
    g = torch.Generator().manual_seed(123)
    return [[(torch.randint(0, CFG.vocab_size, (B, T), generator=g),
              torch.randint(0, CFG.vocab_size, (B, T), generator=g)) for _ in range(M)]
            for _ in range(STEPS)]


def _reference(batches, reverse=False):
    """Single process, same seed: loss = mean of micro-batch losses, same AdamW. `reverse`: the
    gradients accumulate last micro-batch first, as looped BFS's backwards run (float32 sums in
    another order differ by rounding, which AdamW turns into visible steps for gradients that are
    zero but for rounding, such as the key biases'). One thread, as each launched rank has: a
    matmul split over more threads sums in another order, and AdamW amplifies that rounding too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(batches, reverse)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(batches, reverse):
    model = GPT(CFG, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for mbs in batches:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in (mbs[::-1] if reverse else mbs):
            loss = model(x, y)
            (loss / len(mbs)).backward()
            total += loss.item()
        losses.append(total / len(mbs))
        grads.append({n: q.grad.clone() for n, q in model.named_parameters()})
        opt.step()
    return losses, grads, {n: q.detach().clone() for n, q in model.named_parameters()}


def _merge(per_rank, kind, key, step=None):
    merged = {}
    for r in per_rank:
        d = r[kind][key] if step is None else r[kind][key][step]
        assert not set(d) & set(merged), "two ranks hold the same parameter"
        merged.update(d)
    return merged


# Tolerances: the pipeline runs the very same float32 ops per micro-batch as the reference and
# accumulates gradients in the same micro-batch order, so results agree to rounding only; the
# only difference is that a stage boundary cuts the autograd graph (the received gradient is
# passed in explicitly), which can reorder a float32 sum or two. 1e-6 absolute is ~100 ulps of
# the gradients here (|g| up to ~1e-1); a wrong micro-batch scaling or a missing micro-batch
# changes gradients by >= 1e-3 and fails it.
ATOL, RTOL = 1e-6, 1e-5


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_matches_reference(p):
    batches = _batches()
    refs = {False: _reference(batches), True: _reference(batches, reverse=True)}
    out = launch(pp_workers.pipeline_parity, p, CFG, SEED, KINDS, M, 2, batches, LR, timeout=200)
    for kind in KINDS:
        ref_losses, ref_grads, ref_params = refs[kind == "looped-bfs"]
        for r in out:  # the loss is broadcast to every pipeline rank
            assert r[kind]["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), kind
        for step in range(STEPS):
            grads = _merge(out, kind, "grads", step)
            assert set(grads) == set(ref_grads[step]), f"{kind}: parameters missing or extra"
            for name, g in ref_grads[step].items():
                torch.testing.assert_close(grads[name], g, atol=ATOL, rtol=RTOL,
                                           msg=f"{kind} step {step} grad {name}")
        params = _merge(out, kind, "params")
        for name, q in ref_params.items():
            torch.testing.assert_close(params[name], q, atol=ATOL, rtol=RTOL,
                                       msg=f"{kind} param {name} after {STEPS} AdamW steps")
        for r in out:
            o = r[kind]
            assert o["n_send"] == o["want_send"] == o["n_recv"] > 0
            assert o["contexts_ok"], f"{kind}: a transfer was logged without its action context"
            assert o["p2p_bytes"] == {B * T * CFG.d_model * 4}, "boundary tensors are (b, T, C) fp32"
    # peak micro-batches alive per stage, measured by the runtime
    for pp_rank, r in enumerate(out):
        for peaks in r["gpipe"]["peaks"]:
            assert peaks == {pp_rank: M}, "GPipe keeps all m micro-batches alive"
        for peaks in r["1f1b"]["peaks"]:
            assert peaks == {pp_rank: min(p - pp_rank, M)}, "1F1B keeps p - pp_rank alive"
            assert max(peaks.values()) <= p
        for peaks in r["interleaved"]["peaks"]:
            assert set(peaks) == {pp_rank, pp_rank + p} and max(peaks.values()) <= M
        for peaks in r["zb-h1"]["peaks"]:  # W deferred by pp_rank micro-batches: p alive everywhere
            assert peaks == {pp_rank: min(p, M)}, "ZB-H1 keeps 1F1B's peak p on every rank"
        for peaks in r["zbv"]["peaks"]:  # the V: rank 0 holds the first and the last stage
            assert set(peaks) == {pp_rank, 2 * p - 1 - pp_rank}
        for kind in KINDS:  # the runtime's measured peak = check()'s = the memory estimator's
            v = {"interleaved": 2, "looped-bfs": 2, "zbv": 2}.get(kind, 1)
            want = check(make_schedule(kind, p, M, v)).peak_in_flight[pp_rank]
            assert r[kind]["peak_chunks"] == [want] * STEPS, kind
            plan = Plan(pp=p, schedule=kind, virtual_stages=v, micro_batches=M, global_batch=M * B)
            assert inflight_microbatches(plan, pp_rank) == want / v, kind
            last = p * v - 1  # the head's activations: as many micro-batches as its stage holds
            if last in r[kind]["peaks"][0]:
                assert r[kind]["peaks"][0][last] == head_microbatches(plan), kind
