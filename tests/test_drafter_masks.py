"""Attention masks: the FlexAttention BlockMask built by interval arithmetic equals the dense CPU mask."""

from __future__ import annotations

import pytest
import torch
from drafter_fixtures import packed_batch, random_anchors, tiny_drafter

from dflash.drafter import attention_layout, dense_attention_mask, flex_block_mask
from dflash.drafter.masks import TILE


def _layout(seed: int, lengths: list[int], block_size: int, count: int, padding_slots: int = 0):
    batch = packed_batch(lengths, width=8, vocab=50, seed=seed, padding=7)
    anchors = random_anchors(batch, block_size, count=count, seed=seed)
    anchors = torch.cat([anchors, torch.full((padding_slots,), -1)])
    return batch, anchors, attention_layout(anchors, batch.position_ids, block_size)


def test_dense_mask_semantics():
    """Each block row sees its document's context strictly before its anchor, plus its own block only."""
    batch, anchors, layout = _layout(0, [40, 25, 60], 4, 20, padding_slots=2)
    mask = dense_attention_mask(layout)
    num_tokens = batch.num_tokens
    for j, anchor in enumerate(anchors.tolist()):
        rows = mask[j * 4:(j + 1) * 4]
        assert torch.equal(rows, rows[:1].expand_as(rows))  # bidirectional inside the block: same for each row
        context = rows[0, :num_tokens]
        blocks = rows[0, num_tokens:].view(-1, 4)
        assert blocks[j].all() and blocks.sum() == 4
        if anchor < 0:
            assert not context.any()
            continue
        expected = (batch.document_ids == batch.document_ids[anchor]) & (torch.arange(num_tokens) < anchor)
        assert torch.equal(context, expected)


@pytest.mark.parametrize(("seed", "block_size", "lengths"), [
    (0, 4, [40, 25, 60]), (1, 16, [300, 129, 77]), (2, 10, [500]), (3, 8, [128, 128, 256]),
])
def test_block_mask_tiles_and_mask_mod_match_dense(seed, block_size, lengths):
    """Tile occupancy: a tile is listed iff the dense mask has a True in it; a "full" tile is all True;
    mask_mod evaluated on every (q, kv) pair equals the dense mask."""
    _, _, layout = _layout(seed, lengths, block_size, count=60, padding_slots=3)
    dense = dense_attention_mask(layout)
    block_mask = flex_block_mask(layout)
    q_len, kv_len = dense.shape
    q_tiles, kv_tiles = -(-q_len // TILE), -(-kv_len // TILE)
    padded = torch.zeros(q_tiles * TILE, kv_tiles * TILE, dtype=torch.bool)
    padded[:q_len, :kv_len] = dense
    tiles = padded.view(q_tiles, TILE, kv_tiles, TILE)
    any_true = tiles.any(dim=3).any(dim=1)
    valid = torch.zeros_like(padded)
    valid[:q_len, :kv_len] = True
    all_true = (tiles | ~valid.view_as(tiles)).all(dim=3).all(dim=1) & any_true

    def occupancy(num, idx):
        out = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool)
        for q in range(q_tiles):
            out[q, idx[0, 0, q, : num[0, 0, q]].long()] = True
        return out

    partial = occupancy(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = occupancy(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    assert not (partial & full).any()
    assert torch.equal(partial | full, any_true)
    assert (all_true | ~full).all()  # every full tile really is all True
    q_idx = torch.arange(q_len)[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    assert torch.equal(block_mask.mask_mod(0, 0, q_idx, kv_idx), dense)


@pytest.mark.gpu
def test_flex_attention_path_equals_dense_path_on_cuda():
    drafter = tiny_drafter(0, dtype=torch.float32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=256, block_size=16).cuda()
    batch = packed_batch([700, 300, 213], width=256, vocab=97, dtype=torch.float32, padding=11).to("cuda")
    anchors = random_anchors(batch.to("cpu"), 16, count=100).cuda()
    with torch.no_grad():
        flex = drafter.forward_train(batch, anchors)  # BlockMask on CUDA
        layout = attention_layout(anchors, batch.position_ids, 16)
        dense = drafter.forward_train(batch, anchors, mask=dense_attention_mask(layout))
    torch.testing.assert_close(flex, dense, rtol=2e-3, atol=2e-3)
