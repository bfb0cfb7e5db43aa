"""MINI3D_STRICT_DEVICE=1: CPU runs as unforgiving as CUDA.

tests/conftest.py turns strict mode on for every process the suite launches, so the whole parity
matrix (tests/test_dp.py, test_tp.py, test_pp_runtime.py, test_3d.py, test_checkpoint.py, ...) runs
under it. This file checks the mode itself: workers really compute with the meta default device,
the traced collectives reject tensors on the wrong device or of mixed dtypes before anything is
issued, and the three `mini3d train` layouts of issue #15 (tp2 x pp2 x dp2 ZeRO-1, dp2 ZeRO-3,
dp2 bf16) run to the end: before the fix, any dp > 1 run failed at its first step (the dp mean of
the loss all-reduced a CPU float64 tensor created without a device).
"""

from __future__ import annotations

import math

import pytest
import torch

from mini3d import comm
from mini3d.comm import DeviceMismatch
from mini3d.comm_log import CommLog
from mini3d.config import Plan, model_from_preset
from mini3d.grid import Axis
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec, reporter_records
from tests.test_3d import SHARED_LAUNCH_TIMEOUT
from tests.workers import default_device

CFG = model_from_preset("tiny", d_model=32, d_ff=128, name="tiny+custom")


@pytest.mark.timeout(120)
def test_workers_compute_with_the_meta_default_device():
    assert launch(default_device, 2, device="cpu", timeout=90) == ["meta", "meta"]
    off = launch(default_device, 1, device="cpu", timeout=90, env={"MINI3D_STRICT_DEVICE": "0"})
    assert off == ["cpu"]


def _axis(size=2):
    return Axis("tp", tuple(range(size)), 0, None, CommLog(0), torch.device("cpu"))


def test_collectives_reject_the_wrong_device_before_issuing():
    ax = _axis()
    stray = torch.zeros(4, device="meta")  # what a tensor made without a device is under strict mode
    cases = [lambda: comm.all_reduce(stray, ax),
             lambda: comm.all_gather(torch.zeros(8), stray, ax),
             lambda: comm.reduce_scatter(stray, torch.zeros(8), ax),
             lambda: comm.broadcast(stray, ax),
             lambda: comm.send(stray, ax, 1),
             lambda: comm.recv(stray, ax, 1)]
    for case in cases:
        with pytest.raises(DeviceMismatch, match=r"on the tp axis \[0, 1\].* is on meta.* live on cpu"):
            case()
    assert not ax.log.events and not ax.log.pending  # nothing was issued or recorded
    # a one-member axis communicates nothing, but the check still runs (it would on a GPU)
    with pytest.raises(DeviceMismatch, match="all_reduce"):
        comm.all_reduce(stray, _axis(1))


def test_collectives_check_dtypes():
    ax = _axis()
    with pytest.raises(DeviceMismatch, match="all_gather.*dtypes.*bfloat16.*float32"):
        comm.all_gather(torch.zeros(8), torch.zeros(4, dtype=torch.bfloat16), ax)
    with pytest.raises(DeviceMismatch, match=r"recv.*expected torch.bfloat16"):
        comm.recv(torch.zeros(4), ax, 1, dtype=torch.bfloat16)


def test_reduce_scatter_rejects_ops_it_cannot_do():
    ax = _axis(1)
    out, inp = torch.zeros(4), torch.ones(4)
    for op in ("max", "min", "prod"):  # before: silently summed
        with pytest.raises(ValueError, match=rf"reduce_scatter: op='{op}' is not supported "
                                             r"\(choose sum, avg\)"):
            comm.reduce_scatter(out, inp, ax, op=op)
    with pytest.raises(ValueError, match="all_reduce: op='prod'"):
        comm.all_reduce(inp, ax, op="prod")
    comm.reduce_scatter(out, inp, ax, op="avg")
    assert torch.equal(out, inp)


RUN = dict(global_batch=8, seq_len=16, micro_batches=2)
PLANS = [Plan(tp=2, pp=2, dp=2, zero=1, **RUN), Plan(tp=4, dp=2, zero=3, **RUN),
         Plan(tp=2, pp=2, dp=2, dtype="bf16", **RUN)]


def eight_rank_specs(tmp_dir: str) -> list[dict]:
    """This module's part of the shared 8-rank launch (tests/conftest.py eight_rank_job)."""
    return [make_spec(CFG, p, steps=3, seed=2) for p in PLANS]


EIGHT_RANK_TIMEOUT = 200


@pytest.mark.timeout(SHARED_LAUNCH_TIMEOUT)
def test_issue_layouts_train_to_the_end_under_strict_mode(eight_rank_job):
    """One 8-rank launch (shared: tests/conftest.py eight_rank_job), three layouts in turn: tp2 x
    pp2 x dp2 ZeRO-1, dp2 ZeRO-3 (with tp4), dp2 bf16 (with tp2 x pp2), 3 steps each; every rank
    runs in strict mode (conftest)."""
    plans = PLANS
    _, results = eight_rank_job[__name__]
    losses = [[r["loss"] for r in reporter_records([x[i] for x in results])] for i in range(3)]
    for plan, got in zip(plans, losses):
        assert len(got) == 3 and all(math.isfinite(v) for v in got), (plan, got)
    # the float32 layouts compute the same model on the same data: equal losses
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    assert losses[2] == pytest.approx(losses[0], abs=3e-2)  # bf16 compute


# ---- issue #15, point 8: the smaller defects -------------------------------------------------
def test_vocab_parallel_cross_entropy_needs_no_host_sync():
    """Meta tensors have no data: any host read (`bool(t)`, `.item()`) raises. Forward and backward
    of the vocab-parallel loss with padded columns must run on them, as they must run on a GPU
    without waiting for it once per micro-batch. The padding still gets probability 0."""
    from mini3d.tp.cross_entropy import vocab_parallel_cross_entropy

    ax = Axis("tp", (0,), 0, None, CommLog(0), torch.device("meta"))
    logits = torch.zeros(2, 3, 8, device="meta", requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long, device="meta")
    vocab_parallel_cross_entropy(logits, targets, ax, vocab_start=0, vocab_size=6).backward()
    assert logits.grad.shape == logits.shape
    # the same on CPU values: columns 6, 7 are padding and get no probability, no gradient
    ax = Axis("tp", (0,), 0, None, CommLog(0), torch.device("cpu"))
    z = torch.randn(2, 3, 8, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    y = torch.randint(0, 6, (2, 3), generator=torch.Generator(device="cpu").manual_seed(1), device="cpu")
    z.requires_grad_()
    loss = vocab_parallel_cross_entropy(z, y, ax, vocab_start=0, vocab_size=6)
    ref = torch.nn.functional.cross_entropy(z.detach()[..., :6].reshape(-1, 6), y.reshape(-1))
    assert float(loss.detach()) == pytest.approx(float(ref), abs=1e-6)
    loss.backward()
    assert torch.equal(z.grad[..., 6:], torch.zeros(2, 3, 2))


def test_commlog_sequence_numbers_change_only_under_the_lock():
    """The watchdog thread reads the per-axis sequence counters under `log.lock`; `begin` must not
    change them while another thread holds it."""
    import threading
    import time

    ax = _axis()
    log = ax.log
    with log.lock:
        t = threading.Thread(target=log.begin, args=(ax, "all_reduce", torch.zeros(1), 4, 4))
        t.start()
        time.sleep(0.2)
        assert dict(log._seq) == {} and log.bytes_by_axis["tp"] == 0  # begin waits for the lock
    t.join(5)
    assert log.seq_counts() == {"tp/all_reduce": 1}
