"""Model state on disk: mini3d's checkpoints (the per-stage state, atomic writing, the verification
before any process starts) and Hugging Face directories read and written in the same model terms."""
