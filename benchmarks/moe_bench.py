"""One process: a training step (forward + backward) of a small MoE model, mini3d's `MoE` layers
(sorted dispatch, grouped GEMM where torch has it) against the same model whose MoE layers run as a
plain PyTorch loop over experts (for each expert: find its tokens, run its SwiGLU, scale, add back;
transformers' Mixtral loop), on the same weights.

    python -m benchmarks.moe_bench [--quick]

Each round times both models back to back on the same batch; the two must give the same loss and
gradients (float32, 1e-5). The ratio is mini3d / plain loop per round (< 1: mini3d faster); the
note says whether the grouped kernel ran (`torch._grouped_mm`) or the loop fallback.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from mini3d.models import balance, moe
from mini3d.models.config import ModelConfig
from mini3d.models.transformer import GPT

from .common import ratio_row

CFG = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, max_seq_len=64, d_ff=128,
                  family="llama", n_experts=8, top_k=2, router="softmax-norm", aux_loss_coef=0.01,
                  name="tiny-moe (8 experts, top-2)")


def plain_moe_forward(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """The reference loop: softmax, top-k renormalised, then one masked pass per expert."""
    B, T, d = x.shape
    flat = x.reshape(-1, d)
    logits = layer.router(flat)
    probs = torch.softmax(logits.float(), -1)
    w, idx = torch.topk(probs, layer.cfg.top_k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(flat)
    e = layer.experts
    for i in range(layer.cfg.n_experts):
        tok, slot = torch.where(idx == i)
        if len(tok) == 0:
            continue
        h = F.silu(flat[tok] @ e.w_gate[i].T) * (flat[tok] @ e.w_up[i].T)
        out = out.index_add(0, tok, (h @ e.w_down[i].T) * w[tok, slot, None])
    layer.stats = {"logits": logits, "probs_sum": probs.sum(0), "tokens": flat.shape[0],
                   "selected": torch.bincount(idx.reshape(-1), minlength=layer.cfg.n_experts),
                   "counts": torch.bincount(idx.reshape(-1), minlength=layer.cfg.n_experts),
                   "dropped": 0}
    return out.view(B, T, d)


def _plain_model(seed: int) -> GPT:
    model = GPT(CFG, seed=seed)
    for layer in balance.moe_layers(model):
        layer.forward = (lambda m: lambda x: plain_moe_forward(m, x))(layer)
    return model


def _step(model, x, y) -> tuple[float, float, list]:
    t0 = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    dt = time.perf_counter() - t0
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return dt, float(loss.detach()), grads


def run(quick: bool = False) -> list[dict]:
    torch.set_num_threads(1)
    rounds = 5 if quick else 15
    ours, plain = GPT(CFG, seed=0), _plain_model(seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (8, CFG.max_seq_len), generator=g)
    y = torch.roll(x, -1, 1)
    _step(ours, x, y), _step(plain, x, y)  # warm-up
    t_ours, t_plain, same = [], [], True
    for _ in range(rounds):
        a, la, ga = _step(ours, x, y)
        b, lb, gb = _step(plain, x, y)
        t_ours.append(a)
        t_plain.append(b)
        same &= abs(la - lb) <= 1e-5 * abs(lb) and all(
            torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(ga, gb))
    grouped = moe.grouped_mm_supported(x.float(), ours.blocks["0"].mlp.experts.w_up)
    note = (f"{x.numel()} tokens, d=64, expert width 128; experts by "
            f"{'torch._grouped_mm' if grouped else 'the loop fallback'}; {rounds} rounds taking "
            f"turns in one process; " + ("same loss and gradients" if same else "RESULTS DIFFER"))
    return [ratio_row(f"one-process MoE step ({CFG.name}) vs a plain PyTorch expert loop",
                      t_ours, t_plain, goal=1.05, note=note)]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
