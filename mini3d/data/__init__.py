"""Training text: the corpus that needs no download, tokenizers, `mini3d prepare`'s token shards and
the sampler that turns them into micro-batches."""
