"""Read throughput of a real hidden-state cache in shuffled order, 1 vs 2 threads (docs/training.md, read threads).

Each "batch" is random samples of the committed shards read one by one with ``CacheReader.read_shard`` (what the
streaming loader does for a shuffled plan: every sample decodes its whole chunks) until 16,384 tokens; 8 batches
per measurement, two measurements per thread count. The cache used (2026-12-03, the 2-core CI-sized machine):

    dflash-stages prepare --output corpus                  # embedded stdlib corpus
    dflash-stages extract --corpus corpus --output cache --codec blosc-zstd1-shuffle --target-processes 1
    # stopped after its first shard (65,536 tokens, SmolLM2, 5 taps) was committed: CPU extract is slow
    python docs/results/read_threads_probe.py cache
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dflash.cache import CacheReader

reader = CacheReader(sys.argv[1])
shards = [shard for shard in reader.shards if reader.commit_record(shard) is not None]
print("committed shards", shards, "codec", reader.metadata.codec)


def batch(seed: int) -> int:
    rng = np.random.default_rng(seed)
    tokens = 0
    while tokens < 16384:
        shard = int(rng.choice(shards))
        index = int(rng.integers(len(reader.shard_lengths(shard))))
        tokens += reader.read_shard(shard, [index])[0].hidden.shape[0]
    return tokens


for threads in (1, 2):
    for repeat in range(2):
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(batch, range(repeat * 100, repeat * 100 + 8)))
        seconds = time.perf_counter() - started
        print(f"threads {threads}: {total} tokens in {seconds:.2f} s = {total / seconds:,.0f} tok/s")
