"""Expert parallelism's diagnostics (issue #30): a wrong all-to-all split size (`--inject-fault
a2a-split`) ends the job in time and is explained with both sizes; the OOM report names the
expert states and the dispatch buffers; `--ep` with `--init-from-hf` and with `--sample-every`."""

import re
import time

import pytest

from mini3d.cli import main
from mini3d.diagnose.explain import explain
from tests.test_diag_faults import _children

HANG_TIMEOUT = 3.0
EP = ["--dp", "2", "--ep", "2", "--experts", "4", "--top-k", "2", "--hidden", "32",
      "--global-batch", "4", "--seq-len", "16", "--no-progress"]


@pytest.mark.timeout(150)
def test_a2a_split_names_the_sender_and_both_sizes(tmp_path, capfd):
    run = tmp_path / "run"
    t0 = time.monotonic()
    rc = main(["train", *EP, "--steps", "3", "--hang-timeout", str(HANG_TIMEOUT), "--timeout",
               "120", "--run-dir", str(run), "--inject-fault", "a2a-split:1:1"])
    seconds = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc in (1, 3), (rc, err)  # gloo aborts the receiver (1); or the hang watchdog (3)
    assert seconds < HANG_TIMEOUT + 30 + 30  # + 30 s to start 2 processes on 2 busy cores
    assert _children() == [], "a rank survived the job"
    lines = err.strip().splitlines()
    assert lines[0].startswith("mini3d train: rank 1 (tp=0, ep=1, pp=0, dp=1) sent an all-to-all "
                               "block of another size than its peer expected"), err
    assert "in step 1" in lines[0] and "rank 0" in lines[1], err
    assert "terminate called" not in err and "Traceback" not in err, err
    ex = explain(str(run))
    assert (ex.culprit, ex.kind) == (1, "a2a-split"), ex.text
    # the dispatch (token rows), not the count exchange: rank 1 sent rank 0 one row more than the
    # count it announced, which is what rank 0 expected
    m = re.search(r"all_to_all #\d+ on the ep group \[0, 1\] \(step 1, mb 0\): rank 1 sent (\d+) "
                  r"rows to rank 0, which expected (\d+) from it", ex.text)
    assert m and int(m.group(1)) == int(m.group(2)) + 1, ex.text
    assert int(m.group(2)) > 1, ex.text  # token rows: the count table has one row per member
    assert "a2a-split:1:1" in ex.text and "grid tp=1 ep=2 pp=1 dp=2" in ex.text


@pytest.mark.timeout(400)
def test_ep_trains_from_hf_weights_and_samples_as_without_ep(tmp_path, capfd):
    """`--init-from-hf` of a Mixtral directory over dp2 ep2 (each rank slices its 2 of the 4
    experts from the full HF tensors, as a resume does): the first loss is transformers' on the
    same batch, and the losses of 2 steps and the `--sample-every` text (the reporting rank
    generates from the full state, the experts gathered over ep: `gather_full_state`) are those
    of the one-process run. float64, so that the summation order of the dp/ep reductions
    (~1e-16 relative) cannot move a sampled token or a loss past 1e-9."""
    import json

    import torch

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from mini3d.data.corpus import Batches, load_tokens
    from tests.test_hf import moe_config, saved

    hf = saved(moe_config("mixtral", vocab_size=256), tmp_path / "hf").eval()
    assert isinstance(hf, transformers.MixtralForCausalLM)
    common = ["train", "--init-from-hf", str(tmp_path / "hf"), "--steps", "2", "--seq-len", "16",
              "--global-batch", "4", "--micro-batches", "1", "--dtype", "float64",
              "--sample-every", "1", "--no-progress", "--timeout", "250"]
    out = {}
    for name, layout in (("ep", ["--dp", "2", "--ep", "2"]), ("one", [])):
        log = tmp_path / f"{name}.jsonl"
        assert main([*common, *layout, "--log-jsonl", str(log)]) == 0
        err = capfd.readouterr().err
        samples = [line for line in err.splitlines() if line.startswith("sample at step")]
        losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        out[name] = losses, samples
    assert len(out["ep"][1]) == 2 and out["ep"][1] == out["one"][1], out  # the same text
    assert all(not s.endswith(": ''") for s in out["ep"][1]), out  # (48 tokens each)
    assert out["ep"][0] == pytest.approx(out["one"][0], rel=1e-9, abs=1e-9)
    x, y = Batches(load_tokens(), 16, 4, 0).global_batch_at(0)  # the batch of step 1 (seed 0)
    with torch.no_grad():  # transformers in float32: its weights are the float32 HF ones
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert out["ep"][0][0] == pytest.approx(want, abs=1e-5), (out["ep"][0][0], want)


# A MoE model whose routed experts are most of its states (8 experts of 512, d 64), over dp=4
MOE = dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256, max_seq_len=128, family="llama",
           n_experts=8, top_k=2, moe_ffn=512, name="oom-moe")


def _moe_plan(**kw):
    from mini3d.config import ModelConfig, Plan

    return ModelConfig(**MOE), Plan(dp=4, global_batch=8, seq_len=64, dtype="float32", **kw)


def test_oom_report_names_expert_states_and_suggests_a_larger_ep():
    """`--memory-budget`'s report (check_budget): the expert states and the ep dispatch buffers
    are lines of their own, the estimator's numbers (`estimate_memory`'s detail), and the plans
    that fit include one with a larger ep (the planner walks ep)."""
    from mini3d.cost.memory import estimate_memory
    from mini3d.diagnose.faults import OutOfMemory
    from mini3d.diagnose.oom import check_budget, estimated_bytes

    cfg, plan = _moe_plan()  # ep=1: 24 of its 30.5 MiB are expert states
    est = estimate_memory(cfg, plan, 0)
    with pytest.raises(OutOfMemory) as e:
        check_budget(estimated_bytes(cfg, plan, 0), 20 * 2**20, 0, {"tp": 0, "pp": 0, "dp": 0},
                     cfg, plan)
    report = e.value.report
    experts = est.detail["experts"]["total"]
    assert re.search(rf"optimizer .*\n +experts +- +{experts / 2**20:,.1f} MiB", report), report
    assert "a2a bufs" not in report  # ep=1: no dispatch across ranks
    fits = report.split("plans that would fit: ")[1].split("; ")
    assert any(" ep2 " in f or " ep4 " in f for f in fits), report
    # ep=2: the experts halve, and the dispatch's send and receive buffers show up
    cfg, plan = _moe_plan(ep=2)
    est = estimate_memory(cfg, plan, 0)
    with pytest.raises(OutOfMemory) as e:
        check_budget(estimated_bytes(cfg, plan, 0), 4 * 2**20, 0, {"tp": 0, "pp": 0, "dp": 0},
                     cfg, plan)
    a2a = est.detail["comm_buffers"]["ep"]
    assert a2a > 0 and re.search(rf"comm_buffers .*\n +a2a bufs +- +{a2a / 2**20:,.1f} MiB",
                                 e.value.report), e.value.report
    assert est.detail["experts"]["total"] == experts / 2


def test_injected_oom_under_ep_names_the_expert_lines():
    """`--inject-fault oom` with experts (the estimate the session hands the injector, for_run)."""
    from types import SimpleNamespace

    from mini3d.comm_log import CommLog
    from mini3d.diagnose.faults import OutOfMemory
    from mini3d.diagnose.session import for_run
    from mini3d.run.config import RunConfig

    cfg, plan = _moe_plan(ep=2)
    topo = SimpleNamespace(rank=0, coords={"tp": 0, "ep": 0, "pp": 0, "dp": 0}, log=CommLog(0),
                           pp=SimpleNamespace(index=0))
    diag = for_run(topo, RunConfig(model=cfg, plan=plan, inject_fault="oom:0:1",
                                   memory_budget="8MiB"))
    diag.step_start(0, lambda: {"params": 2**20})
    with pytest.raises(OutOfMemory) as e:
        diag.step_start(1, lambda: {"params": 2**20})
    assert e.value.report.startswith("OUT OF MEMORY on rank 0 (tp=0, ep=0, pp=0, dp=0)")
    assert "    experts " in e.value.report and "    a2a bufs " in e.value.report, e.value.report
