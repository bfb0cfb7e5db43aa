"""Data parallelism at dp=1 (in-process, no communication) and the ledger on a plain module."""

import contextlib

import pytest
import torch

from mini3d.comm_log import CommLog
from mini3d.config import Plan
from mini3d.dp import make_dp, model_state_ledger
from mini3d.grid import Axis
from mini3d.models.transformer import GPT
from tests import dp_workers as W


def _train(stage):
    axis = Axis("dp", (0,), 0, None, CommLog(0))
    plan = Plan(dp=1, zero=stage, global_batch=W.GLOBAL_BATCH, seq_len=W.SEQ, bucket_mb=W.BUCKET_MB)
    net, opt = make_dp(GPT(W.CFG, W.SEED), axis, plan, W.optimizer)
    data, losses = W.batches(), []
    for step, m in enumerate(W.MICRO):
        total = 0.0
        for i, (x, y) in enumerate(data.micro_batches(step, 0, 1, m)):
            with net.no_sync() if i < m - 1 else contextlib.nullcontext():
                loss = net(x, y) / m
                loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, net.full_params(), axis.log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp1_matches_reference_without_communication(stage):
    ref_loss, _, ref_params = W.reference()
    losses, params, log = _train(stage)
    # one process, same batch; only micro-batch splitting changes the summation order -> 1e-5
    assert losses == pytest.approx(ref_loss, abs=1e-5)
    for k, p in ref_params.items():  # 1e-4 = 1% of one AdamW step of lr=1e-2 (see test_dp.py)
        torch.testing.assert_close(params[k], p, rtol=0, atol=1e-4, msg=k)
    assert len(log.events) == 0 and sum(log.wire_bytes_by_axis.values()) == 0


def test_ledger_of_plain_module_with_adamw_is_16_bytes_per_param():
    model = GPT(W.CFG, W.SEED)
    opt = torch.optim.AdamW(model.parameters())
    x, y = W.batches().global_batch_at(0)
    model(x, y).backward()
    opt.step()
    led = model_state_ledger(model, opt)
    psi = sum(p.numel() for p in model.parameters())
    assert led["parameters"] == 4 * psi and led["gradients"] == 4 * psi
    assert led["master_weights"] == 0  # the optimizer's params are the model's: counted once
    assert led["optimizer_states"] == 8 * psi
    assert led["optimizer_scalars"] == 4 * len(list(model.parameters()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_pipeline_middle_stage_is_wrapped_like_any_module(stage):
    """A stage that maps hidden states to hidden states: only its own parameters are handled."""
    axis = Axis("dp", (0,), 0, None, CommLog(0))
    ref = GPT(W.CFG, W.SEED, layers=[1], first=False, last=False)
    net, opt = make_dp(GPT(W.CFG, W.SEED, layers=[1], first=False, last=False), axis,
                       Plan(zero=stage, bucket_mb=W.BUCKET_MB), W.optimizer)
    h = torch.randn(2, W.SEQ, W.CFG.d_model, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(2, W.SEQ, W.CFG.d_model, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(net(h), ref(h), rtol=0, atol=0)  # same weights, same ops
    net(h).backward(dy)
    ref(h).backward(dy)
    net.finish_grad_sync()
    grads = net.full_grads()
    for n, p in ref.named_parameters():  # dp=1: the "average" is the gradient itself, bit-equal
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=0, msg=n)
