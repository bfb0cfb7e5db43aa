"""Tokenizers: bytes (the default), OpenAI's gpt2 BPE (tiktoken), any Hugging Face tokenizer.json.

`get_tokenizer(name)` understands

    bytes              lossless byte-level tokens, vocabulary 256; needs nothing (the course uses it)
    gpt2               OpenAI's GPT-2 BPE through `tiktoken`, which downloads its vocabulary once and
                       caches it under $TIKTOKEN_CACHE_DIR; offline, point that variable at a
                       directory holding a cached copy, or pass the path of a `.tiktoken` file
    PATH.tiktoken      a BPE rank file in tiktoken's format (base64 token, rank per line), split
                       with GPT-2's pre-tokenising pattern: a local gpt2-style vocabulary
    PATH (tokenizer.json, or a directory holding one)
                       any Hugging Face tokenizer through the `tokenizers` library, e.g. the one
                       `mini3d prepare --train-tokenizer VOCAB` trains (`train_bpe` below)

Each tokenizer has `name` (what a checkpoint stores to find it again: "bytes", "gpt2" or an
absolute path), `vocab_size`, `encode(str) -> list[int]` and `decode(ids) -> str`. tiktoken and
tokenizers are optional (`pip install mini3d[text]`); a missing one is a `TokenizerError` (exit 2)
naming the extra. We write no tokenizer code by hand beyond the byte one: BPE training, merging and
byte-level decoding are the libraries'.
"""

from __future__ import annotations

import os

EXTRA = "pip install 'mini3d[text]'  (tiktoken, tokenizers)"
# GPT-2's pre-tokenising pattern (tiktoken's r50k_base); local .tiktoken files use it too.
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message names it and what would work (exit 2)."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless for any text."""

    name, vocab_size = "bytes", 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A tiktoken `Encoding` (gpt2, or a local rank file); special tokens are never parsed from text."""

    def __init__(self, name: str, encoding):
        self.name, self.enc, self.vocab_size = name, encoding, encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` loaded from a tokenizer.json file."""

    def __init__(self, path: str, tok):
        self.name, self.tok, self.vocab_size = path, tok, tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _import(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TokenizerError(f"--tokenizer {what} needs the `{module}` package, which is not "
                             f"installed ({EXTRA})") from None


def get_tokenizer(name: str | None):
    """The tokenizer `name` stands for (see the module docstring); raises TokenizerError."""
    if name in (None, "bytes"):
        return ByteTokenizer()
    if name == "gpt2":
        return _gpt2()
    path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer {name!r} is not bytes, gpt2, a .tiktoken file or a "
                             f"Hugging Face tokenizer.json (no such file)")
    path = os.path.abspath(path)
    if path.endswith(".tiktoken"):
        tiktoken = _import("tiktoken", name)
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(path)
        enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=GPT2_PATTERN,
                                mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)})
        return TiktokenTokenizer(path, enc)
    _import("tokenizers", name)
    from tokenizers import Tokenizer

    try:
        return HFTokenizer(path, Tokenizer.from_file(path))
    except Exception as e:  # the library's parse error says what is wrong with the file
        raise TokenizerError(f"--tokenizer {name!r} is not a readable tokenizer.json ({e})") from None


def _gpt2():
    tiktoken = _import("tiktoken", "gpt2")
    try:
        return TiktokenTokenizer("gpt2", tiktoken.get_encoding("gpt2"))
    except Exception as e:  # offline: requests' ConnectionError, or a blocked download
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "<tmp>/data-gym-cache")
        raise TokenizerError(
            f"--tokenizer gpt2: tiktoken could not load the GPT-2 vocabulary ({type(e).__name__}: "
            f"{str(e)[:120]}); it is fetched once and cached under $TIKTOKEN_CACHE_DIR (now "
            f"{cache}): copy a cached data-gym-cache directory from a machine that has one and set "
            f"TIKTOKEN_CACHE_DIR to it, or pass the path of a gpt2 .tiktoken rank file, or use "
            f"`mini3d prepare --train-tokenizer VOCAB` (no network needed)") from None


def train_bpe(texts, vocab_size: int, out_path: str):
    """Train a byte-level BPE of `vocab_size` tokens on an iterator of strings with the
    `tokenizers` library; write its tokenizer.json to `out_path`; return it as an HFTokenizer."""
    _import("tokenizers", f"(--train-tokenizer {vocab_size})")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tmp = out_path + ".part"
    tok.save(tmp)
    os.replace(tmp, out_path)
    return HFTokenizer(os.path.abspath(out_path), tok)


def vocab_problems(model_vocab: int, tokenizer) -> list[str]:
    """Exit-2 problems of a model vocabulary against its tokenizer's."""
    if model_vocab < tokenizer.vocab_size:
        return [f"vocab_size={model_vocab} is smaller than tokenizer {tokenizer.name!r}'s "
                f"vocabulary ({tokenizer.vocab_size}): leave --vocab out (it follows the "
                f"tokenizer) or set --vocab {tokenizer.vocab_size} or more"]
    return []


def vocab_warning(model_vocab: int, d_model: int, tokenizer) -> str | None:
    """A warning when the model's vocabulary is far larger than the tokenizer's (unused rows)."""
    if model_vocab < 2 * tokenizer.vocab_size:
        return None
    unused = 2 * (model_vocab - tokenizer.vocab_size) * d_model  # token embedding + output head
    return (f"warning: the model's vocabulary ({model_vocab}) is far larger than tokenizer "
            f"{tokenizer.name!r}'s ({tokenizer.vocab_size}): {unused / 1e6:,.1f}M parameters of "
            f"the embedding and head are never used (leave --vocab out to follow the tokenizer)")


__all__ = ["get_tokenizer", "train_bpe", "TokenizerError", "ByteTokenizer", "vocab_problems",
           "vocab_warning"]
