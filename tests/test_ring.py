"""Contract tests of the online queue's ring (dflash.batches.ring; docs/online-queue.md).

Checksums, version refusal, tickets (a slot is reused only after its release), backpressure, and cleanup of the
shared-memory segments when a producer or the owner is SIGKILLed (``/dev/shm`` listed before and after: the
segments of the test's own processes, whatever other runs on the machine create or remove meanwhile).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from dflash.batches import ring as online_queue
from dflash.batches.ring import QUEUE_FORMAT_VERSION, QueueError, Ring, RingGeometry
from dflash.io.shm import SharedMemoryFull, list_segments, segment_owner


def _batch(dtype: torch.dtype, width: int = 8, lengths=(3, 5), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(n, width, generator=generator).to(dtype) for n in lengths]
    ids = [np.arange(n, dtype=np.int32) + 100 * i for i, n in enumerate(lengths)]
    mask = [(np.arange(n) % 2).astype(np.uint8) for n in lengths]
    return dict(corpus_rows=np.arange(len(lengths), dtype=np.int64) + 40, input_ids=ids, loss_mask=mask, hidden=hidden)


@pytest.fixture()
def ring():
    ring = Ring.create(RingGeometry(num_slots=2, max_tokens=32, max_documents=8, width=8))
    yield ring
    ring.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_goes_through_a_slot_bit_for_bit(dtype):
    with Ring.create(RingGeometry(num_slots=2, max_tokens=32, max_documents=8, width=8, dtype=dtype)) as owner:
        producer = Ring.attach(owner.name)
        slot, ticket = owner.acquire()
        batch = _batch(dtype)
        producer.write_batch(slot, ticket, epoch=3, batch_index=7, bucket=1, **batch)
        read = owner.read_batch(slot, ticket, epoch=3, batch_index=7)
        producer.close()
    assert read.hidden.dtype == dtype and torch.equal(read.hidden, torch.cat(batch["hidden"]))
    assert read.corpus_rows.tolist() == [40, 41] and read.lengths.tolist() == [3, 5] and read.bucket == 1
    assert read.input_ids.tolist() == np.concatenate(batch["input_ids"]).tolist()
    assert read.loss_mask.tolist() == np.concatenate(batch["loss_mask"]).tolist()


def test_a_batch_written_in_place_equals_write_batch_and_commits_only_while_claimed(ring):
    """``begin_batch`` + copies into its views + ``commit_batch`` (the producer's path) store the same bytes and
    checksum as ``write_batch``; a commit after the owner released the slot is refused and leaves it free."""
    batch = _batch(torch.bfloat16)
    with Ring.attach(ring.name) as producer:
        slot, ticket = ring.acquire()
        producer.write_batch(slot, ticket, epoch=1, batch_index=2, bucket=0, **batch)
        expected = ring.header(slot)
        ring.release(slot)
        slot, ticket = ring.acquire()
        write = producer.begin_batch(slot, ticket, epoch=1, batch_index=2, bucket=0,
                                     **{k: v for k, v in batch.items() if k != "hidden"})  # fmt: skip
        assert [tuple(view.shape) for view in write.documents] == [(3, 8), (5, 8)]
        for view, hidden in zip(write.documents, batch["hidden"], strict=True):
            view.copy_(hidden)
        producer.commit_batch(write)
        assert {k: v for k, v in ring.header(slot).items() if k != "ticket"} == \
            {k: v for k, v in expected.items() if k != "ticket"}  # fmt: skip
        assert torch.equal(ring.read_batch(slot, ticket, epoch=1, batch_index=2).hidden, torch.cat(batch["hidden"]))
        ring.release(slot)
        slot, ticket = ring.acquire()
        write = producer.begin_batch(slot, ticket, epoch=1, batch_index=3, bucket=0,
                                     **{k: v for k, v in batch.items() if k != "hidden"})  # fmt: skip
        ring.release(slot)  # the trainer gave the slot up (its task was cancelled) before the producer finished
        with pytest.raises(QueueError, match=f"not claimed by ticket {ticket}"):
            producer.commit_batch(write)
        assert ring.header(slot)["state"] == 0


def test_hidden_states_of_a_cancelled_write_landing_late_do_not_reach_the_next_batch_in_its_slot(ring):
    """A producer's task is cancelled after it began its write (its device copies still queued); the slot goes to the
    next batch, whose copies the same producer queues after the stale ones. Stale copies landing after the next
    batch began (but before its own copies, as one copy stream orders them) change nothing it delivers, and the
    stale write cannot commit."""
    stale_batch, batch = _batch(torch.bfloat16, lengths=(3,), seed=1), _batch(torch.bfloat16, lengths=(3, 5))
    with Ring.attach(ring.name) as producer:
        slot, stale_ticket = ring.acquire()
        held, _ = ring.acquire()
        stale = producer.begin_batch(slot, stale_ticket, epoch=0, batch_index=0, bucket=0,
                                     **{k: v for k, v in stale_batch.items() if k != "hidden"})  # fmt: skip
        ring.release(slot)  # the task was cancelled
        assert ring.acquire() == (slot, stale_ticket + 2)
        write = producer.begin_batch(slot, stale_ticket + 2, epoch=0, batch_index=1, bucket=0,
                                     **{k: v for k, v in batch.items() if k != "hidden"})  # fmt: skip
        stale.documents[0].copy_(torch.full((3, 8), 7.0))  # the stale copy lands (over the next batch's ids)
        for view, hidden in zip(write.documents, batch["hidden"], strict=True):
            view.copy_(hidden)
        producer.commit_batch(write)
        with pytest.raises(QueueError, match="not claimed"):
            producer.commit_batch(stale)
        read = ring.read_batch(slot, stale_ticket + 2, epoch=0, batch_index=1)
        ring.release(held)
    assert read.input_ids.tolist() == np.concatenate(batch["input_ids"]).tolist()
    assert read.loss_mask.tolist() == np.concatenate(batch["loss_mask"]).tolist()
    assert read.lengths.tolist() == [3, 5] and torch.equal(read.hidden, torch.cat(batch["hidden"]))


def test_a_slot_rewritten_after_hand_over_fails_its_checksum(ring):
    slot, ticket = ring.acquire()
    with Ring.attach(ring.name) as producer:
        producer.write_batch(slot, ticket, epoch=0, batch_index=0, bucket=0, **_batch(torch.bfloat16))
    start = online_queue._RING_HEADER_BYTES + slot * ring.geometry.slot_bytes + online_queue._SLOT_HEADER_BYTES
    ring._buffer[start + ring.header(slot)["payload_bytes"] - 1] ^= 0xFF  # a producer scribbling after FULL
    with pytest.raises(QueueError, match="CRC-32C"):
        ring.read_batch(slot, ticket, epoch=0, batch_index=0)


def test_the_slot_crc32c_equals_google_crc32c():
    """The payload CRC-32C (the crc32c package, read in place) is zarr's library's (google_crc32c) value of the same
    bytes, for an empty payload, a few bytes and a slot-sized one, and refuses a strided view."""
    import google_crc32c

    data = np.random.default_rng(0).integers(0, 256, size=(8 << 20) + 12345, dtype=np.uint8)
    for size in (0, 1, 9, 4097, data.size):
        assert online_queue._crc32c(data[:size]) == google_crc32c.value(data[:size].tobytes()), size
    with pytest.raises(ValueError, match="contiguous"):
        online_queue._crc32c(data[::2])


def test_reads_into_one_reused_buffer_give_each_batch_its_own_bytes_and_still_catch_a_rewrite(ring):
    """``read_batch(out=...)``: a longer batch then a shorter one through the same private buffer, each read back
    bit for bit; a slot rewritten after its hand-over still fails its checksum; a buffer too small is refused."""
    out = np.empty(ring.geometry.payload_capacity, dtype=np.uint8)
    with Ring.attach(ring.name) as producer:
        for index, lengths in enumerate(((7, 9, 4), (2, 3))):
            slot, ticket = ring.acquire()
            batch = _batch(torch.bfloat16, lengths=lengths, seed=index)
            producer.write_batch(slot, ticket, epoch=0, batch_index=index, bucket=0, **batch)
            read = ring.read_batch(slot, ticket, epoch=0, batch_index=index, out=out)
            assert read.hidden.data_ptr() == out.ctypes.data + online_queue._hidden_offset(len(lengths), sum(lengths))
            assert torch.equal(read.hidden, torch.cat(batch["hidden"])) and read.lengths.tolist() == list(lengths)
            assert read.input_ids.tolist() == np.concatenate(batch["input_ids"]).tolist()
            ring.release(slot)
        slot, ticket = ring.acquire()
        producer.write_batch(slot, ticket, epoch=0, batch_index=2, bucket=0, **_batch(torch.bfloat16))
    start = online_queue._RING_HEADER_BYTES + slot * ring.geometry.slot_bytes + online_queue._SLOT_HEADER_BYTES
    ring._buffer[start + 3] ^= 0x01
    with pytest.raises(QueueError, match="CRC-32C"):
        ring.read_batch(slot, ticket, epoch=0, batch_index=2, out=out)
    with pytest.raises(ValueError, match="at least"):
        ring.read_batch(slot, ticket, epoch=0, batch_index=2, out=out[:16])


def test_a_slot_of_another_format_version_or_batch_is_refused(ring):
    slot, ticket = ring.acquire()
    with Ring.attach(ring.name) as producer:
        producer.write_batch(slot, ticket, epoch=0, batch_index=4, bucket=0, **_batch(torch.bfloat16))
    with pytest.raises(QueueError, match="expected batch 5 of epoch 0"):
        ring.read_batch(slot, ticket, epoch=0, batch_index=5)
    start = online_queue._RING_HEADER_BYTES + slot * ring.geometry.slot_bytes
    ring._buffer[start + 8 : start + 12] = np.frombuffer(struct.pack("<I", QUEUE_FORMAT_VERSION + 1), np.uint8)
    with pytest.raises(QueueError, match=f"format version {QUEUE_FORMAT_VERSION + 1}.*expected {QUEUE_FORMAT_VERSION}"):
        ring.read_batch(slot, ticket, epoch=0, batch_index=4)
    ring._buffer[8:12] = np.frombuffer(struct.pack("<I", QUEUE_FORMAT_VERSION + 1), np.uint8)  # the ring header
    with pytest.raises(QueueError, match="format version"):
        Ring.attach(ring.name)


def test_a_slot_is_handed_out_again_only_after_release_with_a_new_ticket(ring):
    first, second = ring.acquire(), ring.acquire()
    assert first[0] != second[0]
    assert ring.acquire(timeout=0) is None  # full
    ring.release(first[0])
    again = ring.acquire(timeout=0)
    assert again is not None and again[0] == first[0] and again[1] not in (first[1], second[1])
    with Ring.attach(ring.name) as producer, pytest.raises(QueueError, match="not claimed by ticket"):
        # the old hand-out's producer may not write
        producer.write_batch(first[0], first[1], epoch=0, batch_index=0, bucket=0, **_batch(torch.bfloat16))


def test_acquire_blocks_while_the_ring_is_full_until_a_release(ring):
    held = [ring.acquire(), ring.acquire()]
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire()))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # blocked: no free slot
    ring.release(held[1][0])
    waiter.join()
    assert got[0][0] == held[1][0]


def test_a_batch_too_large_for_the_slot_is_refused(ring):
    slot, ticket = ring.acquire()
    with Ring.attach(ring.name) as producer, pytest.raises(QueueError, match="exceed"):
        producer.write_batch(slot, ticket, epoch=0, batch_index=0, bucket=0, **_batch(torch.bfloat16, lengths=(30, 5)))


def _segments_of(*pids: int) -> set[str]:
    """The dflash segments in ``/dev/shm`` now that processes ``pids`` created."""
    return {name for name in list_segments() if segment_owner(name) in pids}


def test_too_small_dev_shm_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(online_queue, "shm_free_bytes", lambda: 1 << 20)
    before = _segments_of(os.getpid())
    with pytest.raises(SharedMemoryFull, match="--shm-size.*--ring-slots"):
        Ring.create(RingGeometry(num_slots=4, max_tokens=4096, max_documents=64, width=1024))
    assert _segments_of(os.getpid()) == before


def _attach_write_and_hang(name: str, slot: int, ticket: int, ready) -> None:
    producer = Ring.attach(name)
    producer.write_batch(slot, ticket, epoch=0, batch_index=0, bucket=0, **_batch(torch.bfloat16))
    ready.set()
    threading.Event().wait()  # until SIGKILLed


def test_sigkilled_producer_leaves_no_segment_and_the_slot_stays_readable():
    before = _segments_of(os.getpid())
    context = multiprocessing.get_context("spawn")
    ring = Ring.create(RingGeometry(num_slots=2, max_tokens=32, max_documents=8, width=8))
    try:
        slot, ticket = ring.acquire()
        ready = context.Event()
        process = context.Process(target=_attach_write_and_hang, args=(ring.name, slot, ticket, ready))
        process.start()
        assert ready.wait(timeout=120)
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        read = ring.read_batch(slot, ticket, epoch=0, batch_index=0)
        assert torch.equal(read.hidden, torch.cat(_batch(torch.bfloat16)["hidden"]))
    finally:
        ring.close()
    assert _segments_of(os.getpid(), process.pid) == before  # neither the owner's ring nor one of the producer's


def test_segments_of_a_sigkilled_owner_are_swept_at_the_next_start():
    code = ("import sys, threading; from dflash.batches.ring import Ring, RingGeometry; "
            "r = Ring.create(RingGeometry(num_slots=2, max_tokens=8, max_documents=2, width=4)); "
            "print(r.name, flush=True); threading.Event().wait()")
    # Its own session, so that SIGKILL of the group also takes its resource tracker (which would otherwise unlink
    # the segment itself): only the sweep can remove it then.
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    name = owner.stdout.readline().strip()
    assert name in list_segments()
    os.killpg(owner.pid, signal.SIGKILL)
    owner.wait()
    assert name in list_segments()  # SIGKILL ran no cleanup
    with Ring.create(RingGeometry(num_slots=2, max_tokens=8, max_documents=2, width=4)):
        assert name not in list_segments()
