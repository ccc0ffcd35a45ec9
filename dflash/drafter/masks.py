"""Attention layout of a DFlash training step: all blocks of a packed batch as ONE query sequence.

Queries: the A*B block tokens (block j = rows j*B .. j*B+B-1). Keys: ``[context (T packed positions); block tokens
(A*B)]``. Query rows of block j (anchor a_j, document start s_j = a_j - position_ids[a_j]) see

* context keys ``s_j <= t < a_j`` (same document, strictly before the anchor: the anchor's own target state would
  leak the next token), and
* the B keys of their own block (bidirectional inside the block), nothing of other blocks.

Each row therefore sees two contiguous key intervals. That makes the FlexAttention ``BlockMask`` cheap to build
without evaluating the mask on all Q x KV pairs: per 128-row query tile and 128-key tile, "touched" and "fully
covered" follow from interval arithmetic on ``[Q, num_kv_tiles]`` tensors, with no host synchronization, so the
same code runs inside ``torch.compile`` (DFlash paper arXiv 2602.06036 section 3.2: one sparse mask over all
blocks). Padding anchors (index -1, fixed-shape path) see only their own block.

On CPU :func:`dense_attention_mask` gives the same mask as a ``[Q, KV]`` boolean tensor for SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionLayout", "attention_layout", "dense_attention_mask", "flex_block_mask", "TILE"]

#: FlexAttention's default tile (rows and columns of one sparse block).
TILE = 128


@dataclass(kw_only=True)
class AttentionLayout:
    """Per-query-row visible key intervals. Q = A*B query rows, KV = T + A*B keys.

    Attributes:
        context_lo, context_hi: ``[Q]`` int64, visible context keys ``[lo, hi)`` (empty when ``lo == hi``).
        block_lo: ``[Q]`` int64, first key of the row's own block; its block keys are ``[block_lo, block_lo + B)``.
        num_queries, num_keys, block_size: sizes.
    """

    context_lo: torch.Tensor
    context_hi: torch.Tensor
    block_lo: torch.Tensor
    num_queries: int
    num_keys: int
    block_size: int


def attention_layout(anchors: torch.Tensor, position_ids: torch.Tensor, block_size: int) -> AttentionLayout:
    """Layout for ``anchors`` ``[A]`` (flat indices into the packed batch, -1 = padding slot) over a packed batch
    whose ``position_ids`` ``[T]`` restart at 0 for each document."""
    num_tokens = position_ids.shape[0]
    num_anchors = anchors.shape[0]
    valid = anchors >= 0
    safe = anchors.clamp(min=0)
    start = safe - position_ids[safe]
    hi = torch.where(valid, safe, torch.zeros_like(safe))
    lo = torch.where(valid, start, torch.zeros_like(safe))
    block_lo = num_tokens + torch.arange(num_anchors, device=anchors.device, dtype=torch.int64) * block_size

    def expand(x: torch.Tensor) -> torch.Tensor:  # [A] -> [A*B] (expand, not repeat_interleave: no host sync)
        return x[:, None].expand(num_anchors, block_size).reshape(-1)

    return AttentionLayout(
        context_lo=expand(lo),
        context_hi=expand(hi),
        block_lo=expand(block_lo),
        num_queries=num_anchors * block_size,
        num_keys=num_tokens + num_anchors * block_size,
        block_size=block_size,
    )


def dense_attention_mask(layout: AttentionLayout) -> torch.Tensor:
    """``[Q, KV]`` boolean mask (True = may attend) for ``scaled_dot_product_attention``."""
    keys = torch.arange(layout.num_keys, device=layout.context_lo.device)[None, :]
    in_context = (keys >= layout.context_lo[:, None]) & (keys < layout.context_hi[:, None])
    in_block = (keys >= layout.block_lo[:, None]) & (keys < layout.block_lo[:, None] + layout.block_size)
    return in_context | in_block


def _pad_rows(x: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0],), value)])


def flex_block_mask(layout: AttentionLayout):
    """FlexAttention ``BlockMask`` equal to :func:`dense_attention_mask` (built once per step, shared by layers).

    Cost: O(Q * KV / TILE) integer ops on the device, no host sync. Tiles fully inside one interval for every row
    are marked "full" (no mask_mod evaluated); others that touch an interval are "partial".
    """
    from torch.nn.attention.flex_attention import BlockMask

    num_q_tiles = -(-layout.num_queries // TILE)
    num_kv_tiles = -(-layout.num_keys // TILE)
    rows = num_q_tiles * TILE
    # Padded query rows see nothing (empty intervals); they are outside Q_LEN and never computed.
    lo = _pad_rows(layout.context_lo, rows, 0)
    hi = _pad_rows(layout.context_hi, rows, 0)
    blo = _pad_rows(layout.block_lo, rows, 0)
    bhi = _pad_rows(layout.block_lo + layout.block_size, rows, 0)

    tile_start = torch.arange(num_kv_tiles, device=lo.device, dtype=torch.int64)[None, :] * TILE
    tile_end = (tile_start + TILE).clamp(max=layout.num_keys)

    def touches(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [rows, kv_tiles]
        return (a[:, None] < tile_end) & (b[:, None] > tile_start) & (b > a)[:, None]

    def covers(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a[:, None] <= tile_start) & (b[:, None] >= tile_end)

    real_row = (torch.arange(rows, device=lo.device) < layout.num_queries)[:, None]
    any_touch = (touches(lo, hi) | touches(blo, bhi)) & real_row
    full_cover = covers(lo, hi) | covers(blo, bhi) | ~real_row
    any_touch = any_touch.view(num_q_tiles, TILE, num_kv_tiles).any(dim=1)
    full = full_cover.view(num_q_tiles, TILE, num_kv_tiles).all(dim=1) & any_touch
    partial = any_touch & ~full

    def to_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = tiles.sum(dim=-1, dtype=torch.int32)
        indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], indices[None, None]

    kv_num, kv_idx = to_indices(partial)
    full_num, full_idx = to_indices(full)
    q_lo, q_hi, q_blo = lo, hi, blo
    block_size = layout.block_size

    def mask_mod(b, h, q_idx, kv_idx):
        in_context = (kv_idx >= q_lo[q_idx]) & (kv_idx < q_hi[q_idx])
        in_block = (kv_idx >= q_blo[q_idx]) & (kv_idx < q_blo[q_idx] + block_size)
        return in_context | in_block

    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(layout.num_queries, layout.num_keys),
    )
