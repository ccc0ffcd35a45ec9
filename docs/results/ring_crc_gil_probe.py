"""Probe: how much a CRC-32C computed in another thread of the process slows a thread issuing a target's forwards.

The online producer's process computes the CRC-32C of every planned batch twice (the producer's commit and the
batch source's reader, ``dflash.batches.ring._crc32c``) while a producer thread issues the next task's forwards.
Each operator the issuing thread calls lets the GIL go and must take it back, so a thread computing CRCs while
holding the GIL stalls it. Where the forwards are bound by the host issuing their operators (SmolLM2 on an H200,
docs/online-queue.md), that stall adds to their time. The ring first used google_crc32c over 8 MB pieces, which
holds the GIL while it reads anything but ``bytes``; it now uses the crc32c package with the GIL released.

This runs extract's loop (``TargetRunner.iter_batches``) on a target of SmolLM2's depth (30 layers, taps 1, 8, 14,
20 and 27: 1,513 operators per forward) at the ``--smoke`` width, so that on a CPU too its forwards are bound by
issuing operators, over documents of 16-128 tokens in forwards of 2,048 padded tokens (the H200 run's
256-2,048 and 32,768, divided by 16), alone; while another thread computes ``_crc32c`` of a ``--crc-mib`` buffer
(default: one H200 planned batch's hidden states, 14.5K tokens x 5 taps x 576 x bf16) every ``--period-ms``, first
the former way (google_crc32c, GIL held per piece), then the ring's own ``_crc32c`` (GIL released). Torch runs one thread (``--threads``), so that on a 2-core machine the CRC has a core of its own,
as it has on a GPU host, whose issuing thread occupies one core: what is left is the GIL. Medians of
``--repeats``.

    python docs/results/ring_crc_gil_probe.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import google_crc32c
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from extract import build_target  # noqa: E402

from dflash.batches.ring import _crc32c  # noqa: E402
from dflash.target.runner import TargetRunner  # noqa: E402


def crc_holding_the_gil(view: np.ndarray) -> int:
    """The ring's CRC-32C before it moved to the crc32c package: google_crc32c over 8 MB pieces of the array, which
    holds the GIL while it reads anything but ``bytes``."""
    crc = 0
    for piece in range(0, view.size, 8 << 20):
        crc = google_crc32c.extend(crc, view[piece : piece + (8 << 20)])
    return crc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crc-mib", type=float, default=14_500 * 5 * 576 * 2 / 2**20)
    parser.add_argument("--period-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = build_target("smollm2-random", torch.device("cpu"), smoke=True, seed=0, num_layers=30)
    runner = TargetRunner(model, [1, 8, 14, 20, 27], "cpu", token_budget=2048)
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 32000, size=int(rng.integers(16, 129))) for _ in range(66)]  # ~4 planned batches
    buffer = np.ones(int(args.crc_mib * 2**20), dtype=np.uint8)
    assert crc_holding_the_gil(buffer) == _crc32c(buffer)

    def loop() -> None:
        for batch in runner.iter_batches(documents):
            batch.release()

    def timed(crc) -> tuple[float, int, float]:
        stop, spent = threading.Event(), []

        def checksums() -> None:
            while not stop.wait(args.period_ms / 1e3):
                started = time.perf_counter()
                crc(buffer)
                spent.append(time.perf_counter() - started)

        thread = threading.Thread(target=checksums) if crc is not None else None
        if thread is not None:
            thread.start()
        started = time.perf_counter()
        loop()
        wall = time.perf_counter() - started
        stop.set()
        if thread is not None:
            thread.join()
        return wall, len(spent), statistics.median(spent) if spent else 0.0

    loop()  # warm-up
    ways = {"alone": None, "google_crc32c (GIL held per piece)": crc_holding_the_gil,
            "ring's _crc32c (crc32c, GIL released)": _crc32c}
    runs = {way: [timed(crc) for _ in range(args.repeats)] for way, crc in ways.items()}
    print(f"extract's loop over {len(documents)} documents ({sum(map(len, documents)):,} tokens), 30 layers; another "
          f"thread computing the CRC-32C of {args.crc_mib:.1f} MiB every {args.period_ms:.0f} ms; medians of "
          f"{args.repeats} (torch {torch.__version__}, {torch.get_num_threads()} threads):")
    for way, results in runs.items():
        print(f"  {way:>38}: {1e3 * statistics.median(r[0] for r in results):7.1f} ms, "
              f"{statistics.median(r[1] for r in results):.0f} CRCs of "
              f"{1e3 * statistics.median(r[2] for r in results):.1f} ms each")


if __name__ == "__main__":
    main()
