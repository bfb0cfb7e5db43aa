"""Exercise recompute: full and selective activation recomputation with torch.utils.checkpoint.

Chapter: 07 recomputation (course/07_activation_recomputation.ipynb)
"""
from __future__ import annotations
import functools
from torch.utils.checkpoint import checkpoint

def apply_recompute(model, policy: str):
    """Make `model` (a mini3d.models.transformer.GPT) recompute activations in backward instead of storing them.

    "none": leave it. "full": each block's forward runs under checkpoint (only its input is kept).
    "selective": only each block's attention core `block.attn.core` (the softmax(QK^T)V part, whose
    activations grow with T^2) runs under checkpoint; wrap whatever function is installed there.
    Use `use_reentrant=False`. Returns the model."""
    raise NotImplementedError("replace a function by one that runs it under torch.utils.checkpoint (use_reentrant=False): which function is a whole block, and which only the part whose activations grow with T^2?")
