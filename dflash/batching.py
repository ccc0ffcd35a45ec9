"""Packed training batches (contract between the stream, the drafter and the trainer).

Only the :class:`PackedBatch` container lives here for now; length buckets and token-budget batching are added by
the batching component (issue 5). Legend: T = tokens in the packed batch, D = documents, n*H = concatenated taps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

__all__ = ["PackedBatch"]


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
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    num_real_tokens: int
    corpus_rows: list[int] = field(default_factory=list)

    _TENSOR_FIELDS = ("input_ids", "loss_mask", "hidden", "position_ids", "document_ids", "cu_seqlens")

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Return a copy with every tensor on ``device`` (``non_blocking`` copies from pinned memory)."""
        return replace(
            self, **{name: getattr(self, name).to(device, non_blocking=non_blocking) for name in self._TENSOR_FIELDS}
        )

    def pin_memory(self) -> PackedBatch:
        """Return a copy with every tensor in pinned (page-locked) host memory."""
        return replace(self, **{name: getattr(self, name).pin_memory() for name in self._TENSOR_FIELDS})

    @property
    def num_tokens(self) -> int:
        """T, including padding."""
        return int(self.input_ids.shape[0])
