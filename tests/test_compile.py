"""`--compile` (mini3d.run.compile: each transformer block's forward through torch.compile) equals the
eager single-process reference: loss, every gradient of every step and the final parameters, over
3 AdamW steps in float32, for both families, both attention kinds, every recomputation policy,
tp (with sequence parallelism), pp under split-backward schedules, and dp with ZeRO-1/3.

Two launches, both in strict-device mode (tests/conftest.py: the workers' default device is meta):

* one process with the inductor backend (real code generation, C++ on CPU), the llama family with
  written-out attention and selective recomputation (a checkpointed region inside the graph);
* one 4-process launch that runs several layouts in turn with backend="aot_eager": dynamo traces,
  AOT autograd partitions forward and backward and the graph breaks fall at the same collectives
  as with inductor, but the graphs run as eager aten ops instead of generated kernels. Inductor
  would compile each layout's graphs again in each of the 4 processes (~20 s each on 2 cores);
  the code generation itself is what the one-process case checks.

Tolerances: tests/test_3d.py's float32 ones (F32), explained there. Compiled graphs differ from
eager only in the order of float32 operations (inductor fuses elementwise ops and may reassociate
reductions, ~1e-7 relative per op), which is the same kind of difference as the layouts' summation
orders. Measured with inductor (torch 2.13, CPU): step-0 gradients within 9e-7 of each tensor's
max (bound 1e-5), later steps 6e-6 (bound 3e-4). aot_eager runs the eager aten ops, so on one rank
it equals eager exactly, and in the layouts only the layouts' own summation orders remain. A
compiled forward whose output is off by 1e-4 relative fails the layouts' test (tried by hand).
Under the split-backward schedules (zb-h1, zbv) a compiled piece is one autograd node whose
linears are not deferred (mini3d.wgrad): B computes its weight gradients and W accumulates them
(see mini3d/run/compile.py), which the zb-h1 and zbv layouts check.
"""

from __future__ import annotations

import dataclasses

import pytest

from mini3d.config import Plan
from mini3d.launch.launcher import launch
from tests.test_3d import BASE, CFG, SEED, STEPS, check_float32, reference
from tests.test_3d_llama import LLAMA


def run_compiled(jobs: list) -> list:
    """In a launched worker: `run_layouts` for each (cases, model dict) in `jobs`, plus how many
    graphs dynamo compiled (so a test cannot pass with compilation silently off)."""
    import torch._dynamo

    from tests.threed_workers import run_layouts

    out = []
    for cases, cfg_dict in jobs:
        for case in cases:  # each layout compiles its own graphs (none reused from the last one)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            results = run_layouts([case], cfg_dict, STEPS, SEED)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            out += [{**r, "graphs": graphs} for r in results]
    return out


def _cases(layouts) -> list[dict]:
    return [{"name": n, "plan": dataclasses.asdict(p)} for n, p in layouts]


def _check(results, layouts, ref, cfg):
    for name, plan in layouts:
        rows = [r for per_rank in results for r in per_rank if r["name"] == name]
        assert rows and all(r["graphs"] > 0 for r in rows), f"{name}: nothing was compiled"
        losses = {tuple(r["losses"]) for r in rows}
        assert len(losses) == 1, (name, losses)
        assert list(losses.pop()) == pytest.approx(ref[0], abs=1e-5), name
        check_float32(name, plan, results, ref, cfg=cfg)


INDUCTOR = [("llama-inductor-selective", Plan(micro_batches=2, recompute="selective",
                                              compile="inductor", **BASE))]


@pytest.mark.timeout(240)
def test_inductor_one_process_equals_eager():
    results = launch(run_compiled, 1, [(_cases(INDUCTOR), dataclasses.asdict(LLAMA))],
                     device="cpu", timeout=220)
    _check(results, INDUCTOR, reference(STEPS, cfg=LLAMA), LLAMA)
    # one graph serves all 4 blocks (same code, same shapes): a recompile per block would run
    # into dynamo's cache limit (8) on a deeper model and leave the later blocks eager
    assert [r["graphs"] for r in results[0]] == [1]


AOT = dict(compile="aot_eager", **BASE)
LAYOUTS_GPT2 = [  # every case uses the same 4 ranks
    ("tp2-pp2-zbh1-sp", Plan(tp=2, pp=2, schedule="zb-h1", micro_batches=2,
                             sequence_parallel=True, **AOT)),
    ("pp2-dp2-zbv-zero1-full", Plan(pp=2, dp=2, zero=1, schedule="zbv", virtual_stages=2,
                                    micro_batches=2, recompute="full", **AOT)),
    ("tp2-dp2-zero3-sdpa-full", Plan(tp=2, dp=2, zero=3, micro_batches=2, attention="sdpa",
                                     recompute="full", **AOT)),
]
LAYOUTS_LLAMA = [
    ("llama-tp2-pp2-interleaved-selective", Plan(tp=2, pp=2, schedule="interleaved",
                                                 virtual_stages=2, micro_batches=2,
                                                 recompute="selective", **AOT)),
]


@pytest.mark.timeout(300)
def test_compiled_layouts_equal_the_reference():
    jobs = [(_cases(LAYOUTS_GPT2), dataclasses.asdict(CFG)),
            (_cases(LAYOUTS_LLAMA), dataclasses.asdict(LLAMA))]
    results = launch(run_compiled, 4, jobs, device="cpu", timeout=280)
    _check(results, LAYOUTS_GPT2, reference(STEPS), CFG)
    _check(results, LAYOUTS_LLAMA, reference(STEPS, cfg=LLAMA), LLAMA)


def test_unknown_backend_is_refused():
    problems = Plan(compile="tensorrt", **BASE).problems(CFG, 1)
    assert problems == ["compile='tensorrt' is unknown (choose none, inductor, aot_eager)"]
