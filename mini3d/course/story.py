"""The course's running example, in one place: the 70B model that does not fit on eight A100s.

Chapter 00 meets it, and chapters 02, 03, 06 and 09 come back to it (memory bars, the ZeRO + 3D
plan, the step-time breakdown, the planner), all through `MODEL_70B`, so switching the whole course
to another shape is this one line. It is Llama-3.1-70B's published shape (80 layers, d_model 8192,
64 query heads and 8 key/value heads, SwiGLU width 28672, 128,256-token vocabulary: 70.6e9
parameters). The numbers the chapters quote are computed in their cells, so they follow.
"""

MODEL_70B = "llama-3.1-70b"
GPU_70B = "A100-80GB"  # the cards of the story: eight per node, 80 GiB each

__all__ = ["MODEL_70B", "GPU_70B"]
