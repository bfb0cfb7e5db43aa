"""The dry run's communication program is the real step's: op by op against a real gloo run.

ONE 8-process launch runs `train_worker` (one step, `collect=["events"]`) for four layouts of the
same 8 ranks: tp2 pp2 dp2 ZeRO-1 with gradient clipping (1F1B), tp2 dp4 ZeRO-3 with clipping (ZeRO-3
is refused with pp > 1), tp2 pp2 dp2 with sequence parallelism (GPipe), and tp2 pp2 dp2 interleaved
1F1B. For every rank, the ops its event log shows for step 0 must equal, in issue order, what
`mini3d.run.dryrun.record_rank` records by running the same rank's Trainer on a fake process group:
axis, op, per-axis sequence number, group, shape, dtype, peer and the pipeline action.
"""

from __future__ import annotations

import pytest

from mini3d.config import ModelConfig, Plan
from mini3d.run.dryrun import record_rank
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec

CFG = ModelConfig(4, 32, 4, 256, 16, name="dry4")  # the byte tokenizer needs 256 rows
CASES = [
    (Plan(tp=2, pp=2, dp=2, zero=1, micro_batches=4, global_batch=8, seq_len=8), 1.0),
    (Plan(tp=2, dp=4, zero=3, micro_batches=2, global_batch=8, seq_len=8), 1.0),
    (Plan(tp=2, pp=2, dp=2, schedule="gpipe", micro_batches=2, global_batch=4, seq_len=8,
          sequence_parallel=True), 0.0),
    (Plan(tp=2, pp=2, dp=2, schedule="interleaved", virtual_stages=2, micro_batches=2,
          global_batch=4, seq_len=8), 0.0),
]
FIELDS = ("axis", "op", "seq", "group", "shape", "dtype", "peer")


def run_cases(specs):
    from mini3d.run.train import train_worker

    return [train_worker(spec)["events"] for spec in specs]


def key(ev: dict) -> tuple:
    return tuple(tuple(ev[f]) if isinstance(ev[f], list) else ev[f] for f in FIELDS) + (
        ev["context"].get("action"),)


@pytest.mark.timeout(420)
def test_recorded_program_equals_the_real_event_log():
    specs = [make_spec(CFG, plan, steps=1, grad_clip=clip, collect=["events"]) for plan, clip in CASES]
    per_rank = launch(run_cases, 8, specs, device="cpu", timeout=360)
    for i, (plan, clip) in enumerate(CASES):
        for rank in range(8):
            real = [key(e) for e in per_rank[rank][i] if e["context"].get("step") == 0]
            recorded = [key(ev) for what, _, ev in record_rank(CFG, plan, rank, clip) if what == "issue"]
            assert recorded == real, (plan, rank, next(
                (j, a, b) for j, (a, b) in enumerate(zip(recorded + [None] * len(real), real + [None] * len(recorded)))
                if a != b))
    ops = {e["op"] for e in per_rank[0][1]}  # ZeRO-3: parameter gathers and gradient shards
    assert {"all_gather", "reduce_scatter"} <= ops
    ops = {e["op"] for e in per_rank[0][2]}  # sequence parallelism
    assert {"all_gather", "reduce_scatter", "send", "recv", "broadcast"} <= ops
