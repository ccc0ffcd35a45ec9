"""Anchor sampling for DFlash training (arXiv 2602.06036 section 4.2: random anchors, a fixed budget per sequence,
re-sampled every epoch; random anchors beat a fixed block split).

A position ``a`` of a packed batch is a valid anchor when the token after it is supervised (``loss_mask[a+1] == 1``)
and the whole block ``a .. a+B-1`` lies inside one document. Each document keeps a uniformly random subset of
``min(budget, #valid)`` of its valid anchors (sampling without replacement).

Both paths share one algorithm and consume the generator identically, so for the same generator state they return
the SAME anchors (when the fixed shape has room for them all):

* dynamic (eager): ``torch.nonzero`` of the selection; ``A`` varies per batch; one host sync.
* fixed-shape (``num_anchors=`` given, for torch.compile): exactly ``num_anchors`` slots, sorted, ``-1`` padding
  at the end, no host sync. Size it as ``max_anchors_per_document * max documents per length bucket``; if more
  anchors are selected than slots, a uniformly random subset of them is kept.

Selection is a random permutation per document done as a sort of ``document_id + u`` (``u`` uniform in [0, 1),
float64), which is the vectorised equivalent of a per-document ``randperm``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash.errors import ConfigError

if TYPE_CHECKING:
    from dflash.batches.packed import PackedBatch

__all__ = ["sample_anchors", "valid_anchor_mask"]


def valid_anchor_mask(batch: PackedBatch, block_size: int) -> torch.Tensor:
    """``[T]`` bool: ``loss_mask[a+1] == 1`` and ``a .. a+B-1`` inside one (non-padding) document."""
    documents = batch.document_ids
    num_tokens = documents.shape[0]
    next_supervised = torch.zeros(num_tokens, dtype=torch.bool, device=documents.device)
    next_supervised[:-1] = batch.loss_mask[1:] > 0
    end_document = torch.full_like(documents, -2)
    if block_size - 1 < num_tokens:
        end_document[: num_tokens - block_size + 1] = documents[block_size - 1:]
    return next_supervised & (documents >= 0) & (end_document == documents)


def sample_anchors(
    batch: PackedBatch,
    block_size: int,
    max_anchors_per_document: int,
    generator: torch.Generator,
    *,
    num_anchors: int | None = None,
) -> torch.Tensor:
    """Sample training anchors.

    Args:
        batch: packed batch (``loss_mask``, ``document_ids`` ``[T]``, ``cu_seqlens`` ``[D+1]``).
        block_size: B.
        max_anchors_per_document: anchor budget per document (paper: 512 per sequence).
        generator: seeded ``torch.Generator`` (seed it from (seed, epoch, step) to re-sample each epoch). A
            generator on the batch's device avoids a host round trip.
        num_anchors: ``None`` for the dynamic path; an int for the fixed-shape path (output length).

    Returns:
        ``[A]`` int64 flat indices into T, ascending; fixed-shape: ``[num_anchors]`` with ``-1`` padding at the end.

    Raises:
        ConfigError: ``block_size < 2``, ``max_anchors_per_document < 1`` or ``num_anchors < 1``.
    """
    if block_size < 2:
        raise ConfigError(f"sample_anchors: block_size must be >= 2, got {block_size}")
    if max_anchors_per_document < 1:
        raise ConfigError(f"sample_anchors: max_anchors_per_document must be >= 1, got {max_anchors_per_document}")
    if num_anchors is not None and num_anchors < 1:
        raise ConfigError(f"sample_anchors: num_anchors must be >= 1 or None, got {num_anchors}")
    device = batch.document_ids.device
    num_tokens = batch.document_ids.shape[0]
    num_documents = batch.cu_seqlens.shape[0] - 1
    valid = valid_anchor_mask(batch, block_size)
    # Two independent draws: ``order_keys`` ranks anchors inside a document, ``cap_keys`` picks the subset kept
    # when the fixed shape is too small. Both paths draw both, so they consume the generator identically.
    order_keys = torch.rand(num_tokens, generator=generator, device=generator.device, dtype=torch.float64).to(device)
    cap_keys = torch.rand(num_tokens, generator=generator, device=generator.device, dtype=torch.float64).to(device)

    documents = batch.document_ids.clamp(min=0)
    sort_key = torch.where(valid, documents.to(torch.float64) + order_keys, torch.full_like(order_keys, float("inf")))
    order = torch.sort(sort_key).indices  # valid positions grouped by document, random order inside a group
    per_document = torch.zeros(max(num_documents, 1), dtype=torch.int64, device=device)
    per_document.index_add_(0, documents, valid.to(torch.int64))
    group_start = torch.cumsum(per_document, 0) - per_document
    sorted_rank = torch.arange(num_tokens, device=device) - group_start[documents[order]]
    # scatter rather than index assignment: no host synchronization on CUDA.
    selected = torch.zeros(num_tokens, dtype=torch.bool, device=device).scatter(
        0, order, valid[order] & (sorted_rank < max_anchors_per_document))

    if num_anchors is None:
        return torch.nonzero(selected).squeeze(1)

    # Fixed shape: keep at most num_anchors of the selected (uniformly random by cap_keys), sorted by position.
    cap_key = torch.where(selected, cap_keys, torch.full_like(cap_keys, float("inf")))
    width = max(num_tokens, num_anchors)
    if width > num_tokens:
        cap_key = torch.cat([cap_key, cap_key.new_full((width - num_tokens,), float("inf"))])
    kept_keys, kept = torch.topk(cap_key, num_anchors, largest=False, sorted=False)
    kept = torch.where(torch.isfinite(kept_keys), kept, torch.full_like(kept, num_tokens))
    kept = torch.sort(kept).values
    return torch.where(kept < num_tokens, kept, torch.full_like(kept, -1))
