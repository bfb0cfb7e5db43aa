"""`mini3d sample CKPT --prompt TEXT --max-new-tokens N --temperature T --top-k K --seed S`.

A checkpoint holds every tensor at full shape under the reference model's names (mini3d.checkpoint.store),
whatever layout wrote it, so one process loads it into the plain `mini3d.models.transformer.GPT` and generates
with the tokenizer named in its meta. Decoding is the textbook loop: the last position's logits of
the context cropped to max_seq_len, divided by the temperature, the top k kept, a draw from a
generator seeded with S. The logits come from a key/value cache (mini3d.models.kv_cache: the prompt once,
then one position per token; past the window the last window afresh), or with `--no-kv-cache` from
the whole window every token (the same tokens, slower: for comparison). `--top-k 1` is greedy
decoding (the draw then has one choice). The checkpoint is the model (every field from its
meta.json; a tied head is the embedding it stores once), and the logits of ids past the tokenizer's
vocabulary (a model whose table is wider, e.g. an imported one) are masked: sampling never emits an
id the tokenizer cannot decode.
"""

from __future__ import annotations

import contextlib
import os
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
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="recompute the whole window for every token (the same tokens, slower)")
    p.add_argument("--kv-slide", action="store_true",
                   help="llama family: past max_seq_len keep sliding the cache (sliding-window "
                        "attention, one position per token) instead of recomputing the window")
    p.set_defaults(func=cmd_sample)


def model_from_weights(cfg, weights: dict):
    """The whole `GPT` of `cfg` holding `weights` (full tensors keyed by reference name, as a
    checkpoint stores them: a tied head has no tensor of its own, it is the token embedding)."""
    from mini3d.models.transformer import GPT, canonical_name, tie_weights

    with torch.device("meta"):
        model = GPT(cfg, init=False)
    model.load_state_dict({n: weights[canonical_name(n, cfg)] for n in model.state_dict()},
                          assign=True)
    return tie_weights(model)  # (assigning gave the head a Parameter of its own: one again)


def load_model(ckpt: str, device: str = "cpu"):
    """(GPT with the checkpoint's weights, its meta): the model is the checkpoint's, every field."""
    from mini3d.checkpoint.store import read_meta, read_states
    from mini3d.config import model_from_dict

    meta = read_meta(ckpt)
    model = model_from_weights(model_from_dict(meta["model"]), read_states(ckpt)["model"])
    return model.to(device).eval(), meta


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             seed: int = 0, n_vocab: int | None = None, kv_cache: bool = True,
             slide: bool = False, on_logits=None) -> list[int]:
    """`ids` followed by `max_new_tokens` sampled tokens, each below `n_vocab` (the tokenizer's
    vocabulary: the logits of a model's wider table, e.g. an import padded to a round size, are
    masked, so no id comes out that the tokenizer cannot decode). `kv_cache=False` recomputes the
    window for every token; `slide` makes the cache slide past the window (rotary only, see
    mini3d.models.kv_cache); `on_logits(step, logits)` sees each step's raw logits (V,) (tests)."""
    from mini3d.models.kv_cache import KVDecoder

    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    limit = model.cfg.max_seq_len
    decoder = KVDecoder(model, slide) if kv_cache else None
    with decoder or contextlib.nullcontext():
        for step in range(max_new_tokens):
            logits = decoder(x)[0] if decoder else model(x[:, -limit:])[0, -1].float()  # (V,)
            if on_logits is not None:
                on_logits(step, logits.clone())
            x = torch.cat([x, _draw(logits, temperature, top_k, n_vocab, g)[None]], dim=1)
    return x[0].tolist()


MAX_NEW_TOKENS = 100_000  # past this a run is hours on a CPU even with the KV cache: a typo


def _draw(logits, temperature: float, top_k: int, n_vocab, g) -> torch.Tensor:
    """One token id (1,) drawn from logits (V,) (modified in place by the vocabulary mask)."""
    if n_vocab is not None and n_vocab < logits.numel():
        logits[n_vocab:] = float("-inf")  # ids the tokenizer has no text for
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / max(temperature, 1e-8), dim=-1)
    return torch.multinomial(probs, 1, generator=g)


def sample_problems(args) -> list[str]:
    import math

    from mini3d.launch.devices import LaunchError, choose_device

    out = []
    if args.max_new_tokens < 1:
        out.append(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    elif args.max_new_tokens > MAX_NEW_TOKENS:
        out.append(f"--max-new-tokens {args.max_new_tokens} exceeds the bound of {MAX_NEW_TOKENS:,} "
                   f"(one forward pass per token)")
    if not math.isfinite(args.temperature):
        out.append(f"--temperature {args.temperature} must be a finite number")
    elif args.temperature <= 0:
        out.append(f"--temperature {args.temperature} must be > 0 (use --top-k 1 for greedy)")
    if args.top_k < 0:
        out.append(f"--top-k {args.top_k} must be >= 0")
    try:
        if args.device == "auto":
            raise LaunchError("device='auto' is not a sample device (choose cpu or cuda)")
        choose_device(args.device, 1)
    except LaunchError as e:
        out.append(str(e))
    if args.kv_slide and not args.kv_cache:
        out.append("--kv-slide slides the KV cache, which --no-kv-cache turns off")
    return out


def cmd_sample(args) -> int:
    from mini3d.checkpoint.store import latest_dir
    from mini3d.exits import bad_input
    from mini3d.data.tokenizer import TokenizerError, get_tokenizer

    problems = sample_problems(args)
    ckpt = latest_dir(args.ckpt)
    if ckpt is None and os.path.isfile(args.ckpt):
        problems.append(f"CKPT {args.ckpt!r} is a file, not a checkpoint directory")
    elif ckpt is None:
        problems.append(f"CKPT {args.ckpt!r} is not a checkpoint and holds no complete one")
    if problems:
        return bad_input(problems, "sample")
    model, meta = load_model(ckpt, args.device)
    try:
        tok = get_tokenizer(meta.get("tokenizer", "bytes"))
    except TokenizerError as e:
        return bad_input([f"checkpoint {ckpt!r}: {e}"], "sample")
    if args.kv_slide and not model.cfg.llama_like:
        return bad_input([f"--kv-slide needs rotary positions (the llama family); checkpoint "
                          f"{ckpt!r} is {model.cfg.family} (learned positions end at max_seq_len)"],
                         "sample")
    ids = tok.encode(args.prompt)
    if not ids:
        return bad_input([f"--prompt {args.prompt!r} encodes to no tokens"], "sample")
    if max(ids) >= model.cfg.vocab_size:
        return bad_input([f"--prompt {args.prompt!r} encodes to id {max(ids)}, past the model's "
                          f"vocabulary of {model.cfg.vocab_size} (tokenizer {tok.name!r})"], "sample")
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                   n_vocab=tok.vocab_size, kv_cache=args.kv_cache, slide=args.kv_slide)
    sys.stdout.write(tok.decode(out) + "\n")
    return 0


def sample_during_training(trainer, tok, seed: int, n_tokens: int = 48) -> str:
    """A short sample of the model being trained (pp = 1): the full weights, and only they (no
    AdamW moments), are gathered over tp, ep and cp x dp (collective: every rank calls this); the
    reporting rank (tp, dp and cp rank 0) keeps the host copy and generates, the others take part
    in each gather, drop its result and return ""."""
    from mini3d.checkpoint.state import gather_full_state

    topo = trainer.topo
    reporter = not (topo.tp.index or topo.dp.index or topo.cp.index)
    weights, _, _ = gather_full_state(trainer.chunks, trainer.optimizer, topo, keep=reporter,
                                      with_moments=False)
    if not reporter:
        return ""
    model = model_from_weights(trainer.cfg, weights).eval()
    prompt = tok.encode("\n") or [0]
    return tok.decode(generate(model, prompt, n_tokens, 1.0, 0, seed, tok.vocab_size)[len(prompt):])
