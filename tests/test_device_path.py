"""The CUDA code path, exercised on CPU: device choice with a mocked torch.cuda, bf16 training on CPU,
guarded memory statistics, gpu_check.py's logic end to end, and where torch.cuda may be called."""

import os
import re

import pytest
import torch

from benchmarks import gpu_check
from mini3d.launch import launcher as launch
from mini3d.launch.launcher import LaunchError, choose_device
from mini3d.run.train import peak_memory_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_choose_device_with_mocked_cuda(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    assert choose_device("auto", 1) == ("nccl", "cuda")
    assert choose_device("auto", 2) == ("nccl", "cuda")
    # fewer GPUs than local ranks: an error naming the counts, never a quiet CPU fallback
    with pytest.raises(LaunchError, match="--device auto needs 4 GPUs on this node, found 2"):
        choose_device("auto", 4)
    assert choose_device("cpu", 4) == ("gloo", "cpu")  # asked for on purpose
    assert choose_device("cpu", 1) == ("gloo", "cpu")
    assert choose_device("cuda", 1, backend="gloo") == ("gloo", "cuda")
    with pytest.raises(LaunchError, match="needs 4 GPUs on this node, found 2"):
        choose_device("cuda", 4)
    _fake_gpus(monkeypatch, 0)
    assert choose_device("auto", 1) == ("gloo", "cpu")
    with pytest.raises(LaunchError, match="found 0"):
        choose_device("cuda", 1)
    with pytest.raises(LaunchError, match="unknown"):
        choose_device("tpu", 1)


def test_device_mapping_for_slurm_and_cuda_visible_devices(monkeypatch):
    """torchrun / Slurm: a process that sees every GPU of the node uses LOCAL_RANK; one that sees
    exactly one (--gpus-per-task=1) uses device 0; anything else is an exit-2 error."""
    assert launch.device_index(3, 4, 4) == 3 and launch.device_index(3, 4, 8) == 3
    assert launch.device_index(3, 4, 1) == 0
    with pytest.raises(LaunchError, match="4 processes on this node .* each process sees 2"):
        launch.device_index(3, 4, 2)
    _fake_gpus(monkeypatch, 1)  # one visible device per process
    assert choose_device("auto", 4, per_process=True) == ("nccl", "cuda")
    assert choose_device("cuda", 4, per_process=True) == ("nccl", "cuda")
    with pytest.raises(LaunchError, match="needs 4 GPUs on this node, found 1"):
        choose_device("auto", 4)  # the local launcher's 4 processes would share one GPU
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
    monkeypatch.setenv(launch.DEVICE_ENV, "cpu")
    launch._set_device("cuda", 3, 4)
    assert calls == [0] and launch.current_device() == torch.device("cuda:0")
    _fake_gpus(monkeypatch, 4)
    launch._set_device("cuda", 3, 4)
    assert calls == [0, 3] and launch.current_device() == torch.device("cuda:3")
    _fake_gpus(monkeypatch, 2)
    with pytest.raises(LaunchError, match="found 2"):
        choose_device("cuda", 4, per_process=True)


def test_too_few_gpus_is_exit_2_before_any_process(monkeypatch, capsys):
    from mini3d import cli

    _fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    assert cli.main(["train", "--dp", "4", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs 4 GPUs on this node" in err and "found 2" in err and "--device cpu" in err


def test_set_device_sets_cuda_env_with_mocked_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
    monkeypatch.setenv(launch.DEVICE_ENV, "cpu")
    launch._set_device("cuda", 3)
    assert calls == [3] and launch.current_device() == torch.device("cuda:3")
    launch._set_device("cpu", 0)
    assert launch.current_device() == torch.device("cpu")


def test_peak_memory_is_guarded_by_device(monkeypatch):
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20  # RSS of a Python with torch
    seen = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: seen.append(d) or 12345)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 100)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("Props", (), {"total_memory": 10**9})())
    assert peak_memory_bytes(torch.device("cuda:0")) == 12345 and seen == [torch.device("cuda:0")]
    assert peak_memory_bytes(torch.device("cpu")) != 12345  # the CPU path never asks CUDA


def test_peak_preset_matching():
    assert gpu_check.peak_for("NVIDIA H200")[0] == "H200-141GB"
    assert gpu_check.peak_for("NVIDIA H100 80GB HBM3")[1] == 989e12
    assert gpu_check.peak_for("NVIDIA A100-SXM4-40GB", 40 * 2**30)[0] == "A100-40GB"
    assert gpu_check.peak_for("NVIDIA A100-SXM4-80GB", 80 * 2**30)[0] == "A100-80GB"
    assert gpu_check.peak_for("NVIDIA GeForce RTX 4090") is None


@pytest.mark.timeout(240)
def test_gpu_check_logic_on_cpu_bf16(tmp_path, capsys):
    """gpu_check --device cpu --tiny: mini3d train in bf16 (CPU), its profile, and both plain loops
    (pure bf16, fp32 + autocast) run and learn, and the report has every number; all start from the
    same weights and batch."""
    results = tmp_path / "RESULTS.md"
    out_json = tmp_path / "gpu.json"
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--peak-tflops", "0.1", "--profile-steps", "2",
                         "--results", str(results), "--json", str(out_json)])
    assert rc == 0
    import json

    r = json.loads(out_json.read_text())
    assert r["dtype"] == "bf16" and r["timed_steps"] == 3 and r["error"] is None
    assert r["step_s"] > 0 and r["plain_step_s"] > 0 and r["amp_step_s"] > 0
    for key in ("plain", "amp"):
        assert r[f"{key}_ratio_min"] <= r[f"ratio_vs_{key}"] <= r[f"{key}_ratio_max"]
    assert 0 < r["mfu"] < 1
    assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / r["step_s"] / 0.1e12)
    assert r["peak_mem_bytes"] > 0 and r["estimated_mem_bytes"] > 0
    # same initial weights and first batch: the first losses agree to bf16 rounding of the logits
    for key in ("plain", "amp"):
        assert r["loss_first_last"][0] == pytest.approx(r[f"{key}_loss_first_last"][0], abs=0.05)
        assert r[f"{key}_loss_first_last"][1] < r[f"{key}_loss_first_last"][0]
    assert r["loss_first_last"][1] < r["loss_first_last"][0]  # bf16 training on CPU learns
    assert "aten::" in r["profile"] and "Self CPU" in r["profile"]  # a torch.profiler table
    text = results.read_text()
    assert "<!-- begin gpu -->" in text and "tokens/s" in text and "MFU: " in text
    assert "mini3d / this loop = " in text and "autocast" in text and "aten::" in text
    assert gpu_check.main(["--device", "cpu", "--steps", "2", "--warmup", "3"]) == 2


@pytest.mark.timeout(120)
def test_gpu_check_reports_a_failed_mini3d_run(tmp_path, monkeypatch):
    """When `mini3d train` fails (say NCCL cannot start), the report carries its stderr, the plain
    loops still run (one GPU session learns both), and the exit code is 1."""
    def broken(*a, **k):
        raise RuntimeError("mini3d train exited 1:\nRuntimeError: NCCL error: unhandled system error")

    monkeypatch.setattr(gpu_check, "run_mini3d", broken)
    out_json = tmp_path / "gpu.json"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--json", str(out_json)]) == 1
    import json

    r = json.loads(out_json.read_text())
    assert "NCCL error" in r["error"] and r["plain_step_s"] > 0 and "ratio_vs_plain" not in r
    text = gpu_check.report(r)
    assert "mini3d train FAILED" in text and "NCCL error" in text and "plain PyTorch loop" in text


def test_torch_cuda_only_in_launch_and_peak_memory():
    """Device handling lives in one place: torch.cuda.* only in mini3d/launch/devices.py (and the
    timeline clock's timing events, mini3d/timeline_clock.py)."""
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "mini3d")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, REPO)
            func = None
            for i, line in enumerate(open(path), 1):
                m = re.match(r"def (\w+)", line)
                if m:
                    func = m.group(1)
                if re.search(r"torch\.cuda\b|\.cuda\(", line):
                    if rel in (os.path.join("mini3d", "launch", "devices.py"),
                               os.path.join("mini3d", "timeline_clock.py")):
                        continue
                    if rel == os.path.join("mini3d", "run", "records.py") and func == "peak_memory_bytes":
                        continue
                    offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "torch.cuda outside devices.py:\n" + "\n".join(offenders)


@pytest.mark.timeout(180)
def test_gpu_check_sh_strict_train_runs_on_cpu(tmp_path):
    """The strict-device `mini3d train` of benchmarks/gpu_check.sh, as written there, with
    --device cpu, one step and the tiny model (sizes overridden by later flags, to stay fast on
    CPU): it must run to the end under MINI3D_STRICT_DEVICE=1."""
    import shlex
    import subprocess
    import sys

    with open(os.path.join(REPO, "benchmarks", "gpu_check.sh")) as f:
        text = f.read()
    cmd = re.search(r'MINI3D_STRICT_DEVICE=1 timeout \d+ "\$PY" -m mini3d train (.*?)\|\| STRICT_RC',
                    text, re.S).group(1).replace("\\\n", " ")
    cmd = cmd.replace('"$DEV"', "cpu").replace('"${STRICT_MODEL[@]}"', "")  # set by its mode
    args = [a for a in shlex.split(cmd.replace('"$STRICT_DIR"', str(tmp_path)).replace(
        "$STRICT_DIR", str(tmp_path)))]
    assert "--dtype" in args and "bf16" in args and "--zero" in args and "--run-dir" in args
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MINI3D_STRICT_DEVICE="1")
    r = subprocess.run([sys.executable, "-m", "mini3d", "train", *args, "--device", "cpu",
                        "--steps", "1", "--model", "tiny", "--seq-len", "32", "--global-batch", "2"], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 1 steps" in r.stdout
    assert (tmp_path / "strict_train.jsonl").exists()


def test_gpu_llama_shape_and_report():
    """benchmarks/gpu_llama.py's model is the ~1B llama preset as the CLI builds it, and its report
    names every number (the CPU run of the whole logic: GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh)."""
    from benchmarks import gpu_llama
    from mini3d.cli import build_parser
    from mini3d.run.flags import model_from_args

    cfg = model_from_args(build_parser().parse_args(["train", *gpu_llama.MODEL_FLAGS[False]]))
    assert cfg.family == "llama" and 1.1e9 < cfg.n_params() < 1.4e9
    r = {"device": "H200", "model": cfg.name, "n_params": cfg.n_params(), "seq_len": 2048,
         "global_batch": 4, "peak_flops": 989e12, "peak_source": "H200-141GB preset", "error": None,
         "estimated_mem_bytes": 2**34, "timed_steps": 9, "step_s": 0.2, "tokens_per_s": 40960.0,
         "warmup_s": 50.0, "mfu": 0.4, "peak_mem_bytes": 2**34, "loss_first_last": (12.0, 8.0),
         "plain_step_s": 0.19, "plain_warmup_s": 5.0, "plain_loss_first_last": (12.0, 8.0),
         "ratio": 1.05, "ratio_min": 1.0, "ratio_max": 1.1}
    text = gpu_llama.report(r)
    for piece in ("1.24B params", "40,960 tokens/s", "compile warm-up 50.0 s", "MFU: 40.0%",
                  "estimator 16.00 GiB", "mini3d / this loop = 1.050"):
        assert piece in text, (piece, text)


@pytest.mark.timeout(240)
def test_gpu_extras_logic_on_cpu(tmp_path):
    """benchmarks/gpu_extras.py --device cpu --tiny (gpu_check.sh's fourth section): one sync a
    step after the first, the fused CPU ring kernel agreeing with the explicit math, and the
    step's timeline (perf_counter on CPU) inside the step."""
    import json

    from benchmarks import gpu_extras

    out = tmp_path / "extras.json"
    assert gpu_extras.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["syncs"]["program_syncs"] == [1, 1, 1] and report["syncs"]["cuda_syncs"] is None
    assert report["ring"]["kernel"] in ("cpu-flash", "explicit") and report["ring"]["ok"]
    t = report["timeline"]
    assert t["ok"] and t["clock"] == "perf_counter" and t["actions"] == 4, t
    assert 0 < t["compute_s"] <= t["span_s"] <= t["step_s"] + 1e-3, t
