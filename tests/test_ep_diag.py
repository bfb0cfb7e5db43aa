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
