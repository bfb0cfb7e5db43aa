"""Your answers: fill in each stub, then run `mini3d grade NAME`."""
