"""A plain single-device PyTorch training loop: the baseline `gpu_check.py` compares mini3d with.

Same GPT (`mini3d.models.transformer.GPT`, same seed, so the same weights), the same batches (`mini3d.data.corpus`'s
embedded corpus, the same global batch and sequence length), AdamW with mini3d's betas (fused on
CUDA, as mini3d's), and nothing else: no process group, no DP/ZeRO wrapper, no hooks. Recipes:

- `bf16`: parameters, gradients and AdamW state in bf16, no fp32 master copy: the least work a
  step can do (mini3d's bf16 keeps an fp32 master and fp32 moments), so the strictest baseline;
- `amp`: fp32 parameters, gradients and AdamW state, matmuls in bf16 under `torch.autocast`: the
  usual single-GPU mixed-precision loop, with the same fp32 master precision as mini3d's bf16;
- `float32`: everything in float32.

Each step is timed to the end of the optimizer step: on CUDA a device synchronize closes the timing
(this is a benchmark script, outside mini3d).

    python -m benchmarks.plain_loop --device cpu --tiny
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mini3d.config import ModelConfig, model_from_preset
from mini3d.data.corpus import Batches, load_tokens
from mini3d.models.attention import set_attention
from mini3d.models.transformer import GPT

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "amp": torch.float32}  # parameter dtype


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step_times(cfg: ModelConfig, global_batch: int, seq_len: int, steps: int,
                     device: str = "cpu", dtype: str = "bf16", lr: float = 3e-3,
                     seed: int = 0, attention: str = "explicit", compile_blocks: bool = False) -> dict:
    """Seconds per training step of the plain loop (all `steps`, first ones included) and losses.
    `compile_blocks`: torch.compile each block's forward, as torchtitan does (the first steps then
    include the compilation)."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    model = set_attention(GPT(cfg, seed), attention).to(device=dev, dtype=DTYPES[dtype])
    for block in model.blocks.values() if compile_blocks else ():
        block.forward = torch.compile(block.forward)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=dev.type == "cuda" or None)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "amp")
    batches = Batches(load_tokens(None), seq_len, global_batch, seed)
    times, losses = [], []
    for step in range(steps):
        x, y = batches.global_batch_at(step)
        x, y = x.to(dev), y.to(dev)
        _sync(dev)
        t0 = time.perf_counter()
        with autocast:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
    return {"times": times, "losses": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--tiny", action="store_true", help="the tiny preset, 4 x 64 tokens")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention", default="explicit", choices=["explicit", "sdpa"])
    args = ap.parse_args(argv)
    cfg = model_from_preset("tiny" if args.tiny else "gpt2-small")
    b, t = (4, 64) if args.tiny else (8, 1024)
    out = plain_step_times(cfg, b, t, args.steps, args.device, args.dtype, attention=args.attention)
    print(f"plain loop: median step {statistics.median(out['times'][1:] or out['times']) * 1e3:.1f} ms, "
          f"loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
