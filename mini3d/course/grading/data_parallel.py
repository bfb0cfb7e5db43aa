"""Data-parallel exercises (chapters 02-03): ring_allreduce, grad_buckets and zero1.

Each scenario runs in every rank (see `scenario.py`) and returns plain numbers: errors against the
single-process reference and what the communication log recorded. The checks below judge those
numbers in the parent process.
"""

from __future__ import annotations

import copy

import torch

from mini3d.cost.comm_time import zero_traffic_psi

from mini3d.course.grading.core import Check, CheckFailed, Exercise, expect
from mini3d.course.grading.scenario import _case, _gen, _read, _topo


# ---------------------------------------------------------------- 02 ring_allreduce


# Sizes that do not split evenly, always graded: n + 1 and n - 1 elements are cut by torch.chunk into
# fewer than n pieces (chunks of ceil(size / n) elements), the classic wrong answer; n - 1 also
# leaves one chunk empty. A random uneven size is graded next to them.
UNEVEN_CASES = ("uneven", "uneven_small", "uneven_empty")


def _chunk_errors(x, want, n):
    """[(chunk, first element, end, max error)] of the chunks (cut as torch.tensor_split cuts a
    flat tensor into n) where `x` differs from `want` by more than 1e-5."""
    out, start = [], 0
    for k, (a, b) in enumerate(zip(x.view(-1).tensor_split(n), want.view(-1).tensor_split(n))):
        err = (a - b).abs().max().item() if a.numel() else 0.0
        if err > 1e-5:
            out.append((k, start, start + a.numel(), err))
        start += a.numel()
    return out


def _scenario_ring_allreduce(impl, seed, uneven_only=False):
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
                "numel": x.numel(), "n": n, "bad_chunks": _chunk_errors(x, want, n)[:3]}

    if not uneven_only:
        return {"sum": _case(one, shape, False, "sum"), "avg": _case(one, shape, True, "avg")}
    sizes = {"uneven": uneven, "uneven_small": n + 1, "uneven_empty": n - 1}
    return {case: _case(one, (size,), False, case) for case, size in sizes.items()}


def _scenario_ring_uneven(impl, seed):
    """The uneven sizes, launched on their own: a receive buffer whose size differs from the message
    sent aborts a gloo process, and that must cost only the uneven checks."""
    return _scenario_ring_allreduce(impl, seed, uneven_only=True)


_scenario_ring_uneven.cases = UNEVEN_CASES
_scenario_ring_uneven.crash_hint = (
    " while reducing a size that is not a multiple of the ranks (gloo aborts a process whose receive "
    "buffer differs in size from the message sent): cut exactly axis.size chunks, the same on every "
    "rank, some shorter or empty (tensor_split does; torch.chunk can return fewer)")


def _ring_case(ctx, case, what, expected):
    """Fail naming the first rank and chunk whose result is wrong."""
    for rank, r in enumerate(_read(ctx, case)):
        if r["err"] > 1e-5:
            chunks = "; ".join(f"chunk {k} (elements {a}..{b - 1}) off by {e:.3g}" for k, a, b, e in r["bad_chunks"])
            raise CheckFailed(f"{what} ({r['numel']} elements over {r['n']} ranks): rank {rank} is wrong in "
                              f"{chunks} (chunks as tensor_split cuts them): expected {expected} (within 1e-5), "
                              f"got max difference {r['err']:.3g}")


# float32 sums of <= 4 standard normals in another order differ by a few ulp (~1e-6)
def ring_sum(ctx):
    _ring_case(ctx, "sum", "ring all-reduce sum", "the sum over ranks")


def ring_avg(ctx):
    _ring_case(ctx, "avg", "ring all-reduce with average=True", "the mean over ranks (the sum divided by axis.size)")


def ring_uneven(ctx):
    for case in UNEVEN_CASES:
        _ring_case(ctx, case, "ring all-reduce of a size that is not a multiple of the ranks",
                   "the sum over ranks")


def _ran(ctx, cases):
    """(case, rank, record) of the cases whose run did not crash (a crash is the uneven check's)."""
    for case in cases:
        if all(r[case].get("error", ("",))[0] != "crash" for r in ctx.results):
            yield from ((case, rank, r) for rank, r in enumerate(_read(ctx, case)))


def ring_p2p_only(ctx):
    for case, rank, r in _ran(ctx, ("sum", "avg") + UNEVEN_CASES):
        expect(set(r["ops"]) <= {"send", "recv"} and "send" in r["ops"],
               f"rank {rank} communication ({case})", "only comm.send / comm.recv", r["ops"])


def ring_bandwidth(ctx):
    for case, rank, r in _ran(ctx, ("sum",) + UNEVEN_CASES):
        n, numel = r["n"], r["numel"]
        lo, hi = 2 * (n - 1) * (numel // n) * 4, 2 * (n - 1) * (-(-numel // n)) * 4
        expect(lo <= r["sent"] <= hi, f"rank {rank}: bytes sent for a {r['bytes']}-byte tensor, "
               f"n={n} ({case})", f"2(n-1)/n of it, between {lo} and {hi}", r["sent"])


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
    # eps comparable to the gradients: AdamW's update g / (sqrt(v) + eps) is then not invariant to
    # the gradient's scale, so a sum where the average belongs (not dividing by dp) shows
    kw = dict(lr=1e-2, weight_decay=0.1, eps=1e-2)

    def steps():
        model = _mlp(_gen(seed, "w"), dims)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
        opt = impl.Zero1AdamW(model.parameters(), topo.dp, **kw)
        out = {"err": [], "gathers": [], "ops": [], "wire": [], "dp": n,
               "n": sum(p.numel() for p in model.parameters())}
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
            mark = len(topo.log.events)
            opt.step()
            evs = [e for e in list(topo.log.events)[mark:] if e.axis == "dp"]
            out["gathers"].append(sum(e.op == "all_gather" for e in evs))
            out["ops"].append(sorted({e.op for e in evs}))
            out["wire"].append(sum(e.wire_bytes for e in evs))
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


def zero1_traffic(ctx):
    """ZeRO-1 sends as plain dp does, zero_traffic_psi(1, 1) = 2 psi (all-reduce + all-gather: 3)."""
    want = zero_traffic_psi(1, 1)  # psi per step(): one micro-batch
    for rank, r in enumerate(_read(ctx, "steps")):
        n = r["dp"]
        psi = 4 * n * (-(-r["n"] // n)) * (n - 1) // n  # one ring pass over the padded flat fp32 vector
        expect(all(k >= 1 for k in r["gathers"]), f"rank {rank}: comm.all_gather calls per step",
               "at least one (to rebuild the full parameters)", r["gathers"])
        expect(all(w <= want * psi for w in r["wire"]) and all("all_reduce" not in ops for ops in r["ops"]),
               f"rank {rank}: dp traffic per step() ({r['n']} parameters, dp={n}; psi = {psi} bytes "
               f"on the wire)", f"{want} psi = {want * psi} bytes: comm.reduce_scatter the gradient (each rank "
               f"needs only its own slice's average), comm.all_gather the parameters",
               f"{r['wire']} bytes, {[round(w / psi, 2) for w in r['wire']]} psi, ops {r['ops'][0]}")


EXERCISES = [
    Exercise("ring_allreduce", "02 data parallelism", [
        Check("sums", 3, ring_sum, "every rank ends with the sum"),
        Check("averages", 1, ring_avg, "average=True divides by the group size"),
        Check("uneven", 2, ring_uneven, "sizes that do not split evenly"),
        Check("p2p_only", 1, ring_p2p_only, "built from send/recv only"),
        Check("bandwidth", 2, ring_bandwidth, "sends 2(n-1)/n of the tensor"),
    ], scenario=(_scenario_ring_allreduce, _scenario_ring_uneven), world=lambda rng: rng.choice([3, 4])),
    Exercise("grad_buckets", "02 data parallelism", [
        Check("averages", 3, buckets_average, "gradients averaged over dp"),
        Check("bucket_count", 2, buckets_count, "one all-reduce per bucket"),
        Check("overlap", 2, buckets_overlap, "communication starts during backward"),
    ], scenario=_scenario_grad_buckets, world=lambda rng: rng.choice([2, 3])),
    Exercise("zero1", "03 ZeRO", [
        Check("params_match", 3, zero1_params, "same parameters as AdamW over 3 steps"),
        Check("state_sharded", 2, zero1_sharded, "optimizer state is 1/dp"),
        Check("all_gather", 1, zero1_traffic, "reduce-scatter + all-gather: 2 psi, not 3"),
    ], scenario=_scenario_zero1, world=lambda rng: rng.choice([2, 3])),
]
