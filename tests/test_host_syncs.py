"""A step makes at most one host sync (issue #34): on CUDA the host queues the step's work and waits
once, reading the loss, the gradient norm and the stop flag together (`mini3d.run.train.read_back`).

On CPU nothing waits, so the test counts what would: every scalar read, `.tolist()` and
data-dependent op the step's code makes (`mini3d.run.syncs`: a TorchDispatchMode over the real
`train_worker`), per optimizer step. Dense layouts of two ranks, each with the stop agreement of
`mini3d train` and gradient clipping (the paths that used to read the loss, the dp mean, the norm
and the stop flag one by one: three or four syncs a step). MoE layers are left out: the dispatch's split
sizes are the host's to know (the all-to-all's and the grouped GEMM's arguments), one read per MoE
layer, as in Megatron-Core's dropless dispatch.
"""

from __future__ import annotations

import pytest

from mini3d.config import ModelConfig, Plan
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec

CFG = ModelConfig(4, 32, 4, 256, 16, name="sync4")  # the byte tokenizer needs 256 rows
PLAN = Plan(global_batch=4, seq_len=8, micro_batches=2)
LAYOUTS = {
    "pp2-zb-h1": PLAN.replace(pp=2, schedule="zb-h1"),  # split backwards: the loss gradient
    "pp2-interleaved": PLAN.replace(pp=2, schedule="interleaved", virtual_stages=2),
    "dp2-zero1": PLAN.replace(dp=2, zero=1),
    "dp2-zero3": PLAN.replace(dp=2, zero=3),
    "tp2-sp": PLAN.replace(tp=2, sequence_parallel=True),
    "cp2": PLAN.replace(cp=2),
}
STEPS = 4


@pytest.mark.timeout(400)
def test_a_step_reads_the_device_once():
    from mini3d.run.syncs import count_syncs

    specs = [make_spec(CFG, plan, steps=STEPS, grad_clip=1.0).replace(stop_on_signal=True)
             for plan in LAYOUTS.values()]
    per_rank = launch(count_syncs, 2, specs, device="cpu", timeout=360)
    for rank, runs in enumerate(per_rank):
        for name, steps in zip(LAYOUTS, runs):
            assert len(steps) == STEPS, name  # the last one runs on to the loop's end
            # step 1 also makes AdamW's state (its step counters); 2 and 3 are the steady state
            for i, s in enumerate(steps[1:STEPS - 1], start=2):
                assert s["syncs"] <= 1, (name, rank, f"step {i}", s["where"])
                assert s["constants"] == 0, (name, rank, f"step {i}: a host-to-device constant")
                assert all(w.startswith("run/train.py:") for w in s["where"]), (name, s["where"])


def test_the_vocab_parallel_loss_makes_one_float32_copy_of_the_logits():
    """Forward of the loss over bf16 and float32 logits (with padded columns): one new
    logits-sized buffer (the float32 copy that becomes the softmax in place), not one per step of
    the formula; the loss still equals F.cross_entropy's."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from mini3d.comm_log import CommLog
    from mini3d.grid import Axis
    from mini3d.tp.cross_entropy import vocab_parallel_cross_entropy

    class Buffers(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.made = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fresh = isinstance(out, torch.Tensor) and not any(  # not a view or an in-place result
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr()
                == out.untyped_storage().data_ptr() for a in args)
            if fresh and out.numel() == self.numel:
                self.made.append(str(func))
            return out

    ax = Axis("tp", (0,), 0, None, CommLog(0), torch.device("cpu"))
    g = torch.Generator(device="cpu").manual_seed(0)
    y = torch.randint(0, 6, (2, 3), generator=g, device="cpu")
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.randn(2, 3, 8, generator=g, device="cpu").to(dtype).requires_grad_()
        with Buffers(z.numel()) as mode:
            loss = vocab_parallel_cross_entropy(z, y, ax, vocab_start=0, vocab_size=6)
        assert len(mode.made) == 1, (dtype, mode.made)
        ref = torch.nn.functional.cross_entropy(z.detach().float()[..., :6].reshape(-1, 6), y.reshape(-1))
        assert float(loss.detach()) == pytest.approx(float(ref), abs=1e-6)
