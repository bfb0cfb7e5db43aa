"""`mini3d sample CKPT --prompt TEXT --max-new-tokens N --temperature T --top-k K --seed S`.

A checkpoint holds every tensor at full shape under the reference model's names (mini3d.checkpoint),
whatever layout wrote it, so one process loads it into the plain `mini3d.model.GPT` and generates
with the tokenizer named in its meta. Decoding is the textbook loop (no KV cache: these models are
small and the loop is the clearest statement of what sampling is): crop the context to max_seq_len,
take the last position's logits, divide by the temperature, keep the top k, draw from a generator
seeded with S. `--top-k 1` is greedy decoding (the draw then has one choice).
"""

from __future__ import annotations

import sys

import torch


def register(sub):
    p = sub.add_parser("sample", help="generate text from a checkpoint (any layout)",
                       description=__doc__.splitlines()[0])
    p.add_argument("ckpt", metavar="CKPT", help="a checkpoint directory, or a --save root (latest)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens (0: all; 1: greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.set_defaults(func=cmd_sample)


def load_model(ckpt: str, device: str = "cpu"):
    """(GPT with the checkpoint's weights, its meta)."""
    from .checkpoint import read_meta, read_states
    from .config import model_from_dict
    from .model import GPT

    meta = read_meta(ckpt)
    with torch.device("meta"):
        model = GPT(model_from_dict(meta["model"]), init=False)
    model.load_state_dict(read_states(ckpt)["model"], assign=True)
    return model.to(device).eval(), meta


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             seed: int = 0) -> list[int]:
    """`ids` followed by `max_new_tokens` sampled tokens."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    limit = model.cfg.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(x[:, -limit:])[0, -1].float()  # (V,)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / max(temperature, 1e-8), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=g)
        x = torch.cat([x, nxt[None]], dim=1)
    return x[0].tolist()


def sample_problems(args) -> list[str]:
    out = []
    if args.max_new_tokens < 1:
        out.append(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.temperature <= 0:
        out.append(f"--temperature {args.temperature} must be > 0 (use --top-k 1 for greedy)")
    if args.top_k < 0:
        out.append(f"--top-k {args.top_k} must be >= 0")
    return out


def cmd_sample(args) -> int:
    from .checkpoint import latest_dir
    from .exits import bad_input
    from .tokenizer import TokenizerError, get_tokenizer

    problems = sample_problems(args)
    ckpt = latest_dir(args.ckpt)
    if ckpt is None:
        problems.append(f"CKPT {args.ckpt!r} is not a checkpoint and holds no complete one")
    if problems:
        return bad_input(problems, "sample")
    model, meta = load_model(ckpt, args.device)
    try:
        tok = get_tokenizer(meta.get("tokenizer", "bytes"))
    except TokenizerError as e:
        return bad_input([f"checkpoint {ckpt!r}: {e}"], "sample")
    ids = tok.encode(args.prompt)
    if not ids:
        return bad_input([f"--prompt {args.prompt!r} encodes to no tokens"], "sample")
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    sys.stdout.write(tok.decode(out) + "\n")
    return 0


def sample_during_training(trainer, tok, seed: int, n_tokens: int = 48) -> str:
    """A short sample of the model being trained (pp = 1): the full weights are gathered over tp
    and cp x dp (collective: every rank calls this), the reporting rank (tp, dp and cp rank 0)
    generates, others return ""."""
    from .checkpoint import gather_full_state
    from .model import GPT

    weights, _, _ = gather_full_state(trainer.chunks, trainer.optimizer, trainer.topo)
    if trainer.topo.tp.index or trainer.topo.dp.index or trainer.topo.cp.index:
        return ""
    with torch.device("meta"):
        model = GPT(trainer.cfg, init=False)
    model.load_state_dict(weights, assign=True)
    prompt = tok.encode("\n") or [0]
    return tok.decode(generate(model.eval(), prompt, n_tokens, 1.0, 0, seed)[len(prompt):])
