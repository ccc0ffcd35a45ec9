"""A scheduling model of generate's continuous batching: the share of decode-step rows that choose a token of a reply
(the `row_occupancy` generate reports), per part size, from the refill rule alone (no model, no GPU).

The static decoder's stream (``dflash.generation.static_decode.StaticDecoder.decode_stream``) runs ``rows`` rows; the
host looks at finished rows every ``check_every`` (16) decode steps and refills them once at least ``rows // 16`` are
free (any number once none is decoding); a part's prompts are all its rows get, so the part ends with a drain while
its last replies finish. Reply lengths: ``--length-limited`` of them run to ``--max-new-tokens`` (75.6% in the v11
preset run, 18,568 of 24,576 replies), the others stop at a uniformly drawn earlier step (an assumption: the
corpus records finish reasons, not the lengths' distribution). Prefill time is not modelled. This is an estimate of
what larger parts could gain, not a measurement: generate's own `row_occupancy` line on a GPU is.

    python docs/results/generate_occupancy_model.py
"""

from __future__ import annotations

import argparse

import numpy as np


def occupancy(lengths: np.ndarray, rows: int, check_every: int, refill_at: int) -> tuple[float, int]:
    """``(rows choosing a token / rows run, decode steps)`` of one part whose replies have ``lengths``."""
    remaining = np.zeros(rows, dtype=np.int64)
    taken = min(rows, lengths.size)
    remaining[:taken] = lengths[:taken]
    steps = busy = 0
    while (remaining > 0).any() or taken < lengths.size:
        for _ in range(check_every):
            active = remaining > 0
            if not active.any():
                break
            busy += int(active.sum())
            steps += 1
            remaining[active] -= 1
        free = np.flatnonzero(remaining == 0)
        if taken < lengths.size and (free.size >= refill_at or free.size == rows):
            chosen = free[: lengths.size - taken]
            remaining[chosen] = lengths[taken : taken + chosen.size]
            taken += chosen.size
    return busy / max(1, steps * rows), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--length-limited", type=float, default=18_568 / 24_576)
    parser.add_argument("--part-sizes", type=int, nargs="+", default=[2048, 4096, 8192, 24576])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.rows} rows, refill every 16 steps once {args.rows // 16} rows are free, {args.length_limited:.1%} of "
          f"replies at {args.max_new_tokens} tokens, the others stopping uniformly earlier; {args.seeds} seeds")
    for size in args.part_sizes:
        figures = []
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            lengths = np.where(rng.random(size) < args.length_limited, args.max_new_tokens,
                               rng.integers(1, args.max_new_tokens, size))
            figures.append(occupancy(lengths, args.rows, 16, max(1, args.rows // 16)))
        shares = [share for share, _ in figures]
        print(f"  part of {size:>6,} prompts: rows choosing a token {min(shares):.1%}-{max(shares):.1%} of the decode "
              f"steps' rows ({figures[0][1]:,} steps)")


if __name__ == "__main__":
    main()
