"""The online ring's host-side cost per batch, without any model: what a producer spends writing a batch into its
slot and what the trainer's side spends taking it out, on this machine.

For one batch of ``--tokens`` real tokens of ``--width`` hidden values (bfloat16) in ``--documents`` documents,
``--repeats`` times (medians):

* write: :meth:`dflash.batches.ring.Ring.write_batch` (ids, masks and hidden states copied into the shared-memory
  slot, CRC-32C of the payload), from host tensors: what a CPU producer spends besides its forward (it copies the
  forward's output into the slot); of it, ``commit`` (:meth:`dflash.batches.ring.Ring.commit_batch`: the CRC-32C
  read in place and the header) is all a CUDA producer's CPU does per batch, its hidden states arriving in the slot
  by the device-to-host copy itself;
* read: :meth:`dflash.batches.ring.Ring.read_batch` (the consumer: a private copy of the slot into one buffer
  reused from batch to batch, as ``OnlineBatches`` reads, its CRC-32C checked);
* pack: the consumer's packing of that copy into the training batch (:func:`dflash.batches.online.pack_slot_batch`, as
  ``OnlineBatches`` calls it, padded to the token budget, in pinned memory when CUDA is available, as
  the trainer does).

:class:`dflash.batches.online.OnlineBatches` reads and packs on one background thread, one batch after another (the
trainer's thread only takes the packed batches), so ``tokens / (read + pack)`` bounds what one trainer process can
take from the ring, whatever the producers and the trainer's GPU do; it prints that bound next to the per-phase
times and rates (medians of ``--repeats`` after one untimed warm-up).

    python benchmarks/online_consumer.py                       # SmolLM2, 5 taps: 16,384 x 2,880
    python benchmarks/online_consumer.py --width 20480 --tokens 8192   # Qwen3-8B, 5 taps, 8,192-token batches
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dflash.batches.online import pack_slot_batch
from dflash.batches.ring import Ring, RingGeometry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="real tokens per batch (the token budget)")
    parser.add_argument("--width", type=int, default=5 * 576, help="n*H hidden values per token (SmolLM2, 5 taps)")
    parser.add_argument("--documents", type=int, default=16, help="documents per batch, equal lengths")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()

    pin = torch.cuda.is_available()
    geometry = RingGeometry(num_slots=2, max_tokens=args.tokens, max_documents=args.documents, width=args.width,
                            dtype=torch.bfloat16)  # fmt: skip
    lengths = [args.tokens // args.documents] * args.documents
    lengths[-1] += args.tokens - sum(lengths)
    generator = torch.Generator().manual_seed(0)
    input_ids = [np.arange(n, dtype=np.int64) % 49152 for n in lengths]
    loss_mask = [np.ones(n, dtype=np.int64) for n in lengths]
    hidden = [torch.randn(n, args.width, generator=generator).to(torch.bfloat16) for n in lengths]
    rows = np.arange(args.documents, dtype=np.int64)
    nbytes = args.tokens * args.width * 2
    times: dict[str, list[float]] = {"write": [], "commit": [], "read": [], "pack": []}
    private = np.empty(geometry.payload_capacity, dtype=np.uint8)  # the reader's reused buffer
    with Ring.create(geometry) as ring:
        for repeat in range(-1, args.repeats):  # repeat -1: an untimed warm-up (first touch of the slot's pages)
            slot, ticket = ring.acquire()
            started = time.perf_counter()
            write = ring.begin_batch(slot, ticket, epoch=0, batch_index=repeat + 1, bucket=0, corpus_rows=rows,
                                     input_ids=input_ids, loss_mask=loss_mask)  # fmt: skip
            for view, part in zip(write.documents, hidden, strict=True):  # as write_batch does
                view.copy_(part)
            copied = time.perf_counter()
            ring.commit_batch(write)
            written = time.perf_counter()
            batch = ring.read_batch(slot, ticket, epoch=0, batch_index=repeat + 1, out=private)
            read = time.perf_counter()
            ring.release(slot)
            packed = pack_slot_batch(batch, pad_to=args.tokens, bucket=0, pin_memory=pin)
            packed_at = time.perf_counter()
            del packed
            if repeat < 0:
                continue
            times["write"].append(written - started)
            times["commit"].append(written - copied)
            times["read"].append(read - written)
            times["pack"].append(packed_at - read)
            print(f"repeat {repeat}: write {1e3 * times['write'][-1]:.1f} ms (commit {1e3 * times['commit'][-1]:.1f}"
                  f" ms), read {1e3 * times['read'][-1]:.1f} ms, pack {1e3 * times['pack'][-1]:.1f} ms")
    medians = {name: float(np.median(values)) for name, values in times.items()}
    consumer = medians["read"] + medians["pack"]
    result = {
        "tokens": args.tokens, "width": args.width, "documents": args.documents, "repeats": args.repeats,
        "hidden_bytes": nbytes, "pinned": pin,
        **{f"{name}_ms": 1e3 * value for name, value in medians.items()},
        **{f"{name}_gb_per_s": nbytes / value / 1e9 for name, value in medians.items()},
        "consumer_bound_tokens_per_s": args.tokens / consumer,
        "runs_ms": {name: [round(1e3 * v, 1) for v in values] for name, values in times.items()},
    }  # fmt: skip
    print(f"medians of {args.repeats}, {args.tokens:,} tokens x {args.width:,} bf16 ({nbytes / 1e6:,.0f} MB), "
          f"pinned {pin}: write {result['write_ms']:.1f} ms ({result['write_gb_per_s']:.2f} GB/s; commit "
          f"{result['commit_ms']:.1f} ms), "
          f"read {result['read_ms']:.1f} ms ({result['read_gb_per_s']:.2f} GB/s), "
          f"pack {result['pack_ms']:.1f} ms ({result['pack_gb_per_s']:.2f} GB/s); "
          f"one consumer takes at most {result['consumer_bound_tokens_per_s']:,.0f} tokens/s")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
