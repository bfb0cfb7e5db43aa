"""Memory: the estimator against the live ledgers, and the OOM report of --memory-budget."""

import pytest
import torch

from mini3d.cli import main
from mini3d.config import PRESETS, Plan
from mini3d.cost.memory import estimate_memory
from mini3d.dp.buckets import GRAD_BUCKETS_IN_FLIGHT
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec
from tests.threed_workers import run_specs

TINY = PRESETS["tiny"]
LAYOUTS = [  # (plan, world) pairs whose shards divide evenly: no ZeRO padding to document
    Plan(global_batch=8, micro_batches=2),
    Plan(tp=2, dp=2, zero=1, global_batch=8, micro_batches=2),
    Plan(pp=2, dp=2, zero=2, global_batch=8, micro_batches=2),
]


@pytest.fixture(scope="module")
def ledgers():
    """{layout index: every rank's result}: the layouts of one world size run in one launch, one
    after the other (tests.threed_workers.run_specs), not one launch each (each is seconds of start-up)."""
    out = {}
    for world in sorted({p.world_size for p in LAYOUTS}):
        idx = [i for i, p in enumerate(LAYOUTS) if p.world_size == world]
        ranks = launch(run_specs, world,
                       [make_spec(TINY, LAYOUTS[i], steps=1, collect=["ledger"]) for i in idx], timeout=200)
        out.update({i: [r[k] for r in ranks] for k, i in enumerate(idx)})
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=[f"tp{p.tp}pp{p.pp}dp{p.dp}z{p.zero}" for p in LAYOUTS])
def test_estimator_model_states_equal_the_live_ledger(i, ledgers):
    plan, out = LAYOUTS[i], ledgers[i]
    for r in out:
        est = estimate_memory(TINY, plan, r["coords"]["pp"])
        led = r["ledger"]
        assert led["parameters"] == est.params, (r["coords"], led, est)
        assert led["gradients"] == est.grads
        # optimizer: AdamW's two moments (+ fp32 masters, which in float32 are the parameters
        # themselves and cost nothing); the per-group `step` scalars are the ledger's own category
        assert led["master_weights"] + led["optimizer_states"] == est.optimizer


ACTIVATION_CASES = [("none", "explicit"), ("selective", "explicit"), ("full", "explicit"), ("none", "sdpa")]


def _activation_plan(policy, attention):
    return Plan(global_batch=8, micro_batches=2, recompute=policy, attention=attention)


@pytest.fixture(scope="module")
def activation_runs():
    """{(policy, attention): the 1-rank result}, all four in one process (4 launches took 25 CPU
    seconds, one takes about a third of that)."""
    specs = [make_spec(TINY, _activation_plan(*c), steps=1, collect=["activations"]) for c in ACTIVATION_CASES]
    (runs,) = launch(run_specs, 1, specs, timeout=100)
    return dict(zip(ACTIVATION_CASES, runs))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy,attention", ACTIVATION_CASES)
def test_estimator_activations_within_15_percent_of_the_measured_ledger(policy, attention, activation_runs):
    plan = _activation_plan(policy, attention)
    r = activation_runs[(policy, attention)]
    measured = sum(r["activations"].values())  # bytes saved for backward, per micro-batch
    est = estimate_memory(TINY, plan, 0)
    # The estimate of the peak adds, under full recompute, the one block being recomputed during
    # backward: a transient the saved-tensor ledger cannot see. Compare what both count.
    transient = est.detail["layer_full_bytes"] if policy == "full" else 0
    stored = est.activations - transient
    assert abs(stored - measured) / measured < 0.15, (policy, stored, measured)


@pytest.mark.timeout(120)
def test_memory_budget_gives_the_oom_report(capsys):
    rc = main(["train", "--steps", "2", "--no-progress", "--memory-budget", "5MiB", "--timeout", "90"])
    err = capsys.readouterr().err
    assert rc == 4
    assert "OUT OF MEMORY on rank 0 (tp=0, pp=0, dp=0)" in err and "exceeds the memory budget of 5.0 MiB" in err
    for category in ("params", "grads", "optimizer", "activations"):
        assert category in err
    assert "measured" in err and "estimated" in err
    assert "plans that would fit:" in err and "recompute" in err


def test_cuda_oom_is_explained_with_the_allocator_numbers(monkeypatch):
    """The CUDA path of the OOM report, with the allocator faked (no GPU here): the activations are
    what the allocator holds beyond the measured model states, the budget is the card's capacity."""
    import mini3d.launch.launcher as launch
    from mini3d.diagnose.oom import cuda_oom

    monkeypatch.setattr(launch, "device_memory",
                        lambda d: {"allocated": 900 * 2**20, "peak": 950 * 2**20, "capacity": 2**30})
    states = {"params": 100 * 2**20, "grads": 100 * 2**20, "optimizer": 200 * 2**20,
              "activations": 0, "comm_buffers": 0}
    plan = Plan(global_batch=8, micro_batches=1)
    err = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    exc = cuda_oom(err, states, "cuda:0", 0, {"tp": 0, "pp": 0, "dp": 0}, TINY, plan, None)
    assert exc.measured["activations"] == 500 * 2**20
    assert "OUT OF MEMORY on rank 0 (tp=0, pp=0, dp=0)" in exc.report
    assert "budget of 1,024.0 MiB" in exc.report  # the card's capacity is the budget
    assert "Tried to allocate 2.00 GiB" in exc.report  # the allocator's own words are kept


def _init_rss_growth(cfg_name: str) -> tuple[float, float, float]:
    """On each of 2 tp ranks: (peak RSS growth while building this rank's tp shard as the trainer
    does, the shard's bytes, the largest full parameter's bytes)."""
    import resource

    import torch.distributed as dist

    from mini3d.grid import Grid, build_topology
    from mini3d.models.transformer import GPT
    from mini3d.pp.partition import build_stages
    from mini3d.tp import apply_tp, materialize_reference

    cfg = PRESETS[cfg_name]
    plan = Plan(tp=2, global_batch=2, seq_len=64)
    topo = build_topology(Grid(2, 1, 1), dist.get_rank())
    with torch.device("meta"):
        largest = max(p.numel() for p in GPT(cfg, init=False).parameters()) * 4
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (stage,) = build_stages(cfg, 0, 0, 1, device="meta").values()
    apply_tp(stage, topo, plan)
    materialize_reference(stage, topo, 0, torch.device("cpu"))
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return growth, sum(p.numel() * 4 for p in stage.parameters()), largest


@pytest.mark.timeout(120)
def test_ranks_never_hold_the_unsliced_stage_while_initialising():
    """gpt2-small on tp2: each rank's peak RSS grows by its shard (239 MiB: the tied head shares the
    embedding) plus one full parameter and its slice at a time (the 147 MiB embedding), not by the
    whole stage (drawing every full value first, then slicing, measured 836 MiB here).

    Before the fix it measured 853-869 MiB: the tied head's 147 MiB value was drawn a second time,
    each full value existed twice (randn, then a scaled copy; the embedding padded by a copy),
    the previous parameter's full value was still alive while the next was drawn, and those
    short-lived full-size blocks, interleaved with the shards kept, left ~259 MiB of freed but
    resident holes in glibc's heap under strict-device mode (~15 MiB without it)."""
    for growth, shard, largest in launch(_init_rss_growth, 2, "gpt2-small", device="cpu", timeout=100):
        # shard: what the rank keeps; 1.5 x largest: one full parameter and its slice alive at once
        # (the embedding, the largest); 0.5 x largest + 64 MiB: allocator slack, freed memory
        # glibc keeps resident (measured 50 MiB after the fix; the bound is 597 MiB).
        # Building the stage whole (all full values alive at once) measured 836 MiB: fails.
        assert growth < shard + 2 * largest + 64 * 2**20, (growth / 2**20, shard / 2**20)


@pytest.mark.timeout(240)
def test_zero_peak_gradient_bytes_of_the_small_model_at_1_and_4_micro_batches(tmp_path):
    """`small` preset at dp=2, ZeRO-0 to 3, with 1 and with 4 micro-batches: the peak gradient bytes
    of a step (measured from the live buffers, reported as `peak_grad_bytes` in --log-jsonl) of
    ZeRO-2 and ZeRO-3 are at most 0.6 x ZeRO-0's at either count, because every micro-batch's
    buckets are reduce-scattered into the shard and freed (mini3d.dp.zero, "Micro-batches"), and
    ZeRO-0/1's peak equals the estimator's gradients, and ZeRO-2/3's is within one bucket below
    the estimator's gradients plus its in-flight buckets (comm_buffers "dp", the bound
    `dp.buckets.transient_grad_bytes`: GRAD_BUCKETS_IN_FLIGHT times the largest bucket; the
    buckets in flight together are that size only where they are all the largest), so it proves
    that many buffers alive at once and never more: the shards of `small` divide evenly, so there
    is no padding to allow for. Before the fix, ZeRO-2 at 4 micro-batches held 1.57 x ZeRO-0's (a
    full .grad under no_sync + the shard)."""
    import json

    cfg = PRESETS["small"]
    plans = [Plan(dp=2, zero=z, global_batch=2 * m, micro_batches=m, seq_len=32, bucket_mb=1.0)
             for m in (1, 4) for z in (0, 1, 2, 3)]  # 1 MiB buckets: `small` is one bucket at DDP's 25
    logs = [tmp_path / f"zero{p.zero}_m{p.micro_batches}.jsonl" for p in plans]
    specs = [make_spec(cfg, p, steps=2, log_jsonl=str(log)) for p, log in zip(plans, logs)]
    launch(run_specs, 2, specs, device="cpu", timeout=200)
    peak = {(p.zero, p.micro_batches): json.loads(log.read_text().splitlines()[-1])["peak_grad_bytes"]
            for p, log in zip(plans, logs)}
    for p in plans:
        est, key = estimate_memory(cfg, p), (p.zero, p.micro_batches)
        transient = est.detail["comm_buffers"]["dp"]  # the bound; 0 for ZeRO-0/1
        assert (transient > 0) == (p.zero >= 2)
        if p.zero < 2:
            assert peak[key] == est.grads, (key, peak[key], est)
        else:
            largest = transient / GRAD_BUCKETS_IN_FLIGHT
            assert est.grads + transient - largest < peak[key] <= est.grads + transient, \
                (key, peak[key], est.grads, transient)
            assert peak[key] <= 0.6 * peak[(0, p.micro_batches)], peak
