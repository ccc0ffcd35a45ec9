"""Packed training batches (contract between the stream, the drafter and the trainer).

:class:`PackedBatch` is the one container every consumer sees; :func:`pack_samples` builds it from cache samples
(``HiddenSample``: ``input_ids [L]``, ``loss_mask [L]``, ``hidden [L, n*H]``, ``corpus_row``). Which samples go
together is decided by :mod:`dflash.batches.buckets`; streaming them from a cache is :mod:`dflash.batches.stream`.
Legend: T = tokens in the packed batch, D = documents, L = one document's length, n*H = concatenated taps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["PackedBatch", "pack_samples"]


@dataclass(kw_only=True)
class PackedBatch:
    """Several documents packed into one flat token sequence of length T.

    Padding (fixed-shape/compile path) is appended at the end with ``loss_mask`` 0 and ``document_ids`` -1.

    Attributes:
        input_ids: ``[T]`` int64 token ids.
        loss_mask: ``[T]`` uint8, 1 where this token is supervised.
        hidden: ``[T, n*H]`` bfloat16, the target's tapped hidden states, taps concatenated in layer-id order.
        position_ids: ``[T]`` int64, position inside its document, from 0.
        document_ids: ``[T]`` int64, 0..D-1, -1 on padding.
        cu_seqlens: ``[D+1]`` int64, cumulative document lengths (document d spans cu[d]:cu[d+1]).
        num_real_tokens: number of non-padding tokens (= ``cu_seqlens[-1]``).
        corpus_rows: the corpus row of each document, in order.
        bucket_id: the length bucket the batch was drawn from (:mod:`dflash.batches.buckets`), -1 when unknown.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    num_real_tokens: int
    corpus_rows: list[int] = field(default_factory=list)
    bucket_id: int = -1

    _TENSOR_FIELDS = ("input_ids", "loss_mask", "hidden", "position_ids", "document_ids", "cu_seqlens")

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Return a copy with every tensor on ``device`` (``non_blocking`` copies from pinned memory)."""
        return replace(
            self,
            **{
                name: getattr(self, name).to(device, non_blocking=non_blocking)
                for name in self._TENSOR_FIELDS
            },
        )

    def pin_memory(self) -> PackedBatch:
        """Return a copy with every tensor in pinned (page-locked) host memory."""
        return replace(self, **{name: getattr(self, name).pin_memory() for name in self._TENSOR_FIELDS})

    @property
    def num_tokens(self) -> int:
        """T, including padding."""
        return int(self.input_ids.shape[0])

    @property
    def num_documents(self) -> int:
        """D, the number of packed documents."""
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def num_padding_tokens(self) -> int:
        """Padding tokens appended at the end (T - num_real_tokens)."""
        return self.num_tokens - self.num_real_tokens

    def is_pinned(self) -> bool:
        """True when every tensor lives in pinned host memory."""
        return all(getattr(self, name).is_pinned() for name in self._TENSOR_FIELDS)


def pack_samples(
    samples: Sequence[Any],
    *,
    pad_to: int | None = None,
    bucket_id: int = -1,
    pin_memory: bool = False,
) -> PackedBatch:
    """Concatenate cache samples into one :class:`PackedBatch`, padding at the end to ``pad_to`` tokens.

    Args:
        samples: objects with ``corpus_row: int``, ``input_ids [L]`` (any integer dtype), ``loss_mask [L]`` (0/1),
            ``hidden [L, n*H]`` bfloat16 (``dflash.cache.HiddenSample``); at least one, all with the same n*H.
        pad_to: total length T after padding (padding: token id 0, loss_mask 0, position 0, document id -1,
            hidden zeros); ``None`` packs without padding.
        bucket_id: recorded on the batch for per-bucket logging.
        pin_memory: allocate the batch directly in pinned host memory (needs CUDA).

    Returns:
        A :class:`PackedBatch` whose documents are ``samples`` in order.

    Raises:
        ValueError: no samples, a sample with inconsistent lengths or width, or ``pad_to`` below the real length.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample; got an empty list")
    lengths = [int(sample.input_ids.shape[0]) for sample in samples]
    width = int(samples[0].hidden.shape[-1])
    for sample, length in zip(samples, lengths, strict=True):
        if sample.loss_mask.shape[0] != length or sample.hidden.shape != (length, width):
            raise ValueError(
                f"corpus row {sample.corpus_row}: expected input_ids [L], loss_mask [L], hidden [L, {width}] with "
                f"L={length}; got loss_mask {tuple(sample.loss_mask.shape)}, hidden {tuple(sample.hidden.shape)}; "
                "the cache is inconsistent: run `dflash-stages cache verify`"
            )
    num_real = sum(lengths)
    total = num_real if pad_to is None else int(pad_to)
    if total < num_real:
        raise ValueError(f"pad_to={pad_to} is below the {num_real} real tokens of the batch; raise pad_to")

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

    input_ids = empty((total,), torch.int64)
    loss_mask = empty((total,), torch.uint8)
    hidden = empty((total, width), samples[0].hidden.dtype)
    torch.cat([torch.as_tensor(s.input_ids).to(torch.int64) for s in samples], out=input_ids[:num_real])
    torch.cat([torch.as_tensor(s.loss_mask).to(torch.uint8) for s in samples], out=loss_mask[:num_real])
    torch.cat([s.hidden for s in samples], out=hidden[:num_real])
    length_tensor = torch.tensor(lengths, dtype=torch.int64)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(length_tensor, 0, out=cu_seqlens[1:])
    document_ids = torch.full((total,), -1, dtype=torch.int64)
    document_ids[:num_real] = torch.repeat_interleave(torch.arange(len(lengths)), length_tensor)
    position_ids = torch.zeros(total, dtype=torch.int64)
    position_ids[:num_real] = torch.arange(num_real) - torch.repeat_interleave(cu_seqlens[:-1], length_tensor)
    if total > num_real:
        input_ids[num_real:] = 0
        loss_mask[num_real:] = 0
        hidden[num_real:] = 0
    if pin_memory:
        cu_seqlens, document_ids, position_ids = (
            t.pin_memory() for t in (cu_seqlens, document_ids, position_ids)
        )
    return PackedBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        hidden=hidden,
        position_ids=position_ids,
        document_ids=document_ids,
        cu_seqlens=cu_seqlens,
        num_real_tokens=num_real,
        corpus_rows=[int(s.corpus_row) for s in samples],
        bucket_id=bucket_id,
    )
