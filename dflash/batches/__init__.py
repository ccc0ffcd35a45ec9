"""Training examples from a cache or a live target: length buckets, packed batches, the batch sources and streams over them, and the online shared-memory ring."""
