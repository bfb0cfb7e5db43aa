"""`estimate`, `plan` and `calibrate` subcommands, called through `register` like mini3d/cli.py will."""

import argparse
import json
import math

import pytest

from mini3d.config import PRESETS, Plan
from mini3d.run.cost_cli import register
from mini3d.cost.hardware import load_hardware
from mini3d.cost.model import predict_step_time


def run(argv):
    parser = argparse.ArgumentParser(prog="mini3d")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.timeout(30)
def test_estimate_json(capsys):
    rc = run(["estimate", "--model", "gpt-22b", "--tp", "8", "--global-batch", "4", "--dtype", "bf16",
              "--seq-len", "2048", "--sequence-parallel", "--recompute", "selective", "--gpu", "A100-80GB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    mem = out["memory_per_rank_bytes"]
    assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer", "activations",
                                                "comm_buffers"))
    assert out["step_time_s"] == pytest.approx(1.10, rel=0.05)  # the calibration row
    for key in ("tflops_per_gpu", "mfu", "bubble_fraction"):
        assert key in out
    assert set(out["comm_bytes_per_rank"]) == {"tp", "pp", "dp"} and out["comm_bytes_per_rank"]["tp"] > 0
    assert len(out["memory_per_stage_bytes"]) == 1


@pytest.mark.timeout(30)
def test_estimate_field_by_field_and_dp_from_gpus(capsys):
    rc = run(["estimate", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256",
              "--seq-len", "64", "--gpus", "4", "--tp", "2", "--zero", "1", "--dtype", "float32",
              "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["plan"]["dp"] == 2 and out["n_gpus"] == 4


@pytest.mark.timeout(60)
def test_plan_json_and_no_fit_exit_status(capsys):
    rc = run(["plan", "--model", "gpt-22b", "--gpus", "8", "--global-batch", "8", "--seq-len", "2048",
              "--top", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] and len(out["candidates"]) == 3
    times = [c["step_time_s"] for c in out["candidates"]]
    assert times == sorted(times) and all(c["fits"] for c in out["candidates"])
    rc = run(["plan", "--model", "gpt-175b", "--gpus", "1", "--global-batch", "1",
              "--gpu", "A100-40GB"])
    text = capsys.readouterr().out
    assert rc == 1 and "Smallest memory found" in text and "GiB too much" in text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv,names", [
    (["estimate", "--layers", "4", "--hidden", "100", "--heads", "3"], ["n_heads=3", "d_model=100"]),
    (["estimate", "--model", "tiny", "--tp", "3"], ["tp=3", "n_heads=4"]),
    (["estimate", "--model", "tiny", "--tp", "2", "--pp", "2", "--dp", "2", "--gpus", "4"],
     ["world size 4", "2*2*2"]),
    (["estimate", "--model", "tiny", "--seq-len", "4096"], ["seq_len=4096", "max_seq_len=128"]),
    (["estimate", "--model", "nope", "--hidden", "64"], ["model='nope' is not a preset", "tiny"]),
    (["estimate", "--model", "tiny", "--gpu", "B200"], ["B200"]),
    (["plan", "--model", "tiny"], ["--gpus"]),
])
def test_inconsistent_input_exits_2_naming_the_values(capsys, argv, names):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err


@pytest.mark.timeout(180)
def test_calibrate_writes_hardware_that_predicts_cpu_runs(tmp_path, capsys):
    path = str(tmp_path / "cpu.json")
    assert run(["calibrate", "--quick", "--out", path]) == 0
    hw = load_hardware(path)
    assert hw.peak_flops > 1e8 and hw.nvlink_bw > 1e6 and hw.latency_s > 0 and hw.shared_host
    plan = Plan(tp=2, dp=1, global_batch=8, micro_batches=2, seq_len=64)
    t = predict_step_time(PRESETS["tiny"], plan, hw)
    assert math.isfinite(t) and 1e-5 < t < 10
    # oversubscribing the cores slows the prediction down
    assert predict_step_time(PRESETS["tiny"], plan.replace(dp=4, micro_batches=1), hw) > 0
    capsys.readouterr()
    assert run(["estimate", "--model", "tiny", "--tp", "2", "--dtype", "float32", "--gpu", path,
                "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"] == hw.name
