"""Exercise count_params: how many parameters, and how many GPUs just to hold them for training?

Chapter: 00 why 70B does not fit (course/00_why_70b_does_not_fit.ipynb)
"""

from __future__ import annotations

import math


def count_params(cfg) -> int:
    """Exact number of parameters of `mini3d.models.transformer.GPT(cfg)`.

    Embedding: token table (V, h) + position table (max_seq_len, h). Each block: two LayerNorms
    (weight + bias), qkv Linear h -> 3h, out-projection h -> h, MLP h -> d_ff -> h, all with biases.
    Then a final LayerNorm and an untied output Linear h -> V without bias."""
    h, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    layer_norm = 2 * h
    attention = (h * 3 * h + 3 * h) + (h * h + h)
    mlp = (h * f + f) + (f * h + h)
    block = 2 * layer_norm + attention + mlp
    return V * h + cfg.max_seq_len * h + cfg.n_layers * block + layer_norm + h * V


def min_gpus_for_model_states(n_params: int, gpu_bytes: int, bytes_per_param: int = 16) -> int:
    """Fewest GPUs whose memory together holds parameters, gradients and optimizer states
    (`bytes_per_param` each, 16 for mixed-precision AdamW), ignoring activations."""
    return math.ceil(n_params * bytes_per_param / gpu_bytes)
