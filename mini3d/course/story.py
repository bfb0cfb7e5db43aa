"""The course's running example, in one place: the 70B model that does not fit on eight A100s.

Chapter 00 meets it, and every chapter that changes the memory or the step time (all but 08) ends
its main section with the same two panels for it (`mini3d.course.viz.story70b.show_story`: one
GPU's memory by category, one step's time by term), all through `MODEL_70B`, so switching the
whole course to another shape is this one line. It is Llama-3.1-70B's published shape (80 layers, d_model 8192,
64 query heads and 8 key/value heads, SwiGLU width 28672, 128,256-token vocabulary: 70.6e9
parameters). The numbers the chapters quote are computed in their cells, so they follow.
"""

MODEL_70B = "llama-3.1-70b"
GPU_70B = "A100-80GB"  # the cards of the story: eight per node, 80 GiB each

__all__ = ["MODEL_70B", "GPU_70B"]
