"""Deferred weight gradients (mini3d.wgrad) and the B / W split built on them, in one process.

Each case runs a middle pipeline stage (input and output are activations) or the last one (with
the loss) over four micro-batches in a zero-bubble-like order (forwards ahead, B and W apart,
W of one micro-batch after the B of the next) and compares the input gradients and every
parameter gradient with an ordinary backward of the same module: the same matmuls, so float32
rounding only (1e-6 absolute on values of order 1)."""

import copy

import pytest
import torch

from mini3d.config import ModelConfig
from mini3d.pp.partition import build_stages
from mini3d.pp.split_backward import backward_input
from mini3d.recompute import apply_recompute
from mini3d.wgrad import WeightGradStore, deferring, linear, weight_grads

CFG = ModelConfig(n_layers=8, d_model=32, n_heads=4, vocab_size=64, max_seq_len=32)  # T = 16 < 32
ORDER = ["F0", "F1", "F2", "B0", "F3", "B1", "W0", "B2", "W1", "B3", "W2", "W3"]


def _data(stage_id):
    g = torch.Generator().manual_seed(stage_id)
    xs = [torch.randn(2, 16, 32, generator=g) for _ in range(4)]
    last = stage_id == 3
    outs = [torch.randint(0, 64, (2, 16), generator=g) if last else
            torch.randn(2, 16, 32, generator=g) for _ in range(4)]
    return xs, outs, last


def _reference(stage, xs, outs, last):
    dxs = []
    for x, o in zip(xs, outs):
        x = x.clone().requires_grad_()
        if last:
            stage(x, o).backward()
        else:
            torch.autograd.backward(stage(x), o)
        dxs.append(x.grad)
    return dxs, {n: q.grad for n, q in stage.named_parameters()}


def _split(stage, xs, outs, last):
    live, pending, dxs = {}, {}, {}
    for a in ORDER:
        i = int(a[1])
        if a[0] == "F":
            store, x = WeightGradStore(), xs[i].clone().requires_grad_()
            with deferring(store):
                live[i] = (stage(x, outs[i]) if last else stage(x), x, store)
        elif a[0] == "B":
            out, x, store = live.pop(i)
            grad = torch.tensor(1.0) if last else outs[i]
            before = [None if q.grad is None else q.grad.clone() for q in stage.parameters()]
            dxs[i], pending[i] = backward_input(out, grad, x, list(stage.parameters()), store)
            # W accumulates into the parameters themselves, not into what autograd saved for
            # the backward (under recomputation, a detached copy from the recomputed forward)
            params = {id(q) for q in stage.parameters()}
            assert store.items and all(id(w) in params for w, *_ in store.items)
            after = [q.grad for q in stage.parameters()]
            assert all((a is None and b is None) or torch.equal(a, b)
                       for a, b in zip(before, after)), "B accumulated into .grad"
        else:
            pending.pop(i).run()
    return [dxs[i] for i in range(4)], {n: q.grad for n, q in stage.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("stage_id", [1, 3])
def test_split_backward_equals_the_ordinary_backward(stage_id, recompute):
    stage = build_stages(CFG, 0, stage_id, 4)[stage_id]
    split = apply_recompute(copy.deepcopy(stage), recompute)
    data = _data(stage_id)
    ref_dx, ref_g = _reference(stage, *data)
    dx, g = _split(split, *data)
    for a, b in zip(dx, ref_dx):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert sorted(g) == sorted(ref_g)
    for n in ref_g:
        assert g[n] is not None, f"{n}: no gradient after W"
        torch.testing.assert_close(g[n], ref_g[n], atol=1e-6, rtol=1e-5, msg=n)


def test_b_defers_only_the_linear_weight_work_and_w_releases_it():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    store = WeightGradStore()
    with deferring(store):
        y = linear(x, lin.weight, lin.bias)
    dy = torch.randn(3, 4)
    with store.collecting():
        (dx,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(dx, dy @ lin.weight)
    assert len(store.items) == 1 and lin.weight.grad is None
    got = dict((id(q), g) for q, g in store.take())
    torch.testing.assert_close(got[id(lin.weight)], dy.t() @ x)
    torch.testing.assert_close(got[id(lin.bias)], dy.sum(0))
    assert store.items == []
    dw, db = weight_grads(x, dy, want_w=False, want_b=True)
    assert dw is None and db is not None


def test_outside_deferring_linear_is_plain_f_linear():
    lin = torch.nn.Linear(8, 4)
    y = linear(torch.randn(3, 8), lin.weight, lin.bias)
    assert type(y.grad_fn).__name__ == "AddmmBackward0"
