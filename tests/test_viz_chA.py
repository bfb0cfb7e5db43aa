"""Figures and helpers of chapters 00-03 (mini3d/course/viz/measured_memory.py, dp_overlap.py,
zero_traffic.py): figure data equals the data passed in, the event-log timeline is cut at the right markers, the communication-tax
explorer moves in the expected direction, and the multi-spec worker reproduces the ZeRO paper's
2 Psi / 3 Psi on a live dp=2 run."""

from __future__ import annotations

import pytest

from mini3d.course.viz import dp_overlap, measured_memory, zero_traffic
from mini3d.course.viz.theme import GIB

MIB = 2 ** 20
LEDGER = {"parameters": 400, "gradients": 400, "master_weights": 0, "optimizer_states": 800,
          "optimizer_scalars": 4, "total": 1604}


def _trace(fig, name):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


def _has_unit(title):
    assert title and "(" in title and ")" in title, title


# ----------------------------------------------------------------- chapter 00 / 01


def test_measured_breakdown_and_mib_figure():
    res = {"ledger": LEDGER, "activations": {"layer0.attn": 100.0, "head": 50.0}}
    b = measured_memory.measured_breakdown(res)
    assert b == {"params": 400, "grads": 400, "optimizer": 804, "activations": 150, "comm_buffers": 0}
    assert measured_memory.measured_breakdown(res, micro_batches_in_flight=3)["activations"] == 450
    est = {"params": 400, "grads": 400, "optimizer": 800, "activations": 160, "comm_buffers": 99}
    kept = measured_memory.estimated_breakdown(est, keep=measured_memory.MODEL_STATES)
    assert kept["activations"] == 0 and kept["comm_buffers"] == 0 and kept["optimizer"] == 800
    gap = measured_memory.relative_gap(b, measured_memory.estimated_breakdown(est))
    assert gap["params"] == 0 and gap["optimizer"] == pytest.approx(4 / 800)
    assert gap["activations"] == pytest.approx(-10 / 160) and gap["comm_buffers"] == -1

    fig = measured_memory.breakdown_mib_figure({"measured": {"params": 2 * MIB, "activations": MIB},
                                     "estimated": {"params": 2 * MIB, "activations": 3 * MIB}})
    _has_unit(fig.layout.yaxis.title.text)
    assert list(_trace(fig, "parameters").y) == [2.0, 2.0]
    assert list(_trace(fig, "activations").y) == [1.0, 3.0]
    assert [t.name for t in fig.data if t.name == "gradients"] == []  # nobody holds any
    assert list(_trace(fig, "total").text) == ["3.00 MiB", "5.00 MiB"]


def test_training_state_bars_is_the_18_bytes_arithmetic():
    bars = measured_memory.training_state_bars(70e9, 8)
    whole = bars["training state, 1 GPU"]
    assert sum(whole.values()) == pytest.approx(70e9 * 18)  # 1.26 TB: bf16 params, fp32 grads
    assert bars["weights only (bf16)"] == {"params": 140e9}
    assert sum(bars["training state / 8 GPUs"].values()) == pytest.approx(157.5e9)  # > 80 GiB
    assert sum(bars["training state / 8 GPUs"].values()) > 80 * GIB
    f32 = measured_memory.training_state_bars(10, 2, {"params": 4, "grads": 4, "optimizer": 8})
    assert f32["training state / 2 GPUs"] == {"params": 20, "grads": 20, "optimizer": 40}


# ----------------------------------------------------------------- chapter 02


def _ev(op, shape, dtype, start, end, step, nbytes=64, axis="dp"):
    return dict(axis=axis, op=op, shape=shape, dtype=dtype, start=start, end=end, bytes=nbytes,
                context={"step": step})


def test_dp_step_windows_cut_at_loss_markers():
    events = [
        _ev("all_reduce", (10,), "float32", 0.5, 0.9, 0), _ev("all_reduce", (1,), "float64", 1.0, 1.1, 0),
        _ev("all_reduce", (10,), "float32", 1.5, 2.2, 1, nbytes=40),
        _ev("all_reduce", (20,), "float32", 1.3, 2.1, 1, nbytes=80),
        _ev("all_gather", (20,), "float32", 1.2, 1.25, 1),  # not a gradient all-reduce
        _ev("all_reduce", (10,), "float32", 1.4, 1.6, 1, axis="tp"),  # another axis
        _ev("all_reduce", (1,), "float64", 2.3, 2.6, 1),
        _ev("all_reduce", (10,), "float32", 2.7, None, 2),  # pending: ignored
    ]
    (w,) = dp_overlap.dp_step_windows(events)  # step 0 has no start marker
    assert w["step"] == 1 and w["t0"] == 0.0 and w["t1"] == pytest.approx(1.5)
    assert [(round(s, 6), round(e, 6), b) for s, e, b in w["buckets"]] == [(0.2, 1.0, 80), (0.4, 1.1, 40)]
    s = dp_overlap.overlap_summary(w)
    assert s["n_buckets"] == 2 and s["overlap_window_s"] == pytest.approx(0.2)
    assert s["last_end_s"] == pytest.approx(1.1)
    fig = dp_overlap.dp_overlap_figure({"small buckets": [w], "again": [w]})
    _has_unit(fig.layout.xaxis.title.text)
    bars = _trace(fig, "gradient all-reduce (issued -> waited for)")
    assert [round(b, 6) for b in bars.base] == [200.0, 400.0] * 2  # ms
    assert [round(x, 6) for x in bars.x] == [800.0, 700.0] * 2
    assert list(_trace(fig, "step (forward, backward, optimizer)").y) == ["small buckets · step 1",
                                                                          "again · step 1"]


def test_loss_curves_figure():
    fig = dp_overlap.loss_curves_figure({"1 process": [3.0, 2.0], "dp=2": [3.0, 2.0]})
    _has_unit(fig.layout.yaxis.title.text)
    assert list(fig.data[1].x) == [1, 2] and list(fig.data[1].y) == [3.0, 2.0]


def test_scaling_rows_and_explorer_directions():
    fn = dp_overlap.cost_model_scaling_fn(gpus=(1, 8, 64, 512))
    view = dp_overlap.scaling_view(fn, model="gpt-1.3b", global_batch=1024, internode_gbps=25.0)
    assert view["gpus"] == [1, 8, 64, 512]
    assert view["efficiency"][0] == pytest.approx(1.0)  # one GPU pays no communication
    assert all(a >= b for a, b in zip(view["efficiency"], view["efficiency"][1:]))  # the tax grows
    assert view["efficiency"][-1] < 0.8

    box = dp_overlap.scaling_explorer(fn, global_batch=1024, internode_gbps=25.0)
    achieved = lambda: list(_trace(box.figure, "achieved").y)  # noqa: E731
    before = achieved()
    assert before == pytest.approx(view["effective"])
    box.controls["global_batch"].value = 4096  # more compute per all-reduce: more effective GPUs
    larger_batch = achieved()
    assert larger_batch[-1] > before[-1]
    box.controls["internode_gbps"].value = 100.0  # a faster link: more effective GPUs again
    assert achieved()[-1] > larger_batch[-1]
    assert "GPUs work like" in box.status.value
    with pytest.raises(ValueError, match="global_batch=3"):
        dp_overlap.scaling_view(dp_overlap.cost_model_scaling_fn(gpus=(8, 64)), model="gpt-1.3b", global_batch=3)


# ----------------------------------------------------------------- chapter 03


def test_zero_comm_rows_and_figure():
    grad_bytes, dp, steps = 1000.0, 2, 4
    psi = (dp - 1) / dp * grad_bytes
    res = {0: {"comm_wire_bytes": {"dp": steps * (2 * psi + 8)}},
           3: {"comm_wire_bytes": {"dp": steps * (3 * psi + 8)}}}
    rows = zero_traffic.zero_comm_rows(res, grad_bytes, dp, steps, micro_batches=1)
    assert [r["measured_psi"] for r in rows] == [pytest.approx(2.0), pytest.approx(3.0)]
    assert [r["formula_psi"] for r in rows] == [2, 3]
    fig = zero_traffic.zero_comm_figure(rows, grad_bytes, dp)
    _has_unit(fig.layout.yaxis.title.text)
    assert list(_trace(fig, "formula").x) == ["no ZeRO", "ZeRO-3"]
    assert list(_trace(fig, "formula").y) == pytest.approx([2 * psi / MIB, 3 * psi / MIB])
    # Two micro-batches: ZeRO-2 reduce-scatters each one's gradients, (M + 1) Psi; ZeRO-3 3M Psi.
    accum = zero_traffic.zero_comm_rows({2: {"comm_wire_bytes": {"dp": steps * (3 * psi + 8)}},
                                         3: {"comm_wire_bytes": {"dp": steps * (6 * psi + 8)}}},
                                        grad_bytes, dp, steps, micro_batches=2)
    assert [(r["measured_psi"], r["formula_psi"]) for r in accum] == [(pytest.approx(3.0), 3), (pytest.approx(6.0), 6)]
    fig = zero_traffic.zero_comm_figure(rows + accum, grad_bytes, dp)
    assert list(_trace(fig, "formula").x) == ["no ZeRO · M=1", "ZeRO-3 · M=1", "ZeRO-2 · M=2", "ZeRO-3 · M=2"]


@pytest.mark.timeout(180)
def test_train_many_worker_live_zero_traffic_and_ledger():
    """One launch, two specs (ZeRO-0 and ZeRO-3 on dp=2): the measured dp bytes are exactly 2 and 3
    gradient volumes, ZeRO-3 halves parameters, gradients and optimizer state, and the losses agree
    (sharding does not change the maths; 1e-5 allows for float32 sums taken in another order)."""
    from mini3d.config import PRESETS, Plan
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec

    cfg = PRESETS["tiny"]
    specs = [make_spec(cfg, Plan(dp=2, zero=z, global_batch=4, seq_len=32), steps=1, collect=["ledger"])
             for z in (0, 3)]
    r0 = launch(zero_traffic.train_many_worker, 2, specs)[0]
    grad_bytes = cfg.n_params() * 4
    rows = zero_traffic.zero_comm_rows({0: r0[0], 3: r0[1]}, grad_bytes, 2, 1, micro_batches=1)
    assert [r["measured_psi"] for r in rows] == [pytest.approx(2.0), pytest.approx(3.0)]
    full, sharded = (measured_memory.measured_breakdown(r) for r in r0)
    assert sharded["params"] == full["params"] / 2 and sharded["grads"] == full["grads"] / 2
    assert sharded["optimizer"] == pytest.approx(full["optimizer"] / 2, abs=64)  # + step scalars
    assert r0[0]["records"][0]["loss"] == pytest.approx(r0[1]["records"][0]["loss"], abs=1e-5)
