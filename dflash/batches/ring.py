"""The online queue (contract 4, docs/online-queue.md): a ring of fixed shared-memory slots carrying planned batches.

One POSIX shared-memory segment (:mod:`dflash.io.shm`, named ``dflash_<owner pid>_<random>``) holds a ring header and
``num_slots`` slots of ``slot_bytes`` each. The trainer process owns the ring (:meth:`Ring.create`): it hands a free
slot to a producer together with a *ticket*, the producer (a target replica in another process,
:meth:`Ring.attach`) writes one planned batch into it (:meth:`Ring.write_batch`, or in two steps:
:meth:`Ring.begin_batch` writes the metadata and returns views of the slot that the hidden states are copied into
in place, :meth:`Ring.commit_batch` then writes the header; payload first, header last either way) and returns;
the owner copies the payload out, verifies it (:meth:`Ring.read_batch`) and releases the slot (:meth:`Ring.release`).
A slot is handed out again only after its release; :meth:`Ring.acquire` blocks while every slot is taken (the
backpressure on the dispatcher that feeds the producers).

Slot layout (little-endian; offsets in bytes from the slot start; ``D`` documents, ``T`` tokens, ``W = n*H``)::

    0    header (128 B, :data:`SLOT_HEADER`): magic b"DFLQSLOT", format version, state, ticket, epoch, batch index,
         D, hidden dtype code, W, bucket, T, payload bytes, CRC-32C of the payload
    128  corpus_rows int64[D] | lengths int64[D] | input_ids int32[T] | loss_mask uint8[T] | pad to 64 B |
         hidden [T, W] (bfloat16 or float32, as the runner produced it; documents in plan order)

Checks on read: magic, version (a slot of another format version is refused, naming both), state FULL, the ticket
handed out with the slot, the batch the reader expects, and the payload's CRC-32C, computed on the reader's private
copy: a producer that rewrites the slot after handing it over cannot change what the trainer trains on unnoticed.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from dflash.errors import ConfigError, DFlashError
from dflash.io.shm import (
    SharedMemoryFull,
    attach_segment,
    close_segment,
    create_segment,
    pin_host_range,
    remove_orphaned_segments,
    shm_free,
    shm_free_bytes,
    unpin_host_range,
)

__all__ = [
    "QUEUE_FORMAT_VERSION",
    "SLOT_HEADER",
    "QueueError",
    "RingGeometry",
    "SlotBatch",
    "SlotWrite",
    "Ring",
]

#: Version of the slot and ring layout (docs/online-queue.md); a reader refuses any other.
QUEUE_FORMAT_VERSION = 1
_RING_MAGIC = b"DFLQRING"
_SLOT_MAGIC = b"DFLQSLOT"
#: Ring header: magic, version, num_slots, slot_bytes, max_tokens, max_documents, width, dtype code.
_RING_HEADER = struct.Struct("<8sIIQQQII")
_RING_HEADER_BYTES = 4096
#: Slot header: magic, version, state, ticket, epoch, batch index, documents, dtype code, width, bucket, tokens,
#: payload bytes, crc32c.
SLOT_HEADER = struct.Struct("<8sIIQQQIIIiQQI")
_SLOT_HEADER_BYTES = 128
_STATE_FREE, _STATE_CLAIMED, _STATE_FULL = 0, 1, 2
_DTYPES = {1: torch.bfloat16, 2: torch.float32}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class QueueError(DFlashError, RuntimeError):
    """A slot of the online queue failed a check (version, ticket, batch, checksum); the message names the slot."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RingGeometry:
    """Sizes of a ring; every slot can hold any batch of at most ``max_tokens`` tokens and ``max_documents``."""

    num_slots: int
    """Slots in the ring (>= 2: one being read while producers fill the others)."""
    max_tokens: int
    """Tokens per batch (the training token budget)."""
    max_documents: int
    """Documents per batch (at most ``max_tokens``)."""
    width: int
    """``n*H``: hidden values per token (taps concatenated)."""
    dtype: torch.dtype = torch.bfloat16
    """Hidden-state dtype of the payload: bfloat16 or float32, as the target runner produces it."""

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_tokens", "max_documents", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer; got {value!r}")
        if self.num_slots < 2:
            raise ConfigError(f"num_slots must be >= 2 (one read while others fill); got {self.num_slots}")
        if self.dtype not in _DTYPE_CODES:
            raise ConfigError(f"dtype must be torch.bfloat16 or torch.float32; got {self.dtype}")

    @property
    def payload_capacity(self) -> int:
        """Largest payload in bytes (metadata arrays, tokens, masks, padding, hidden states)."""
        hidden = self.max_tokens * self.width * self.dtype.itemsize
        return _hidden_offset(self.max_documents, self.max_tokens) + hidden

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (header + payload capacity, rounded up to 4 KiB pages)."""
        return -(-(_SLOT_HEADER_BYTES + self.payload_capacity) // 4096) * 4096

    @property
    def nbytes(self) -> int:
        """Bytes of the whole segment."""
        return _RING_HEADER_BYTES + self.num_slots * self.slot_bytes


def _hidden_offset(num_documents: int, num_tokens: int) -> int:
    """Payload offset of the hidden states (64-byte aligned) after rows, lengths, ids and mask."""
    raw = 16 * num_documents + 5 * num_tokens
    return -(-raw // 64) * 64


@dataclass(slots=True, kw_only=True)
class SlotBatch:
    """One batch as read out of a slot (private copies: valid after the slot's release).

    Fields: ``corpus_rows [D]`` int64, ``lengths [D]`` int64, ``input_ids [T]`` int32, ``loss_mask [T]`` uint8,
    ``hidden [T, W]`` (bfloat16 or float32), ``epoch``, ``batch_index`` (global index in the epoch's plan),
    ``bucket``.
    """

    corpus_rows: np.ndarray
    lengths: np.ndarray
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    epoch: int
    batch_index: int
    bucket: int


@dataclass(slots=True, kw_only=True)
class SlotWrite:
    """A batch being written into a slot in place (:meth:`Ring.begin_batch`), committed by :meth:`Ring.commit_batch`.

    ``documents``: per document, in plan order, the ``[L, W]`` view of the slot where its hidden states go (views of
    ``hidden``, the slot's ``[T, W]`` hidden-state area; valid until the ring is closed, written by this producer
    only until the commit).
    """

    slot: int
    ticket: int
    epoch: int
    batch_index: int
    bucket: int
    num_documents: int
    num_tokens: int
    payload_bytes: int
    hidden: torch.Tensor
    documents: list[torch.Tensor]
    metadata: list[np.ndarray]
    """The rows, lengths, ids and masks, written by the commit."""


def _crc32c(view: np.ndarray) -> int:
    """CRC-32C of a contiguous ``uint8`` array, read in place (no copy), with the GIL released while it reads: a
    producer's process computes it twice per batch (its commit and the reader) while another of its threads issues a
    target's forwards, each operator of which must take the GIL back (google_crc32c, zarr's, releases it for
    ``bytes`` only, so a thread reading a numpy slot through it stalled the issuing thread for the whole read)."""
    if not view.flags.c_contiguous:
        raise ValueError("_crc32c reads a contiguous array")
    return crc32c.crc32c(view, gil_release_mode=1)


class Ring:
    """A ring of slots in one shared-memory segment. Build with :meth:`create` (owner) or :meth:`attach`.

    The owner hands out slots (:meth:`acquire` -> ``(slot, ticket)``), reads them (:meth:`read_batch`) and frees them
    (:meth:`release`); producers only write (:meth:`write_batch`, or :meth:`begin_batch` then :meth:`commit_batch`).
    :meth:`close` unmaps; the owner's also unlinks.
    """

    def __init__(self, shm: Any, geometry: RingGeometry, *, owner: bool) -> None:
        self.shm = shm
        self.name: str = shm.name
        self.geometry = geometry
        self.owner = owner
        self._buffer = np.frombuffer(shm.buf, dtype=np.uint8)
        self.pinned = False
        """The segment is page-locked in this process for CUDA copies (:meth:`attach` with ``pin``)."""
        # Owner side: free slots and tickets (a ticket names one hand-out of a slot; never reused).
        self._free = list(range(geometry.num_slots))
        self._condition = threading.Condition()
        self._stopped = False
        self._next_ticket = 1

    # ---- construction -----------------------------------------------------------------------------------------

    @classmethod
    def create(cls, geometry: RingGeometry) -> Ring:
        """A new ring (this process owns it). Sweeps the segments of dead processes first.

        Raises:
            SharedMemoryFull: ``/dev/shm`` has less free space than the ring needs (the message gives both and the
                fix: ``docker run --shm-size=...`` or fewer slots / a smaller token budget).
        """
        remove_orphaned_segments()
        free = shm_free_bytes()
        fix = "lower --ring-slots or --token-budget"
        if free is not None and free < geometry.nbytes:
            raise SharedMemoryFull(
                f"the online queue needs {geometry.nbytes / 2**20:,.0f} MiB of shared memory ({geometry.num_slots} "
                f"slots x {geometry.slot_bytes / 2**20:,.1f} MiB) but {shm_free()}; give the machine or container "
                f"more shared memory (docker run --shm-size=...) or {fix}"
            )
        shm = create_segment(geometry.nbytes, what="the online queue", fix=fix)
        ring = cls(shm, geometry, owner=True)
        code = _DTYPE_CODES[geometry.dtype]
        header = _RING_HEADER.pack(_RING_MAGIC, QUEUE_FORMAT_VERSION, geometry.num_slots, geometry.slot_bytes,
                                   geometry.max_tokens, geometry.max_documents, geometry.width, code)  # fmt: skip
        ring._buffer[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        return ring

    @classmethod
    def attach(cls, name: str, *, pin: bool = False) -> Ring:
        """The ring ``name`` as a producer sees it (never unlinks it).

        With ``pin`` (a producer whose target runs on CUDA) the segment is page-locked in this process
        (:func:`dflash.io.shm.pin_host_range`), so the runner's device-to-host copies land in the slots
        asynchronously, without a staging buffer; ``pinned`` says whether it took.

        Raises:
            FileNotFoundError: no such segment (the trainer ended and removed it).
            QueueError: not a ring, or a ring of another format version.
        """
        shm = attach_segment(name)
        raw = bytes(shm.buf[: _RING_HEADER.size])
        magic, version, num_slots, slot_bytes, max_tokens, max_documents, width, code = _RING_HEADER.unpack(raw)
        if magic != _RING_MAGIC or version != QUEUE_FORMAT_VERSION:
            close_segment(shm, unlink=False)
            raise QueueError(
                f"shared-memory segment {name} is not an online queue of format version {QUEUE_FORMAT_VERSION} "
                f"(magic {magic!r}, version {version}); producers and trainer must run the same dflash-stages"
            )
        geometry = RingGeometry(num_slots=num_slots, max_tokens=max_tokens, max_documents=max_documents, width=width,
                                dtype=_DTYPES[code])  # fmt: skip
        assert geometry.slot_bytes == slot_bytes, "slot size rule changed without a format version bump"
        ring = cls(shm, geometry, owner=False)
        if pin:
            ring.pinned = pin_host_range(ring._buffer.ctypes.data, geometry.nbytes)
        return ring

    def close(self) -> None:
        """Unmap the segment; the owner also removes it (idempotent). Wakes any thread blocked in :meth:`acquire`."""
        self.stop()
        with self._condition:  # a release() callback of a cancelled producer task may run concurrently
            if self.shm is None:
                return
            shm, self.shm = self.shm, None
            if self.pinned:
                unpin_host_range(self._buffer.ctypes.data)
                self.pinned = False
            self._buffer = None  # type: ignore[assignment]
        close_segment(shm, unlink=self.owner)

    def __del__(self) -> None:  # a ring dropped without close(): unmap before the segment object is collected
        if getattr(self, "shm", None) is not None:
            self.close()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- owner: hand-out and release --------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> tuple[int, int] | None:
        """A free slot and its new ticket, marked CLAIMED; blocks while the ring is full.

        Returns ``None`` after ``timeout`` seconds without a free slot, or once :meth:`stop` was called."""
        with self._condition:
            if not self._condition.wait_for(lambda: self._free or self._stopped, timeout=timeout):
                return None
            if self._stopped:
                return None
            slot = self._free.pop(0)
            ticket = self._next_ticket
            self._next_ticket += 1
        self._write_header(slot, state=_STATE_CLAIMED, ticket=ticket)
        return slot, ticket

    def release(self, slot: int) -> None:
        """Give ``slot`` back (its batch was copied out, or its producer's task ended without it being read); a no-op
        once the ring is closed."""
        with self._condition:
            if self.shm is None:
                return
            self._write_header(slot, state=_STATE_FREE, ticket=0)
            assert slot not in self._free, f"slot {slot} released twice"
            self._free.append(slot)
            self._condition.notify()

    def stop(self) -> None:
        """Make every current and later :meth:`acquire` return ``None`` (shutdown of the dispatcher)."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()

    def restart(self) -> None:
        """Undo :meth:`stop` (a new dispatcher takes over; slots still held stay held)."""
        with self._condition:
            self._stopped = False

    @property
    def num_free(self) -> int:
        with self._condition:
            return len(self._free)

    # ---- slots --------------------------------------------------------------------------------------------------

    def _slot_start(self, slot: int) -> int:
        if not 0 <= slot < self.geometry.num_slots:
            raise QueueError(f"slot {slot} is outside the ring {self.name} of {self.geometry.num_slots} slots")
        return _RING_HEADER_BYTES + slot * self.geometry.slot_bytes

    def _write_header(self, slot: int, *, state: int, ticket: int, epoch: int = 0, batch_index: int = 0,
                      num_documents: int = 0, bucket: int = -1, num_tokens: int = 0, payload_bytes: int = 0,
                      crc: int = 0) -> None:  # fmt: skip
        start = self._slot_start(slot)
        header = SLOT_HEADER.pack(_SLOT_MAGIC, QUEUE_FORMAT_VERSION, state, ticket, epoch, batch_index, num_documents,
                                  _DTYPE_CODES[self.geometry.dtype], self.geometry.width, bucket, num_tokens,
                                  payload_bytes, crc)  # fmt: skip
        self._buffer[start : start + len(header)] = np.frombuffer(header, dtype=np.uint8)

    def header(self, slot: int) -> dict[str, Any]:
        """The slot's header fields (for tests and diagnostics)."""
        start = self._slot_start(slot)
        fields = SLOT_HEADER.unpack(self._buffer[start : start + SLOT_HEADER.size].tobytes())
        names = ("magic", "version", "state", "ticket", "epoch", "batch_index", "num_documents", "dtype_code", "width",
                 "bucket", "num_tokens", "payload_bytes", "crc32c")  # fmt: skip
        return dict(zip(names, fields, strict=True))

    def write_batch(self, slot: int, ticket: int, *, epoch: int, batch_index: int, bucket: int,
                    corpus_rows: np.ndarray, input_ids: list[np.ndarray], loss_mask: list[np.ndarray],
                    hidden: list[torch.Tensor]) -> int:  # fmt: skip
        """Producer: write one planned batch into ``slot`` (payload first, header with state FULL last):
        :meth:`begin_batch`, each document's hidden states copied into its view, :meth:`commit_batch`.

        Args:
            slot, ticket, epoch, batch_index, bucket, corpus_rows, input_ids, loss_mask: as :meth:`begin_batch`.
            hidden: per document ``[L, W]`` tensors of the ring's dtype (CPU).

        Returns:
            The payload bytes written.

        Raises:
            QueueError: as :meth:`begin_batch`, or hidden states of another dtype or width than the ring's.
        """
        write = self.begin_batch(slot, ticket, epoch=epoch, batch_index=batch_index, bucket=bucket,
                                 corpus_rows=corpus_rows, input_ids=input_ids, loss_mask=loss_mask)  # fmt: skip
        for part, view in zip(hidden, write.documents, strict=True):
            self.check_hidden(part, batch_index)
            view.copy_(part)
        return self.commit_batch(write)

    def check_hidden(self, hidden: torch.Tensor, batch_index: int) -> None:
        """Refuse hidden states of another dtype or width than the ring's (``QueueError`` naming both)."""
        if hidden.dtype != self.geometry.dtype or hidden.shape[-1] != self.geometry.width:
            raise QueueError(f"batch {batch_index}: hidden states {tuple(hidden.shape)} {hidden.dtype}; the ring "
                             f"carries [L, {self.geometry.width}] {self.geometry.dtype}")

    def begin_batch(self, slot: int, ticket: int, *, epoch: int, batch_index: int, bucket: int,
                    corpus_rows: np.ndarray, input_ids: list[np.ndarray],
                    loss_mask: list[np.ndarray]) -> SlotWrite:  # fmt: skip
        """Producer: the views of ``slot`` a planned batch's hidden states are to be copied into
        (:class:`SlotWrite`); :meth:`commit_batch` then writes the rest of the payload and the header.

        The rows, lengths, ids and masks are written at the commit, after the claim is checked again: a producer
        whose slot was taken from it meanwhile (its task cancelled, the slot handed to another batch) then writes
        only hidden states, which the later batch's own copies, queued after them on the same copy stream of the
        same producer, overwrite.

        Args:
            slot, ticket: as handed out by the owner's :meth:`acquire` (the slot must still be CLAIMED by it).
            epoch, batch_index: the batch's place in the plan (checked by the reader).
            bucket: the batch's length bucket.
            corpus_rows: ``[D]`` corpus row of each document, in plan order.
            input_ids, loss_mask: per document ``[L]`` integer arrays (ids, 0/1 mask).

        Raises:
            QueueError: the slot is not claimed by ``ticket`` (handed to another producer, or released), or the batch
                does not fit the ring's geometry.
        """
        geometry = self.geometry
        start = self._slot_start(slot)
        self._check_claim(slot, ticket)
        lengths = np.asarray([len(ids) for ids in input_ids], dtype=np.int64)
        num_documents, num_tokens = int(lengths.size), int(lengths.sum())
        if num_documents > geometry.max_documents or num_tokens > geometry.max_tokens:
            raise QueueError(f"batch {batch_index} of epoch {epoch}: {num_documents} documents, {num_tokens} tokens "
                             f"exceed the ring's {geometry.max_documents} documents, {geometry.max_tokens} tokens")
        metadata = [np.asarray(corpus_rows, dtype="<i8"), lengths.astype("<i8"),
                    np.concatenate([np.asarray(part) for part in input_ids]).astype("<i4", copy=False),
                    np.concatenate([np.asarray(part) for part in loss_mask]).astype(np.uint8, copy=False)]
        offset = _hidden_offset(num_documents, num_tokens)
        nbytes = offset + num_tokens * geometry.width * geometry.dtype.itemsize
        payload = self._buffer[start + _SLOT_HEADER_BYTES : start + _SLOT_HEADER_BYTES + nbytes]
        hidden = torch.from_numpy(payload[offset:]).view(geometry.dtype).view(num_tokens, geometry.width)
        return SlotWrite(slot=slot, ticket=ticket, epoch=epoch, batch_index=batch_index, bucket=bucket,
                         num_documents=num_documents, num_tokens=num_tokens, payload_bytes=nbytes, hidden=hidden,
                         documents=list(hidden.split(lengths.tolist())), metadata=metadata)  # fmt: skip

    def commit_batch(self, write: SlotWrite) -> int:
        """Producer: finish a :meth:`begin_batch` whose hidden states are in place: the claim checked again, the
        rows, lengths, ids and masks written, the payload's CRC-32C, then the header with state FULL. Returns the
        payload bytes.

        Raises:
            QueueError: the slot is no longer claimed by the write's ticket (the trainer gave it to another batch
                meanwhile); nothing is written.
        """
        self._check_claim(write.slot, write.ticket)
        start = self._slot_start(write.slot) + _SLOT_HEADER_BYTES
        payload = self._buffer[start : start + write.payload_bytes]
        cursor = 0
        for array in write.metadata:
            payload[cursor : cursor + array.nbytes] = array.view(np.uint8)
            cursor += array.nbytes
        payload[cursor : _hidden_offset(write.num_documents, write.num_tokens)] = 0
        crc = _crc32c(payload)
        self._write_header(write.slot, state=_STATE_FULL, ticket=write.ticket, epoch=write.epoch,
                           batch_index=write.batch_index, num_documents=write.num_documents, bucket=write.bucket,
                           num_tokens=write.num_tokens, payload_bytes=write.payload_bytes, crc=crc)  # fmt: skip
        return write.payload_bytes

    def _check_claim(self, slot: int, ticket: int) -> None:
        """Raise ``QueueError`` unless ``slot`` is claimed by ``ticket`` (or FULL with it: a retry of the same task,
        whose first producer died after writing the header)."""
        current = self.header(slot)
        if current["state"] not in (_STATE_CLAIMED, _STATE_FULL) or current["ticket"] != ticket:
            raise QueueError(
                f"slot {slot} of ring {self.name} is not claimed by ticket {ticket} (state {current['state']}, ticket "
                f"{current['ticket']}): the trainer gave it to another batch; this producer's batch is dropped"
            )

    def read_batch(self, slot: int, ticket: int, *, epoch: int, batch_index: int,
                   out: np.ndarray | None = None) -> SlotBatch:  # fmt: skip
        """Owner: copy the batch out of ``slot`` and verify it (the slot is NOT released here).

        ``out``: a ``uint8`` array of at least ``geometry.payload_capacity`` bytes the private copy goes into
        (reused from batch to batch, its pages are faulted in once); the :class:`SlotBatch`'s tensors are then views
        of it, valid until it is written again. ``None``: a new array per batch.

        Raises:
            QueueError: wrong magic or format version, not FULL, another ticket, another batch than expected, or a
                payload whose CRC-32C differs from the header's (names the slot, both values and what to do).
        """
        head = self.header(slot)
        where = f"slot {slot} of ring {self.name}"
        if head["magic"] != _SLOT_MAGIC or head["version"] != QUEUE_FORMAT_VERSION:
            raise QueueError(f"{where}: format version {head['version']} (magic {head['magic']!r}), expected "
                             f"{QUEUE_FORMAT_VERSION}; producers and trainer must run the same dflash-stages")
        if head["state"] != _STATE_FULL or head["ticket"] != ticket:
            raise QueueError(f"{where}: state {head['state']} ticket {head['ticket']}, expected a full slot of ticket "
                             f"{ticket}; the producer's task ended without writing its batch")
        if (head["epoch"], head["batch_index"]) != (epoch, batch_index):
            raise QueueError(f"{where}: holds batch {head['batch_index']} of epoch {head['epoch']}, expected batch "
                             f"{batch_index} of epoch {epoch}")
        if head["dtype_code"] != _DTYPE_CODES[self.geometry.dtype] or head["width"] != self.geometry.width:
            raise QueueError(f"{where}: dtype code {head['dtype_code']} width {head['width']} differ from the ring's")
        start = self._slot_start(slot) + _SLOT_HEADER_BYTES
        nbytes = int(head["payload_bytes"])
        if nbytes > self.geometry.payload_capacity:
            raise QueueError(f"{where}: payload of {nbytes} bytes exceeds the slot's {self.geometry.payload_capacity}")
        # The private copy that is checked and read: numpy copies without holding the GIL, so the trainer's other
        # threads (and producers running as threads of the same process) go on meanwhile.
        if out is None:
            private = np.empty(nbytes, dtype=np.uint8)
        elif out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or out.size < nbytes:
            raise ValueError(f"out: expected a contiguous uint8 array of at least {nbytes} bytes, got {out.dtype} "
                             f"{out.shape}")
        else:
            private = out[:nbytes]
        np.copyto(private, self._buffer[start : start + nbytes])
        crc = _crc32c(private)
        if crc != head["crc32c"]:
            raise QueueError(f"{where}: payload CRC-32C {crc:#010x} differs from the header's {head['crc32c']:#010x} "
                             f"(batch {batch_index} of epoch {epoch}); the slot was overwritten or corrupted")
        return self._unpack(private, head, where, epoch=epoch, batch_index=batch_index)

    def _unpack(self, view: np.ndarray, head: dict[str, Any], where: str, *, epoch: int, batch_index: int) -> SlotBatch:
        nbytes = int(head["payload_bytes"])
        num_documents, num_tokens = int(head["num_documents"]), int(head["num_tokens"])
        cursor = 0
        corpus_rows = view[cursor : cursor + 8 * num_documents].view("<i8").astype(np.int64)
        cursor += 8 * num_documents
        lengths = view[cursor : cursor + 8 * num_documents].view("<i8").astype(np.int64)
        cursor += 8 * num_documents
        input_ids = torch.from_numpy(view[cursor : cursor + 4 * num_tokens].view("<i4"))
        cursor += 4 * num_tokens
        loss_mask = torch.from_numpy(view[cursor : cursor + num_tokens])
        offset = _hidden_offset(num_documents, num_tokens)
        hidden = torch.from_numpy(view[offset:nbytes]).view(self.geometry.dtype).view(num_tokens, self.geometry.width)
        if int(lengths.sum()) != num_tokens:
            raise QueueError(f"{where}: document lengths sum to {int(lengths.sum())}, header says {num_tokens} tokens")
        return SlotBatch(corpus_rows=corpus_rows, lengths=lengths, input_ids=input_ids, loss_mask=loss_mask,
                         hidden=hidden, epoch=epoch, batch_index=batch_index, bucket=int(head["bucket"]))  # fmt: skip
