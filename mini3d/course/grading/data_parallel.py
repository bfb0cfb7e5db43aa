"""Data-parallel exercises (chapters 02-03): ring_allreduce, grad_buckets and zero1.

Each scenario runs in every rank (see `scenario.py`) and returns plain numbers: errors against the
single-process reference and what the communication log recorded. The checks below judge those
numbers in the parent process.
"""

from __future__ import annotations

import copy

import torch

from .core import Check, Exercise, expect
from .scenario import _case, _gen, _read, _small, _topo


# ---------------------------------------------------------------- 02 ring_allreduce


def _scenario_ring_allreduce(impl, seed):
    topo = _topo("dp")
    n, i = topo.dp.size, topo.dp.index
    g = _gen(seed, "ring", 0)
    shape = (int(torch.randint(1, 5, (1,), generator=g)) * n, int(torch.randint(2, 7, (1,), generator=g)))
    uneven = n * int(torch.randint(2, 9, (1,), generator=g)) + int(torch.randint(1, n, (1,), generator=g))

    def one(shape, average, tag):
        xs = [torch.randn(shape, generator=_gen(seed, "ring", tag, r)) for r in range(n)]
        want = sum(xs) / (n if average else 1)
        x = xs[i].clone()
        mark = len(topo.log.events)
        impl.ring_all_reduce(x, topo.dp, average=average)
        ev = list(topo.log.events)[mark:]
        return {"err": (x - want).abs().max().item(), "ops": sorted({e.op for e in ev}),
                "sent": sum(e.bytes for e in ev if e.op == "send"), "bytes": x.numel() * 4,
                "numel": x.numel(), "n": n}

    return {"sum": _case(one, shape, False, "sum"), "avg": _case(one, shape, True, "avg"),
            "uneven": _case(one, (uneven,), False, "uneven")}


# float32 sums of <= 4 standard normals in another order differ by a few ulp (~1e-6)
def ring_sum(ctx):
    _small(_read(ctx, "sum"), "err", "ring all-reduce sum", 1e-5, "the sum over ranks")


def ring_avg(ctx):
    _small(_read(ctx, "avg"), "err", "ring all-reduce with average=True", 1e-5,
           "the mean over ranks (the sum divided by axis.size)")


def ring_uneven(ctx):
    recs = _read(ctx, "uneven")
    _small(recs, "err", f"ring all-reduce of {recs[0]['numel']} elements over {recs[0]['n']} ranks "
                        f"(not a multiple)", 1e-5, "the sum over ranks")


def ring_p2p_only(ctx):
    for case in ("sum", "avg", "uneven"):
        for rank, r in enumerate(_read(ctx, case)):
            expect(set(r["ops"]) <= {"send", "recv"} and "send" in r["ops"],
                   f"rank {rank} communication ({case})", "only comm.send / comm.recv", r["ops"])


def ring_bandwidth(ctx):
    for rank, r in enumerate(_read(ctx, "uneven")):
        n, numel = r["n"], r["numel"]
        lo, hi = 2 * (n - 1) * (numel // n) * 4, 2 * (n - 1) * (-(-numel // n)) * 4
        expect(lo <= r["sent"] <= hi, f"rank {rank}: bytes sent for a {r['bytes']}-byte tensor, "
               f"n={n}", f"2(n-1)/n of it, between {lo} and {hi}", r["sent"])


# ---------------------------------------------------------------- 02 grad_buckets


def _mlp(g, dims):
    layers = []
    for a, b in zip(dims, dims[1:]):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) * 0.3)
            lin.bias.copy_(torch.randn(b, generator=g) * 0.1)
        layers += [lin, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _loss(model, seed, *salt):
    g = _gen(seed, "data", *salt)
    x = torch.randn(4, model[0].in_features, generator=g)
    return (model(x) - torch.randn(4, model[-1].out_features, generator=g)).pow(2).mean()


def expected_buckets(sizes: list[int], bucket_bytes: int) -> int:
    count, size = 0, 0
    for b in reversed(sizes):
        if count == 0 or size + b > bucket_bytes:
            count, size = count + 1, 0
        size += b
    return count


def _scenario_grad_buckets(impl, seed):
    topo = _topo("dp")
    n, i = topo.dp.size, topo.dp.index
    g = _gen(seed, "buckets")
    dims = [int(x) for x in torch.randint(3, 12, (4,), generator=g)]
    model = _mlp(_gen(seed, "w"), dims)
    sizes = [p.numel() * 4 for p in model.parameters()]
    bucket_bytes = max(sizes) + int(torch.randint(0, sum(sizes) // 3, (1,), generator=g))

    def steps():
        sync = impl.BucketedGradSync(model, topo.dp, bucket_bytes)
        out = {"err": [], "during": [], "count": [], "want": expected_buckets(sizes, bucket_bytes)}
        for step in range(2):
            ref = copy.deepcopy(model)
            grads = []
            for r in range(n):
                ref.zero_grad()
                _loss(ref, seed, step, r).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            model.zero_grad()
            mark = topo.log.count("dp", "all_reduce")
            _loss(model, seed, step, i).backward()
            out["during"].append(topo.log.count("dp", "all_reduce") - mark)
            sync.finish()
            out["count"].append(topo.log.count("dp", "all_reduce") - mark)
            means = [sum(gs) / n for gs in zip(*grads)]
            out["err"].append(max((p.grad - m).abs().max().item()
                                  for p, m in zip(model.parameters(), means)))
        return out

    return {"steps": _case(steps)}


def buckets_average(ctx):
    for rank, r in enumerate(_read(ctx, "steps")):
        # the mean of per-rank float32 gradients, summed in another order: a few ulp apart
        expect(max(r["err"]) <= 1e-6, f"rank {rank}: gradients after finish() in steps 1 and 2",
               "the mean of every rank's gradient (within 1e-6)", f"max differences {r['err']}")


def buckets_count(ctx):
    for rank, r in enumerate(_read(ctx, "steps")):
        expect(r["count"] == [r["want"]] * 2, f"rank {rank}: all-reduces per step",
               f"{r['want']} (one per bucket, buckets filled in reverse parameter order)", r["count"])


def buckets_overlap(ctx):
    for rank, r in enumerate(_read(ctx, "steps")):
        expect(min(r["during"]) >= r["want"] - 1 and min(r["during"]) > 0,
               f"rank {rank}: all-reduces already started when backward() returned",
               f"every bucket's ({r['want']}) - start each as soon as its last gradient is ready",
               r["during"])


# ---------------------------------------------------------------- 03 zero1


def _scenario_zero1(impl, seed):
    topo = _topo("dp")
    n, i = topo.dp.size, topo.dp.index
    g = _gen(seed, "zero1")
    dims = [int(x) for x in torch.randint(3, 10, (3,), generator=g)]
    kw = dict(lr=1e-2, weight_decay=0.1)

    def steps():
        model = _mlp(_gen(seed, "w"), dims)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
        opt = impl.Zero1AdamW(model.parameters(), topo.dp, **kw)
        out = {"err": [], "gathers": [], "n": sum(p.numel() for p in model.parameters()), "dp": n}
        for step in range(3):
            grads = []
            for r in range(n):
                ref.zero_grad()
                _loss(ref, seed, step, r).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for p, gs in zip(ref.parameters(), zip(*grads)):
                p.grad = sum(gs) / n
            ref_opt.step()
            opt.zero_grad()
            _loss(model, seed, step, i).backward()
            mark = topo.log.count("dp", "all_gather")
            opt.step()
            out["gathers"].append(topo.log.count("dp", "all_gather") - mark)
            out["err"].append(max((p - q).abs().max().item()
                                  for p, q in zip(model.parameters(), ref.parameters())))
        state = opt.optimizer.state.values()
        out["state"] = sum(t.numel() for s in state for t in s.values()
                           if torch.is_tensor(t) and t.dim() > 0)
        return out

    return {"steps": _case(steps)}


def zero1_params(ctx):
    for rank, r in enumerate(_read(ctx, "steps")):
        # AdamW normalises by sqrt(v): grads a few ulp apart move parameters by ~1e-7 * lr-scale
        expect(max(r["err"]) <= 1e-5, f"rank {rank}: parameters after AdamW steps 1-3",
               "those of plain AdamW on the averaged gradient (within 1e-5)", f"max differences {r['err']}")


def zero1_sharded(ctx):
    for rank, r in enumerate(_read(ctx, "steps")):
        cap = 2 * (-(-r["n"] // r["dp"]))
        expect(0 < r["state"] <= cap, f"rank {rank}: optimizer-state floats in self.optimizer "
               f"({r['n']} parameters, dp={r['dp']})", f"at most 2 x ceil(N/dp) = {cap}", r["state"])


def zero1_gathers(ctx):
    for rank, r in enumerate(_read(ctx, "steps")):
        expect(all(k >= 1 for k in r["gathers"]), f"rank {rank}: comm.all_gather calls per step",
               "at least one (to rebuild the full parameters)", r["gathers"])


EXERCISES = [
    Exercise("ring_allreduce", "02 data parallelism", [
        Check("sums", 3, ring_sum, "every rank ends with the sum"),
        Check("averages", 1, ring_avg, "average=True divides by the group size"),
        Check("uneven", 2, ring_uneven, "sizes that do not split evenly"),
        Check("p2p_only", 1, ring_p2p_only, "built from send/recv only"),
        Check("bandwidth", 2, ring_bandwidth, "sends 2(n-1)/n of the tensor"),
    ], scenario=_scenario_ring_allreduce, world=lambda rng: rng.choice([3, 4])),
    Exercise("grad_buckets", "02 data parallelism", [
        Check("averages", 3, buckets_average, "gradients averaged over dp"),
        Check("bucket_count", 2, buckets_count, "one all-reduce per bucket"),
        Check("overlap", 2, buckets_overlap, "communication starts during backward"),
    ], scenario=_scenario_grad_buckets, world=lambda rng: rng.choice([2, 3])),
    Exercise("zero1", "03 ZeRO", [
        Check("params_match", 3, zero1_params, "same parameters as AdamW over 3 steps"),
        Check("state_sharded", 2, zero1_sharded, "optimizer state is 1/dp"),
        Check("all_gather", 1, zero1_gathers, "parameters rebuilt with all-gather"),
    ], scenario=_scenario_zero1, world=lambda rng: rng.choice([2, 3])),
]
