"""HBM traffic of the memory-bound kernels, in seconds per micro-batch: the attention scores'
when attention is written out (`score_traffic_s`) and the elementwise kernels' (norms, residual
adds, the MLP activation: `elementwise_traffic_s`). The cost model (mini3d.cost.model) adds both to
the compute time; the fits (mini3d.cost.calibration.matmul_compute_s) take them out again, since
they do not scale with the matmul efficiency."""

from __future__ import annotations

from mini3d.cost.activations import ELEMENT_BYTES


SCORE_PASSES = {"fwd": 4, "bwd": 8}  # s x s score tensor: written, softmax read + written, read by A.V;
# backward: probabilities and their gradient read, the softmax gradient read + written, read twice


def score_traffic_s(cfg, plan, hw, layers: int, tokens: float) -> dict:
    """Seconds one micro-batch's attention scores spend in HBM, forward and backward, on a GPU
    whose attention is written out (`plan.attention == "explicit"`, as in Megatron-LM's fused
    softmax of 2021-22): every token of every local head has s scores, and each pass over them
    moves their bytes at `memory_bw` (`SCORE_PASSES`; recomputation runs the forward passes
    again; attention dropout, which mini3d refuses under tp, would add more). Flash attention
    (sdpa) keeps them on chip: none. A shared host's measured per-token overhead already holds
    this work: none there either.
    Relative to the matmuls this is s / (head_dim x h): a fifth of a 1.7B model's step (h=2304,
    head_dim 96), a few percent at h=12288."""
    if plan.attention != "explicit" or hw.shared_host:
        return {"fwd": 0.0, "bwd": 0.0}
    per_pass = layers * tokens * cfg.n_heads / plan.tp * plan.seq_len * ELEMENT_BYTES[plan.dtype] / hw.memory_bw
    fwd, bwd = SCORE_PASSES["fwd"], SCORE_PASSES["bwd"]
    return {"fwd": fwd * per_pass, "bwd": (bwd + (fwd if plan.recompute != "none" else 0)) * per_pass}


# Elements read + written per token and layer by the elementwise kernels, in units of h (norms and
# residual adds, on every tp rank unless sequence-parallel) and of d_ff / t (the MLP activation):
#   forward:  2 norms (read x, write y: 2h each), 2 residual adds (read 2h, write h each);
#             GELU reads and writes d_ff/t (2), SwiGLU reads gate and up, writes one (3)
#   backward: 2 norms (read x and dy, write dx: 3h each), 2 adds (3h each);
#             GELU reads x and dy, writes dx (3), SwiGLU reads gate, up and dy, writes two (5)
ELEMENTWISE_ELEMENTS = {"fwd": {"hidden": 10, "gelu": 2, "swiglu": 3},
                        "bwd": {"hidden": 12, "gelu": 3, "swiglu": 5}}


def elementwise_traffic_s(cfg, plan, hw, layers: int, tokens: float) -> dict:
    """Seconds one micro-batch's memory-bound elementwise kernels spend in HBM, forward and
    backward (`ELEMENTWISE_ELEMENTS`: the norms, the residual adds and the MLP activation, as
    Megatron's fused bias-GeLU / bias-dropout-add kernels move them; dropout's masks left out).
    The norms and adds act on the full hidden vector on every tp rank, or on s/t of the tokens
    under sequence parallelism. Full recompute runs the forward's kernels again; selective
    recompute only the attention core's (counted in `score_traffic_s`). A shared host's measured
    per-token overhead already holds this work: none there. Relative to the matmuls (24 h^2
    FLOPs a token and layer forward) this is ~6% of a 1.7B model's step (h=2304, tp1) on an A100
    and ~1% at h=12288 with sequence parallelism. MoE layers are counted as dense ones of d_ff."""
    if hw.shared_host:
        return {"fwd": 0.0, "bwd": 0.0}
    h, t, act = cfg.d_model, plan.tp, "swiglu" if cfg.llama_like else "gelu"
    out = {}
    for kind, n in ELEMENTWISE_ELEMENTS.items():
        per_token = n["hidden"] * h / (t if plan.sequence_parallel else 1) + n[act] * cfg.d_ff / t
        out[kind] = layers * tokens * per_token * ELEMENT_BYTES[plan.dtype] / hw.memory_bw
    if plan.recompute == "full":
        out["bwd"] += out["fwd"]
    return out


__all__ = ["score_traffic_s", "SCORE_PASSES", "elementwise_traffic_s", "ELEMENTWISE_ELEMENTS"]
