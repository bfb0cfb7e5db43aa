"""The names a model shape is checked against: families, their activations and features, the
router kinds and balancing-loss scopes (read by mini3d.models.config and mini3d.models.checks)."""

from __future__ import annotations

FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "deepseek")
# RMSNorm, rotary positions, SwiGLU (deepseek: multi-head latent attention instead of GQA)
LLAMA_LIKE = ("llama", "qwen2", "qwen3", "deepseek")
ACTIVATIONS = {"gpt2": ("gelu", "gelu_tanh"), **{f: ("silu",) for f in LLAMA_LIKE}}
FAMILY_FEATURES = {"qwen2": "qkv_bias", "qwen3": "qk_norm"}  # what each qwen adds to llama
ROUTERS = ("softmax", "softmax-norm", "sigmoid")  # the kinds of mini3d.models.routers.ROUTERS
AUX_LOSS_SCOPES = ("model", "layer")  # mini3d.models.balance.router_loss's balancing-loss pools


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending (what the error messages offer as values that fit)."""
    return [d for d in range(1, n + 1) if n % d == 0]
