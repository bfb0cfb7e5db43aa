"""examples/own_model.py: mini3d applied to a model defined outside mini3d equals that model trained
unparallelised (ZeRO-1, ZeRO-3, a 1F1B pipeline of its blocks, tensor-parallel blocks)."""

from __future__ import annotations

import pytest
import torch

from examples import own_model
from mini3d.launch.launcher import launch
from mini3d.pp.generic import BlockStage, stages_from_blocks


@pytest.mark.timeout(240)
def test_own_model_layouts_equal_the_unparallelised_model():
    results = launch(own_model.worker, 4, device="cpu", timeout=220)
    report = own_model.compare(results)
    losses = report.pop("reference losses")
    assert losses[-1] < 0.7 * losses[0]  # it trains, so equal parameters are not trivially equal
    assert set(report) == set(own_model.LAYOUTS)
    for name, (loss_err, param_err) in report.items():
        # float32, only the summation order differs (dp averaging of per-replica means, tp
        # all-reduce, micro-batch accumulation): ~1e-7 relative per op. Losses agree to 1e-5
        # (measured <1e-6); parameters after 8 AdamW steps to 1e-4 = 0.03 lr (measured <2e-6;
        # Adam's sign-like update can amplify differences of ~0 gradient entries, hence units of lr).
        assert loss_err < 1e-5, (name, loss_err)
        assert param_err < 1e-4, (name, param_err)


def test_stages_from_blocks_split_any_stack_and_name_params_like_the_full_model():
    model = own_model.make_model()
    blocks = list(model.layers)  # 6 blocks
    stages = [stages_from_blocks(blocks, r, 2, loss_fn=own_model.loss_fn) for r in range(2)]
    assert [sorted(s) for s in stages] == [[0], [1]]
    first, last = stages[0][0], stages[1][1]
    assert first.block_ids == [0, 1, 2] and last.block_ids == [3, 4, 5]
    assert first.loss_fn is None and last.loss_fn is own_model.loss_fn
    names = {**first.full_names("layers."), **last.full_names("layers.")}
    assert {n: p for p, n in names.items()} == dict(model.named_parameters())
    x, y = own_model.batch(0)
    with torch.no_grad():  # the two stages in a row compute the whole model's loss
        assert torch.equal(last(first(x), y), model(x, y))
    inter = stages_from_blocks(blocks, 1, 2, v=3)  # interleaved: rank 1 holds stages 1, 3, 5
    assert sorted(inter) == [1, 3, 5] and all(isinstance(s, BlockStage) for s in inter.values())


def test_plot_loss_writes_an_svg_and_refuses_a_bad_log(tmp_path, capsys):
    import json
    import xml.dom.minidom

    from examples import plot_loss

    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s}) + "\n" for s in range(1, 41)))
    out = tmp_path / "docs" / "loss.svg"
    assert plot_loss.main([str(log), str(out), "--no-entropy"]) == 0
    doc = xml.dom.minidom.parse(str(out))
    raw, smooth = doc.getElementsByTagName("polyline")
    assert len(raw.getAttribute("points").split()) == 40
    assert plot_loss.main([str(tmp_path / "missing.jsonl"), str(out)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
