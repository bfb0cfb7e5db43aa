"""Tensor-parallel exercises (chapter 04): scenarios run on gloo by mini3d.launch.launcher, and their checks.

Each rank draws the full, unsharded weights and inputs from the grading seed, computes the
single-process reference, slices its own shard, runs the learner's code and reports the differences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini3d.course.grading.core import Check, CheckFailed, Exercise, expect
from mini3d.course.grading.scenario import _case, _gen, _read, _small, _topo


def _scenario_tp_linear(impl, seed):
    topo = _topo("tp")
    tp, i = topo.tp.size, topo.tp.index
    g = _gen(seed, "tp_linear")
    h, ff, batch = int(torch.randint(3, 9, (1,), generator=g)), tp * int(torch.randint(2, 5, (1,), generator=g)), 5
    w1, b1 = torch.randn(ff, h, generator=g), torch.randn(ff, generator=g)
    w2, b2 = torch.randn(h, ff, generator=g) * 0.5, torch.randn(h, generator=g)
    x0, c = torch.randn(batch, h, generator=g), torch.randn(batch, h, generator=g)
    rows = slice(i * ff // tp, (i + 1) * ff // tp)

    def run():
        ref = [t.clone().requires_grad_(True) for t in (x0, w1, b1, w2, b2)]
        h_ref = F.linear(ref[0], ref[1], ref[2])
        y_ref = F.linear(F.gelu(h_ref), ref[3], ref[4])
        (y_ref * c).sum().backward()
        mine = [t.clone().requires_grad_(True) for t in (x0, w1[rows], b1[rows], w2[:, rows], b2)]
        m0 = topo.log.count("tp", "all_reduce")
        hidden = impl.column_parallel_linear(mine[0], mine[1], mine[2], topo.tp)
        m1 = topo.log.count("tp", "all_reduce")
        y = impl.row_parallel_linear(F.gelu(hidden), mine[3], mine[4], topo.tp)
        m2 = topo.log.count("tp", "all_reduce")
        (y * c).sum().backward()
        m3 = topo.log.count("tp", "all_reduce")
        refs = [ref[0].grad, ref[1].grad[rows], ref[2].grad[rows], ref[3].grad[:, rows], ref[4].grad]
        errs = [(a.grad - b).abs().max().item() if a.grad is not None else float("inf")
                for a, b in zip(mine, refs)]
        return {"y": (y - y_ref).abs().max().item(), "x_grad": errs[0], "w_grad": max(errs[1:]),
                "hidden": (hidden - h_ref[:, rows]).abs().max().item() if hidden.shape == h_ref[:, rows].shape
                else float("inf"), "col_grad": max(errs[1:3]), "row_grad": max(errs[3:]),
                "col_ar": m1 - m0, "fwd_ar": m2 - m0, "bwd_ar": m3 - m2, "tp": tp}

    return {"mlp": _case(run)}


TP_TOL = 1e-4  # sums over the hidden dim split into tp partial sums: float32 reassociation, ~1e-6 relative


def _which_operator(r) -> str:
    """A sentence naming the operator (f / g, copy / reduce, column / row layer) that the numbers of
    one rank point at, so a failure says where to look."""
    if r["col_ar"]:
        return ("column_parallel_linear all-reduced in forward: f (CopyToTP) is the identity going "
                "forward (each rank already holds all of x); the forward sum is g's, in the row layer")
    if r["hidden"] > TP_TOL:
        return ("the column-parallel layer's output already differs from this rank's slice "
                "x @ W_i^T + b_i: look at column_parallel_linear and f's forward (the identity)")
    if r["y"] > TP_TOL:
        return ("the column layer is right, the row-parallel output is not: g (ReduceFromTP) sums the "
                "partial products x_i @ W_i^T over tp once, and the full bias is added once, after the sum")
    if r["bwd_ar"] == 0 or r["x_grad"] > TP_TOL:
        return ("the input gradient is f's job: f (CopyToTP) all-reduces (sums) it in backward, while "
                "g's backward is the identity (it must not reduce again)")
    if r["col_grad"] > TP_TOL:
        return "the column-parallel shard gradients (W_i rows, b_i) are wrong"
    return ("the row-parallel gradients are wrong: W_i's columns get this rank's slice, the full bias "
            "gets the whole output gradient once")


def _tp_small(ctx, key, what, expected="the single-process result"):
    recs = _read(ctx, "mlp")
    rank = max(range(len(recs)), key=lambda k: recs[k][key])
    worst = recs[rank][key]
    if not worst <= TP_TOL:
        raise CheckFailed(f"{what}: expected {expected} (within {TP_TOL:g}), got max difference "
                          f"{worst:.3g} on rank {rank}; {_which_operator(recs[rank])}")


def tp_forward(ctx):
    _tp_small(ctx, "y", "output of column-parallel -> GELU -> row-parallel")


def tp_input_grad(ctx):
    _tp_small(ctx, "x_grad", "gradient of the input x (needs f's backward all-reduce)")


def tp_weight_grads(ctx):
    _tp_small(ctx, "w_grad", "gradients of this rank's weight and bias shards",
              "the matching slice of the single-process gradients")


def tp_comm(ctx):
    for rank, r in enumerate(_read(ctx, "mlp")):
        got = (r["col_ar"], r["fwd_ar"] - r["col_ar"], r["bwd_ar"])
        expect(got == (0, 1, 1), f"rank {rank}: tp all-reduces (column layer forward, row layer "
               f"forward, backward) of one MLP", "(0, 1, 1): f copies going forward and all-reduces "
               "going backward, g all-reduces going forward and copies going backward", got)


def _scenario_vocab_ce(impl, seed):
    topo = _topo("tp")
    tp, i = topo.tp.size, topo.tp.index
    g = _gen(seed, "vocab_ce")
    n, v = int(torch.randint(4, 12, (1,), generator=g)), tp * int(torch.randint(2, 6, (1,), generator=g))
    logits0 = torch.randn(n, v, generator=g) * 3
    targets = torch.randint(0, v, (n,), generator=g)
    targets[: min(n, tp)] = torch.arange(min(n, tp)) * (v // tp)  # every shard owns some target
    cols = slice(i * v // tp, (i + 1) * v // tp)

    def run(offset):
        ref = (logits0 + offset).clone().requires_grad_(True)
        loss_ref = F.cross_entropy(ref, targets)
        loss_ref.backward()
        mine = (logits0 + offset)[:, cols].clone().requires_grad_(True)
        mark = len(topo.log.events)
        loss = impl.vocab_parallel_cross_entropy(mine, targets, i * v // tp, topo.tp)
        loss.backward()
        evs = list(topo.log.events)[mark:]
        ops = sorted({e.op for e in evs})
        widest = max((e.bytes // max(n, 1) for e in evs), default=0)  # bytes per token of the largest op
        grad_err = ((mine.grad - ref.grad[:, cols]).abs().max().item()
                    if mine.grad is not None else float("inf"))
        return {"loss": abs(loss.item() - loss_ref.item()), "grad": grad_err,
                "finite": bool(torch.isfinite(loss).item()), "ops": ops, "per_token": widest, "v": v}

    return {"plain": _case(run, 0.0), "large": _case(run, 1000.0)}


# log-sum-exp of shards vs torch's fused kernel: float32 rounding ~1e-6 on losses of a few units
def ce_loss(ctx):
    _small(_read(ctx, "plain"), "loss", "vocab-parallel loss", 1e-5, "F.cross_entropy on the full logits")


def ce_grad(ctx):
    _small(_read(ctx, "plain"), "grad", "gradient of this rank's logits shard", 1e-5,
           "(softmax - onehot) / N, sliced")


def ce_stable(ctx):
    recs = _read(ctx, "large")
    expect(all(r["finite"] for r in recs), "loss for logits around 1000", "a finite number "
           "(subtract the global max before exp)", [r["finite"] for r in recs])
    _small(recs, "loss", "loss for logits around 1000", 1e-3, "F.cross_entropy")


def ce_no_gather(ctx):
    for rank, r in enumerate(_read(ctx, "plain")):
        expect(r["ops"] == ["all_reduce"], f"rank {rank}: communication ops",
               "all-reduces of per-token numbers only (never gather the logits)", r["ops"])
        # one number per token (float32, or float64 at most): an all-reduce of a zero-padded
        # (N, V) logits tensor gathers them all the same
        expect(r["per_token"] <= 8, f"rank {rank}: bytes per token of the largest all-reduce "
               f"(vocabulary {r['v']})", "at most 8 (one number per token, never a row of logits)",
               r["per_token"])


EXERCISES = [
    Exercise("tp_linear", "04 tensor parallelism", [
        Check("forward", 2, tp_forward, "column -> row parallel MLP output"),
        Check("input_grad", 2, tp_input_grad, "f all-reduces the input gradient"),
        Check("weight_grads", 2, tp_weight_grads, "shard gradients"),
        Check("comm", 1, tp_comm, "one all-reduce forward, one backward"),
    ], scenario=_scenario_tp_linear, world=lambda rng: rng.choice([2, 3, 4])),
    Exercise("vocab_ce", "04 tensor parallelism", [
        Check("loss", 2, ce_loss, "equals cross-entropy on full logits"),
        Check("grad", 2, ce_grad, "local gradient of the shard"),
        Check("stable", 1, ce_stable, "no overflow for large logits"),
        Check("no_gather", 1, ce_no_gather, "only all-reduces"),
    ], scenario=_scenario_vocab_ce, world=lambda rng: rng.choice([2, 3, 4])),
]
