"""The black box (mini3d.diagnose.blackbox) keeps what a rank issued where a dump cannot: written
through, a skipped op retracted, a shape a fault changed recorded as issued, two steps kept; and
`self_divergence` reads it for a rank that left no dump. No processes: a CommLog on a fake axis."""

import signal
from types import SimpleNamespace

import torch

from mini3d.comm_log import CommLog
from mini3d.diagnose.blackbox import BlackBox, ended, read
from mini3d.diagnose.history import self_divergence
from mini3d.diagnose.run_dir import Run

AXIS = SimpleNamespace(name="dp", ranks=(0, 1))
EP = SimpleNamespace(name="ep", ranks=(0, 1))


def _step(log, step, skip_first=False, wide=False, routed=0):
    log.context = {"step": step, "mb": 0}
    if routed:  # an expert-parallel dispatch first: its rows follow the routing, step by step
        eid, ev = log.begin(EP, "all_to_all", torch.zeros(routed + step, 3), 12 * (routed + step), 0)
        log.end(eid, ev)
    for n in (4, 6):
        eid, ev = log.begin(AXIS, "all_reduce", torch.zeros(n + (1 if wide and n == 4 else 0)), 4 * n, 0)
        if skip_first and n == 4:
            log.retract(eid, ev)
            continue
        log.end(eid, ev)
    eid, ev = log.begin(AXIS, "all_gather", torch.zeros(2), 8, 0)
    log.end(eid, ev)


def _run(tmp_path, steps=3, partial=False, routed=0, **faults):
    """`steps` steps, the last with `faults`; `partial`: one more step, only its first op."""
    log = CommLog(rank=1)
    log.on_issue = BlackBox(str(tmp_path), 1)
    for step in range(steps):
        _step(log, step, routed=routed, **(faults if step == steps - 1 else {}))
    if partial:
        log.context = {"step": steps, "mb": 0}
        log.begin(AXIS, "all_reduce", torch.zeros(4), 16, 0)
    log.on_issue.close()
    return Run({}, {"ranks": [{"rank": 1, "exitcode": -signal.SIGABRT}]}, {}, issued=read(str(tmp_path)))


def test_a_clean_rank_does_not_diverge_and_only_three_steps_are_kept(tmp_path):
    run = _run(tmp_path, steps=4)
    assert sorted({e["context"]["step"] for e in run.issued[1]}) == [1, 2, 3]
    assert self_divergence(run, 1) is None


def test_a_retracted_op_is_a_skip_seen_from_the_box_alone(tmp_path):
    kind, text = self_divergence(_run(tmp_path, skip_first=True), 1)
    assert kind == "skip" and "rank 1 skipped one all_reduce on the dp group in step 2" in text


def test_a_changed_shape_is_seen(tmp_path):
    kind, text = self_divergence(_run(tmp_path, wide=True), 1)
    assert kind == "shape" and "(5,)" in text and "(4,)" in text


def test_an_all_to_all_changing_rows_between_steps_is_no_shape_fault(tmp_path):
    """Expert parallelism's dispatch sends as many rows as the router chose, another count each
    step: not a divergence (a campaign run blamed the victim for it); the wrong all_reduce is."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert self_divergence(_run(tmp_path / "a", routed=7), 1) is None
    kind, text = self_divergence(_run(tmp_path / "b", routed=7, wide=True), 1)
    assert kind == "shape" and "all_reduce" in text and "(5,)" in text


def test_a_skip_at_the_end_of_a_complete_step_is_seen(tmp_path):
    """The last op of step 3 skipped (as a pipeline's loss broadcast): step 4 begins as usual, so
    only step 3, complete, against step 2 shows it."""
    log = CommLog(rank=1)
    log.on_issue = BlackBox(str(tmp_path), 1)
    for step in range(4):
        _step(log, step)
        if step != 3:
            eid, ev = log.begin(AXIS, "broadcast", torch.zeros(1), 4, 4)
            log.end(eid, ev)
    log.context = {"step": 4, "mb": 0}
    log.begin(AXIS, "all_reduce", torch.zeros(4), 16, 0)
    log.on_issue.close()
    run = Run({}, None, {}, issued=read(str(tmp_path)))
    kind, text = self_divergence(run, 1)
    assert kind == "skip" and "step 3 ended without it" in text, text


def test_a_last_op_skipped_in_a_step_that_ended_is_a_skip_and_not_before(tmp_path):
    """The loss broadcast, the step's last op, skipped in step 2; the rank then waits at the step's
    boundary (outside any op). Only the end-of-step line tells this from a rank still working
    towards that broadcast (a straggler): without it, no verdict."""
    log = CommLog(rank=1)
    box = log.on_issue = BlackBox(str(tmp_path), 1)
    for step in range(3):
        _step(log, step)
        log.context = {"step": step}
        eid, ev = log.begin(AXIS, "broadcast", torch.zeros(1), 4, 4)
        if step != 2:
            log.end(eid, ev)
        else:
            log.retract(eid, ev)  # the fault's skip: the box holds no such op
        if step != 2:
            box.end_step(step)
    run = Run({}, None, {}, issued=read(str(tmp_path)), ended=ended(str(tmp_path)))
    assert run.ended == {1: {0, 1}}
    assert self_divergence(run, 1) is None  # step 2 may still be on its way to the broadcast
    box.end_step(2)
    box.close()
    run = Run({}, None, {}, issued=read(str(tmp_path)), ended=ended(str(tmp_path)))
    kind, text = self_divergence(run, 1)
    assert kind == "skip" and text == ("rank 1 skipped one broadcast on the dp group in step 2: step "
                                       "1 ended with that broadcast, step 2 ended without it"), text
