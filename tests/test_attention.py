"""attention="sdpa": torch's fused scaled_dot_product_attention in place of the written-out core.

Same numbers as the reference (which writes attention out) up to summation order, a smaller activation
ledger that the estimator predicts, and plans that cannot use it refused with exit 2. The 3D parity of
an sdpa layout is one of tests/test_3d.py's cases."""

import json

import pytest
import torch

from mini3d.cli import main
from mini3d.config import ModelConfig, Plan
from mini3d.cost.activations import layer_activation_bytes
from mini3d.models.attention import attention_core, sdpa_core, set_attention
from mini3d.models.transformer import GPT
from tests.test_recompute import CFG, _run as run_policy


def _run(attention: str, b: int = 4, s: int = 32, steps: int = 3):
    return run_policy("none", b, s, steps, attention=attention)


def test_set_attention_swaps_every_core_and_only_the_core():
    m = set_attention(GPT(CFG), "sdpa")
    assert all(b.attn.core is sdpa_core for b in m.blocks.values())
    assert all(b.attn.core is attention_core for b in set_attention(m, "explicit").blocks.values())


def test_sdpa_equals_the_written_out_core_over_three_adamw_steps():
    """float32: the fused kernel sums in another order (~1e-7 relative). Step-0 gradients within
    1e-5 of each tensor's max (measured 4e-7); later steps start from parameters that Adam's
    sign-like update moved by up to ~1e-3 lr apart, so 3e-4 (as in tests/test_3d.py); losses 1e-5."""
    ref_losses, ref_grads, _ = _run("explicit")
    losses, grads, _ = _run("sdpa")
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        for n in rg:
            err = float((g[n] - rg[n]).abs().max() / rg[n].abs().max())
            assert err < (1e-5 if step == 0 else 3e-4), (step, n, err)
    # and a core that is really different is caught: drop the causal mask
    m = GPT(CFG, seed=1)
    for b in m.blocks.values():
        b.attn.core = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    assert abs(m(x, x.roll(-1, 1)).item() - ref_losses[0]) > 1e-3


@pytest.mark.parametrize("b,s", [(4, 32), (2, 64)])
def test_sdpa_keeps_no_attention_matrix_and_the_estimator_knows(b, s):
    """The ledger of saved tensors: sdpa keeps a log-sum-exp instead of the (s, s) probabilities;
    the estimator's fused-attention formula matches within 2% (it leaves out the LayerNorm
    statistics, as for the written-out core in tests/test_recompute.py)."""
    _, _, explicit = _run("explicit", b, s, steps=1)
    _, _, fused = _run("sdpa", b, s, steps=1)
    got, written_out = fused.layer_bytes(0), explicit.layer_bytes(0)
    plan = Plan(seq_len=s, global_batch=b, attention="sdpa")
    want = layer_activation_bytes(CFG, plan)["stored"]
    assert abs(got - want) / want < 0.02, (got, want)
    # the difference: the a*s^2*b*4-byte probabilities and the (s, s) causal mask, less the fp32
    # log-sum-exp; the kernel's output is the projection's input (a view), not a second tensor
    a = CFG.n_heads
    assert written_out - got == a * s * s * b * 4 + s * s - 4 * a * s * b
    assert want == layer_activation_bytes(CFG, Plan(seq_len=s, global_batch=b), fused_attention=True)["stored"]


def test_plans_that_cannot_use_sdpa_are_named():
    cfg = ModelConfig()
    assert Plan(attention="sdpa").problems(cfg) == []
    assert Plan(attention="sdpa", recompute="full").problems(cfg) == []
    (p,) = Plan(attention="sdpa", recompute="selective").problems(cfg)
    assert "recompute='selective'" in p and "--recompute none or full" in p
    (p,) = Plan(attention="flash3").problems(cfg)
    assert "attention='flash3' is unknown (choose explicit, sdpa)" in p


def test_cli_refuses_sdpa_with_selective_before_any_process(capsys, monkeypatch):
    import mini3d.launch.launcher as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    assert main(["train", "--attention", "sdpa", "--recompute", "selective"]) == 2
    assert "attention='sdpa'" in capsys.readouterr().err


def test_estimate_and_plan_take_attention(capsys):
    """`mini3d estimate --attention sdpa` drops the s x s term of every layer; `mini3d plan` with
    sdpa never proposes selective recompute (it would save nothing)."""
    base = ["estimate", "--model", "gpt2-small", "--seq-len", "1024", "--micro-batches", "8",
            "--global-batch", "8", "--dtype", "bf16", "--json"]
    assert main(base) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert main(base + ["--attention", "sdpa"]) == 0
    fused = json.loads(capsys.readouterr().out)
    assert fused["plan"]["attention"] == "sdpa" and explicit["plan"]["attention"] == "explicit"
    saved = explicit["memory_per_rank_bytes"]["activations"] - fused["memory_per_rank_bytes"]["activations"]
    L, a, s, b = 12, 12, 1024, 1  # one micro-batch in flight; bf16 probabilities vs fp32 log-sum-exp
    assert saved == pytest.approx(L * (a * s * s * b * 2 - 4 * a * s * b), abs=16)
    assert main(["plan", "--model", "gpt2-small", "--gpus", "8", "--global-batch", "64",
                 "--dtype", "bf16", "--attention", "sdpa", "--top", "50", "--json"]) == 0
    plans = capsys.readouterr().out
    assert '"attention": "sdpa"' in plans and '"recompute": "selective"' not in plans
    assert '"recompute": "none"' in plans
