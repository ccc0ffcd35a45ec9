"""Anchor sampling: validity, per-document budget, uniformity, fixed-shape path == dynamic path."""

from __future__ import annotations

import pytest
import torch
from drafter_fixtures import packed_batch

from dflash.drafter import sample_anchors, valid_anchor_mask
from dflash.errors import ConfigError


def _brute_force_valid(batch, block_size):
    out = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for a in range(batch.num_tokens - block_size + 1):
        document = int(batch.document_ids[a])
        out[a] = (document >= 0 and bool(batch.loss_mask[a + 1])
                  and int(batch.document_ids[a + block_size - 1]) == document)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_valid_anchor_mask_matches_definition(seed):
    batch = packed_batch([20, 3, 17, 33][: seed + 1], width=4, vocab=50, seed=seed, padding=seed * 3,
                         supervised_fraction=0.6)
    for block_size in (2, 4, 16):
        assert torch.equal(valid_anchor_mask(batch, block_size), _brute_force_valid(batch, block_size))


@pytest.mark.parametrize("seed", range(4))
def test_budget_per_document_and_fixed_path_equals_dynamic(seed):
    batch = packed_batch([50, 9, 70, 31], width=4, vocab=50, seed=seed, padding=13, supervised_fraction=0.7)
    valid = valid_anchor_mask(batch, 4)
    for budget in (1, 5, 100):
        dynamic = sample_anchors(batch, 4, budget, torch.Generator().manual_seed(seed))
        fixed = sample_anchors(batch, 4, budget, torch.Generator().manual_seed(seed), num_anchors=400)
        assert fixed.shape == (400,)
        assert torch.equal(fixed[fixed >= 0], dynamic) and (fixed[dynamic.numel():] == -1).all()
        assert valid[dynamic].all() and torch.equal(dynamic, torch.sort(dynamic).values)
        assert dynamic.unique().numel() == dynamic.numel()
        for document in range(4):
            in_document = batch.document_ids == document
            count = int((batch.document_ids[dynamic] == document).sum())
            assert count == min(budget, int((valid & in_document).sum()))


def test_fixed_shape_cap_keeps_a_valid_subset():
    batch = packed_batch([200, 150], width=4, vocab=50, seed=1, padding=10)
    anchors = sample_anchors(batch, 8, 64, torch.Generator().manual_seed(0), num_anchors=50)
    assert anchors.shape == (50,) and (anchors >= 0).all()
    assert valid_anchor_mask(batch, 8)[anchors].all() and anchors.unique().numel() == 50


def test_anchors_are_uniform_over_valid_positions_and_resampled_per_seed():
    batch = packed_batch([40, 24], width=4, vocab=50, seed=5, supervised_fraction=0.9)
    valid = valid_anchor_mask(batch, 4)
    counts = torch.zeros(batch.num_tokens)
    trials = 600
    for trial in range(trials):
        anchors = sample_anchors(batch, 4, 6, torch.Generator().manual_seed(trial), num_anchors=12)
        counts[anchors[anchors >= 0]] += 1
    assert counts[~valid].sum() == 0
    for document in range(2):
        cells = counts[valid & (batch.document_ids == document)]
        expected = trials * 6 / cells.numel()
        # binomial std = sqrt(n p (1-p)) < 8 here; 5 sigma bounds
        assert ((cells - expected).abs() < 5 * (expected * (1 - 6 / cells.numel())) ** 0.5).all(), cells
    first = sample_anchors(batch, 4, 6, torch.Generator().manual_seed(1))
    assert torch.equal(first, sample_anchors(batch, 4, 6, torch.Generator().manual_seed(1)))
    assert not torch.equal(first, sample_anchors(batch, 4, 6, torch.Generator().manual_seed(2)))


def test_no_supervised_tokens_gives_no_anchors_and_bad_arguments_raise():
    batch = packed_batch([30], width=4, vocab=50, supervised_fraction=0.0)
    assert sample_anchors(batch, 4, 8, torch.Generator()).numel() == 0
    assert (sample_anchors(batch, 4, 8, torch.Generator(), num_anchors=5) == -1).all()
    with pytest.raises(ConfigError, match="block_size"):
        sample_anchors(batch, 1, 8, torch.Generator())
    with pytest.raises(ConfigError, match="max_anchors_per_document"):
        sample_anchors(batch, 4, 0, torch.Generator())
