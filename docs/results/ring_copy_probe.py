"""Probe: what the device-to-host copies of one planned batch cost into each kind of host memory (one CUDA GPU).

The online producer copies each document's hidden states from the device into its view of a shared-memory ring
slot (POSIX shared memory page-locked with ``cudaHostRegister``: ``dflash.io.shm.SharedHostBuffer(pin=True)``,
as ``dflash.batches.ring.Ring.attach(pin=True)`` does), one copy per document on the runner's copy stream;
extract's runner copies the whole padded batch into one ``pin_memory`` buffer. On one H200 the producer's forwards
took ~96 ms of device time per ~14.5K-token batch where extract's loop took ~65 ms (docs/online-queue.md); this
times the copies alone, side by side, to say whether they are the difference.

For a batch of ``--documents`` documents of ``--tokens`` real tokens each (padded to ``--padded``) and the
SmolLM2 preset's 5 taps x 576 (bf16), each way: whether the destination is pinned as PyTorch sees it, the host
time to issue the copies and the time until they landed (event synchronized); medians of ``--repeats``.

    python docs/results/ring_copy_probe.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash.io.shm import SharedHostBuffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=480)
    parser.add_argument("--padded", type=int, default=600)
    parser.add_argument("--width", type=int, default=5 * 576)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    hidden = torch.randn(args.documents, args.padded, args.width, device=device, dtype=torch.bfloat16)
    real = args.documents * args.tokens * args.width
    stream = torch.cuda.Stream(device)
    pinned = torch.empty(hidden.numel(), dtype=torch.bfloat16, pin_memory=True)
    shared_pinned, shared_plain = SharedHostBuffer(real, pin=True), SharedHostBuffer(real, pin=False)
    pageable = torch.empty(real, dtype=torch.bfloat16)

    def per_document(flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        step = args.tokens * args.width
        return [(flat[i * step:(i + 1) * step].view(args.tokens, args.width), hidden[i, :args.tokens])
                for i in range(args.documents)]

    ways = {
        "whole padded batch -> pin_memory buffer (extract)": [(pinned.view(hidden.shape), hidden)],
        "per document -> registered shared memory (producer)": per_document(shared_pinned.tensor),
        "per document -> unregistered shared memory": per_document(shared_plain.tensor),
        "per document -> pin_memory buffer": per_document(pinned),
        "per document -> pageable memory": per_document(pageable),
    }
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: {args.documents} documents x "
          f"{args.tokens} tokens (padded {args.padded}) x {args.width} bf16; registered: {shared_pinned.pinned}")
    for name, pairs in ways.items():
        issue, landed = [], []
        for _ in range(args.repeats + 1):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for target, source in pairs:
                    target.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            issued = time.perf_counter()
            event.synchronize()
            issue.append(1000 * (issued - started))
            landed.append(1000 * (time.perf_counter() - started))
        issue, landed = issue[1:], landed[1:]  # the first is a warm-up
        nbytes = sum(t.numel() * t.element_size() for t, _ in pairs)
        print(f"{name:55s} pinned {pairs[0][0].is_pinned()!s:5s}  issue {statistics.median(issue):7.2f} ms  "
              f"landed {statistics.median(landed):7.2f} ms  {nbytes / 1e6:6.1f} MB  "
              f"{nbytes / statistics.median(landed) / 1e6:5.1f} GB/s")
    ways.clear()  # the shared memory's views must be gone before it is unmapped
    del pairs
    shared_pinned.close()
    shared_plain.close()


if __name__ == "__main__":
    main()
