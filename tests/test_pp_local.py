"""The runtime in one process (p = 1, local hand-over between chunks) and its data-parallel hook."""

import contextlib

import pytest
import torch

from mini3d.config import ModelConfig
from mini3d.grid import Grid, build_topology
from mini3d.models.transformer import GPT
from mini3d.pp.partition import build_stages
from mini3d.pp.runtime import PipelineRuntime
from mini3d.pp.schedules import make_schedule

CFG = ModelConfig(n_layers=4, d_model=16, n_heads=2, vocab_size=32, max_seq_len=8)
M, B, T = 3, 2, 8


class FakeDP:
    """Records whether each gradient accumulation of its stage ran inside no_sync() (like
    mini3d.dp, it hooks the accumulation into .grad: a split backward computes some gradients in
    B but accumulates them only in W)."""

    def __init__(self, param):
        self.inside = False
        self.seen = []
        param.register_post_accumulate_grad_hook(lambda p: self.seen.append(self.inside))

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                    ("looped-bfs", 2), ("zb-h1", 1), ("zbv", 2)])
def test_single_rank_runtime_matches_reference_and_syncs_once_per_stage(kind, v):
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 32, (B, T), generator=g), torch.randint(0, 32, (B, T), generator=g))
           for _ in range(M)]
    ref = GPT(CFG, 3)
    for x, y in mbs:
        (ref(x, y) / M).backward()
    topo = build_topology(Grid(), 0, make_groups=False)
    sched = make_schedule(kind, 1, M, v)
    stages = build_stages(CFG, 3, 0, 1, v, placement=sched.placement)
    assert sorted(stages) == list(range(v))
    rt = PipelineRuntime(stages, sched, topo, (B, T, CFG.d_model))
    dps = {s: FakeDP(next(iter(m.blocks.values())).ln1.weight) for s, m in stages.items()}
    res = rt.step(mbs, step=5, dp=dps)
    # same ops per micro-batch as the reference, same accumulation order: float32 rounding only
    grads = {n: q.grad for m in stages.values() for n, q in m.named_parameters()}
    for n, q in ref.named_parameters():
        torch.testing.assert_close(grads[n], q.grad, atol=1e-6, rtol=1e-5, msg=n)
    assert res.loss == pytest.approx(sum(ref(x, y).item() for x, y in mbs) / M, abs=1e-6)
    for dp in dps.values():  # every backward (W if split) but the stage's last runs in no_sync()
        assert dp.seen == [True] * (M - 1) + [False]
    n_compute = (3 if sched.split else 2) * M * v
    assert len(res.timeline) == n_compute and all(e >= s for s, e, _ in res.timeline)
    assert topo.log.context == {"step": 5}
    with pytest.raises(ValueError, match="got 2 micro-batches, the schedule has m=3"):
        rt.step(mbs[:2])
