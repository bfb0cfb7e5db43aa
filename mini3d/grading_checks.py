"""Checks of the single-process exercises (see mini3d/grading.py for how checks are run).

Each check draws fresh shapes / meshes from `ctx.rng` and compares the learner's answer with an
independent ground truth: the real `mini3d.model.GPT`, `mini3d.grid.Grid`, closed-form pipeline
timings, or a count taken while the code runs.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .grading import Check, CheckFailed, Exercise, expect

# ---------------------------------------------------------------- 00 count_params


def _random_cfg(rng) -> ModelConfig:
    heads = rng.choice([1, 2, 4])
    return ModelConfig(rng.randint(1, 3), heads * rng.randint(2, 6), heads, rng.randint(5, 40),
                       rng.randint(4, 20), d_ff=rng.choice([0, rng.randint(3, 30)]))


def count_matches_model(ctx):
    from .model import GPT

    for _ in range(3):
        cfg = _random_cfg(ctx.rng)
        truth = sum(p.numel() for p in GPT(cfg).parameters())
        got = ctx.impl.count_params(cfg)
        expect(got == truth, f"count_params for {cfg}", f"{truth} (counted on mini3d.model.GPT)", got)


def count_70b(ctx):
    from .config import PRESETS

    # the GPT-style 70B shape (PRESETS["gpt-70b"] now names Llama-3.1-70B, another family)
    cfg = dataclasses.replace(PRESETS["gpt-22b"], n_layers=80, d_model=8192, n_heads=64,
                              vocab_size=32000, max_seq_len=4096, d_ff=36864, name="gpt-style-70b")
    got = ctx.impl.count_params(cfg)
    expect(got == cfg.n_params(), "count_params(a GPT-style 70B: 80 x 8192, d_ff 36864)",
           cfg.n_params(), got)


def min_gpus(ctx):
    for _ in range(5):
        n, gb, bpp = ctx.rng.randint(10**6, 10**11), ctx.rng.randint(10**8, 10**11), ctx.rng.choice([8, 16])
        truth = -(-n * bpp // gb)
        got = ctx.impl.min_gpus_for_model_states(n, gb, bpp)
        expect(got == truth, f"min_gpus_for_model_states({n}, {gb}, {bpp})",
               f"{truth} (round up: a partial GPU is a whole GPU)", got)


# ---------------------------------------------------------------- 01 memory

_PER = {"float32": {"params": 4, "grads": 4, "optimizer": 8},
        "bf16": {"params": 2, "grads": 2, "optimizer": 12}}


def bytes_per_param_ok(ctx):
    for dtype, truth in _PER.items():
        got = ctx.impl.bytes_per_param(dtype)
        expect(got == truth, f"bytes_per_param({dtype!r})", truth, got)


def _zero_case(ctx, stage):
    for _ in range(3):
        n, dp, dtype = ctx.rng.randint(10**5, 10**10), ctx.rng.choice([2, 4, 8, 64]), ctx.rng.choice(list(_PER))
        shard = {0: set(), 1: {"optimizer"}, 2: {"optimizer", "grads"},
                 3: {"optimizer", "grads", "params"}}[stage]
        truth = {k: n * b / (dp if k in shard else 1) for k, b in _PER[dtype].items()}
        got = ctx.impl.zero_bytes_per_rank(n, dp, stage, dtype)
        ok = isinstance(got, dict) and set(got) == set(truth) and all(
            abs(got[k] - truth[k]) <= 1e-9 * truth[k] for k in truth)
        expect(ok, f"zero_bytes_per_rank({n}, dp={dp}, zero={stage}, {dtype!r})", truth, got)


def zero_stage(stage):
    return lambda ctx: _zero_case(ctx, stage)


# ---------------------------------------------------------------- 05 one_f_one_b


def _ref_1f1b(pp, r, m):
    w = min(pp - r - 1, m)
    out = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        out += [f"F{w + i}", f"B{i}"]
    return out + [f"B{i}" for i in range(m - w, m)]


def _meshes(rng):
    """(pp, micro_batches) pairs, always including one deep pipeline with a long drain."""
    pairs = [(rng.randint(4, 6), 0), (rng.randint(2, 5), 0), (rng.randint(2, 3), 0)]
    return [(p, p + rng.randint(0, 4)) for p, _ in pairs]


def _each_rank(ctx):
    for pp, m in _meshes(ctx.rng):
        for r in range(pp):
            yield pp, r, m, list(ctx.impl.one_f_one_b(pp, r, m))


def fb_each_once(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        want = sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
        expect(sorted(acts) == want, f"pp={pp} rank {r} m={m}: each F and B exactly once",
               "F0..F%d and B0..B%d" % (m - 1, m - 1), acts)


def forward_first(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        for i in range(m):
            if f"F{i}" in acts and f"B{i}" in acts:
                expect(acts.index(f"F{i}") < acts.index(f"B{i}"), f"pp={pp} rank {r} m={m}",
                       f"F{i} before B{i}", acts)


def warmup(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        lead = next((i for i, a in enumerate(acts) if a.startswith("B")), len(acts))
        expect(lead == min(pp - r, m), f"pp={pp} rank {r} m={m}: forwards before the first backward",
               min(pp - r, m), f"{lead} in {acts}")


def in_flight(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        live = peak = 0
        for a in acts:
            live += 1 if a.startswith("F") else -1
            peak = max(peak, live)
        expect(peak <= min(pp - r, m), f"pp={pp} rank {r} m={m}: micro-batches held at once",
               f"at most {min(pp - r, m)}", f"{peak} in {acts}")


def exact_order(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        want = _ref_1f1b(pp, r, m)
        expect(acts == want, f"pp={pp} rank {r} m={m}: 1F1B order", want, acts)


# ---------------------------------------------------------------- 05 bubble


def _sim(ctx, sched, tf, tb):
    got = ctx.impl.simulate(sched, tf, tb)
    expect(isinstance(got, dict) and {"makespan", "bubble_fraction"} <= set(got),
           "simulate(...) result", "a dict with makespan and bubble_fraction", got)
    return got


def _close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def _formula(ctx, kind):
    for _ in range(3):
        pp, m = ctx.rng.randint(2, 6), ctx.rng.randint(1, 9)
        m = max(m, pp) if kind == "1f1b" else m
        tf, tb = ctx.rng.randint(1, 5) * 0.5, ctx.rng.randint(1, 5) * 0.5
        sched = ([[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)] for _ in range(pp)]
                 if kind == "gpipe" else [_ref_1f1b(pp, r, m) for r in range(pp)])
        got = _sim(ctx, sched, tf, tb)
        span = (m + pp - 1) * (tf + tb)
        expect(_close(got["makespan"], span), f"{kind} pp={pp} m={m} t_f={tf} t_b={tb}: makespan",
               f"(m + pp - 1)(t_f + t_b) = {span}", got["makespan"])
        bub = (pp - 1) / (m + pp - 1)
        expect(_close(got["bubble_fraction"], bub), f"{kind} pp={pp} m={m}: bubble_fraction",
               f"(pp - 1) / (m + pp - 1) = {bub:.6f}", got["bubble_fraction"])


def gpipe_formula(ctx):
    _formula(ctx, "gpipe")


def one_f_one_b_formula(ctx):
    _formula(ctx, "1f1b")


def waits_for_neighbours(ctx):
    """A 2-stage pipeline, worked by hand: the last stage runs B0 only after its own F0 and F1 (its
    list says so), and rank 0's B0 waits for rank 1's B0."""
    tf, tb = 1.0, ctx.rng.choice([2.0, 3.0])
    sched = [["F0", "F1", "B0", "B1"], ["F0", "F1", "B0", "B1"]]
    # rank1: F0 1-2, F1 2-3, B0 3-3+tb, B1 ..3+2tb; rank0: B0 starts at 3+tb, B1 at max(3+2tb, 3+2tb)
    span = 3 + 3 * tb
    got = _sim(ctx, sched, tf, tb)
    expect(_close(got["makespan"], span), f"makespan of {sched} with t_f={tf}, t_b={tb}", span,
           got["makespan"])


# ---------------------------------------------------------------- 06 rank_grid


def _shapes(rng):
    return [(rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3])) for _ in range(4)]


def coords_ok(ctx):
    from .grid import Grid

    for tp, pp, dp in _shapes(ctx.rng):
        g = Grid(tp, pp, dp)
        for r in range(g.world_size):
            got = ctx.impl.coords(r, tp, pp, dp)
            expect(got == g.coords(r), f"coords({r}, tp={tp}, pp={pp}, dp={dp})", g.coords(r), got)


def groups_of(axis):
    def check(ctx):
        from .grid import Grid

        for tp, pp, dp in _shapes(ctx.rng):
            want = Grid(tp, pp, dp).groups(axis)
            got = ctx.impl.rank_groups(tp, pp, dp, axis)
            expect(got == want, f"rank_groups(tp={tp}, pp={pp}, dp={dp}, {axis!r})", want, got)
    return check


# ---------------------------------------------------------------- 07 recompute


def _recompute_run(ctx, policy):
    """Loss, grads, attention-core calls and bytes saved for backward of one step under `policy`."""
    from .model import GPT, attention_core

    cfg = ModelConfig(2, 16, 2, 32, 16)
    seed = ctx.rng.randint(0, 10**6)
    model = GPT(cfg, seed)
    calls = [0]

    def counting_core(q, k, v):
        calls[0] += 1
        return attention_core(q, k, v)

    for b in model.blocks.values():
        b.attn.core = counting_core
    model = ctx.impl.apply_recompute(model, policy) or model
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 32, (2, 12), generator=g), torch.randint(0, 32, (2, 12), generator=g)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls[0], saved[0]


def _recompute_all(ctx):
    return {p: _recompute_run(ctx, p) for p in ("none", "selective", "full")}


def same_grads(ctx):
    runs = _recompute_all(ctx)
    base = runs["none"]
    for policy in ("selective", "full"):
        loss, grads, _, _ = runs[policy]
        expect(abs(loss - base[0]) < 1e-6, f"loss under {policy!r}", base[0], loss)
        for n, g in grads.items():
            # recomputation replays the same float32 ops, so results agree to rounding
            err = (g - base[1][n]).abs().max().item()
            expect(err < 1e-6, f"gradient of {n} under {policy!r}", "the same as without recompute",
                   f"max difference {err:.3g}")


def selective_recomputes_core(ctx):
    runs = _recompute_all(ctx)
    n = 2  # layers
    expect(runs["none"][2] == n, "attention-core calls without recompute", n, runs["none"][2])
    expect(runs["selective"][2] == 2 * n, "attention-core calls with 'selective' (forward + recompute)",
           2 * n, runs["selective"][2])
    expect(runs["selective"][3] < runs["none"][3], "bytes saved for backward with 'selective'",
           f"fewer than without recompute ({runs['none'][3]})", runs["selective"][3])


def full_saves_least(ctx):
    runs = _recompute_all(ctx)
    expect(runs["full"][3] < runs["selective"][3], "bytes saved for backward with 'full'",
           f"fewer than with 'selective' ({runs['selective'][3]})", runs["full"][3])
    expect(runs["full"][2] == 4, "attention-core calls with 'full' (each block runs twice)", 4, runs["full"][2])


# ---------------------------------------------------------------- 08 explain_hang


def _hang_logs(rng, tp, dp, stuck, steps):
    """Per-rank logs of `steps` rounds of (tp all_reduce, dp all_reduce); rank `stuck` stops before
    round `stuck_at`'s dp all-reduce, so its dp peers wait there, then nothing follows."""
    from .grid import Grid

    grid = Grid(tp, 1, dp)
    stuck_at = rng.randint(1, steps)
    logs = {r: [] for r in range(grid.world_size)}
    t = 0.0
    blocked = set()
    for s in range(1, steps + 1):
        for axis in ("tp", "dp"):
            for r in range(grid.world_size):
                if r in blocked:
                    continue
                if r == stuck and s == stuck_at and axis == "dp":
                    blocked.add(r)
                    continue
                group = tuple(grid.group_of(r, axis))
                t += 0.001
                logs[r].append({"axis": axis, "op": "all_reduce", "seq": s, "group": group,
                                "start": t, "end": None})
            for r in range(grid.world_size):  # completes when every member issued it
                for e in logs[r]:
                    if e["end"] is None and not (set(e["group"]) & blocked):
                        e["end"] = e["start"] + 0.0005
                if logs[r] and logs[r][-1]["end"] is None:
                    blocked.add(r)
    want_group = grid.group_of(stuck, "dp")
    return logs, {"axis": "dp", "op": "all_reduce", "seq": stuck_at,
                  "waiting": sorted(r for r in want_group if r != stuck), "missing": [stuck]}


def finds_collective(ctx):
    for _ in range(3):
        tp, dp = ctx.rng.choice([1, 2]), ctx.rng.choice([2, 3, 4])
        logs, want = _hang_logs(ctx.rng, tp, dp, ctx.rng.randrange(tp * dp), ctx.rng.randint(2, 5))
        got = ctx.impl.explain_hang(logs) or {}
        sub = {k: got.get(k) for k in ("axis", "op", "seq")}
        expect(sub == {k: want[k] for k in sub}, f"stuck collective (tp={tp}, dp={dp})",
               {k: want[k] for k in sub}, sub)


def names_ranks(ctx):
    for _ in range(3):
        tp, dp = ctx.rng.choice([1, 2]), ctx.rng.choice([2, 3, 4])
        logs, want = _hang_logs(ctx.rng, tp, dp, ctx.rng.randrange(tp * dp), ctx.rng.randint(2, 5))
        got = ctx.impl.explain_hang(logs) or {}
        sub = {k: got.get(k) for k in ("waiting", "missing")}
        expect(sub == {k: want[k] for k in sub}, f"ranks in the hang (tp={tp}, dp={dp})",
               {k: want[k] for k in sub}, sub)


def no_hang(ctx):
    logs = {r: [{"axis": "dp", "op": "all_reduce", "seq": 1, "group": (0, 1), "start": 0.1 * r,
                 "end": 1.0}] for r in (0, 1)}
    got = ctx.impl.explain_hang(logs)
    expect(got is None, "explain_hang of logs with nothing pending", None, got)


EXERCISES = [
    Exercise("count_params", "00 why 70B does not fit", [
        Check("matches_model", 3, count_matches_model, "equals the parameter count of mini3d.model.GPT"),
        Check("gpt_70b", 1, count_70b, "the 70B preset"),
        Check("min_gpus", 1, min_gpus, "GPUs needed just for model states"),
    ]),
    Exercise("memory", "01 memory anatomy", [
        Check("bytes_per_param", 2, bytes_per_param_ok, "fp32 and mixed-precision AdamW bytes"),
        Check("zero0", 1, zero_stage(0), "no sharding"),
        Check("zero1", 1, zero_stage(1), "ZeRO-1 shards optimizer states"),
        Check("zero2", 1, zero_stage(2), "ZeRO-2 also shards gradients"),
        Check("zero3", 1, zero_stage(3), "ZeRO-3 also shards parameters"),
    ]),
    Exercise("one_f_one_b", "05 pipeline parallelism", [
        Check("each_once", 2, fb_each_once, "every micro-batch forward and backward once"),
        Check("forward_first", 1, forward_first, "F(mb) before B(mb)"),
        Check("warmup", 2, warmup, "pp - pp_rank forwards before the first backward"),
        Check("in_flight", 2, in_flight, "at most pp - pp_rank micro-batches held"),
        Check("exact_order", 3, exact_order, "the exact 1F1B order"),
    ]),
    Exercise("bubble", "05 pipeline parallelism", [
        Check("gpipe", 2, gpipe_formula, "GPipe: (m+p-1)(tf+tb), bubble (p-1)/(m+p-1)"),
        Check("one_f_one_b", 2, one_f_one_b_formula, "1F1B has the same bubble as GPipe"),
        Check("dependencies", 1, waits_for_neighbours, "a hand-timed 2-stage case"),
    ]),
    Exercise("rank_grid", "06 3D parallelism", [
        Check("coords", 2, coords_ok, "rank -> (tp, pp, dp)"),
        Check("tp_groups", 1, groups_of("tp"), "tensor-parallel groups"),
        Check("dp_groups", 1, groups_of("dp"), "data-parallel groups"),
        Check("pp_groups", 1, groups_of("pp"), "pipeline groups"),
    ]),
    Exercise("recompute", "07 recomputation", [
        Check("same_grads", 2, same_grads, "loss and every gradient unchanged"),
        Check("selective", 2, selective_recomputes_core, "selective reruns only the attention core"),
        Check("full", 2, full_saves_least, "full keeps the least for backward"),
    ]),
    Exercise("explain_hang", "08 debugging OOM and hangs", [
        Check("collective", 2, finds_collective, "names the stuck collective"),
        Check("ranks", 2, names_ranks, "names who waits and who never came"),
        Check("no_hang", 1, no_hang, "nothing pending: None"),
    ]),
]

__all__ = ["EXERCISES", "CheckFailed"]
