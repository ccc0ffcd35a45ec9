"""Builders shared by the tests/test_drafter_*.py modules: tiny random-weight drafters and packed batches."""

from __future__ import annotations

import torch

from dflash.batches.packed import PackedBatch
from dflash.drafter import DFlashConfig, DFlashDrafter, valid_anchor_mask

__all__ = ["tiny_config", "tiny_drafter", "packed_batch", "random_anchors"]


def tiny_config(**overrides) -> DFlashConfig:
    values = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=97, block_size=4, mask_token_id=96, target_layer_ids=[0, 2], num_target_layers=4,
        rope_theta=10000.0, max_position_embeddings=512,
    )
    values.update(overrides)
    return DFlashConfig(**values)


def tiny_drafter(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    drafter = DFlashDrafter(config).to(dtype)
    # Large-ish init so that every input visibly moves the outputs (a vacuous test would pass on zeros).
    drafter.reset_parameters(std=0.2)
    drafter.attach_target(torch.randn(config.vocab_size, config.hidden_size, dtype=dtype),
                          torch.randn(config.vocab_size, config.hidden_size, dtype=dtype))
    return drafter.eval()


def packed_batch(lengths: list[int], *, width: int, vocab: int, seed: int = 0, padding: int = 0,
                 supervised_fraction: float = 0.8, dtype: torch.dtype = torch.float64) -> PackedBatch:
    """Documents of ``lengths`` packed back to back, then ``padding`` padding tokens (loss 0, document -1)."""
    generator = torch.Generator().manual_seed(seed)
    real = sum(lengths)
    total = real + padding
    input_ids = torch.randint(0, vocab - 1, (total,), generator=generator)
    loss_mask = (torch.rand(total, generator=generator) < supervised_fraction).to(torch.uint8)
    loss_mask[real:] = 0
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(padding, dtype=torch.int64)])
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]
                             + [torch.full((padding,), -1)]).to(torch.int64)
    cu_seqlens = torch.tensor([0] + list(torch.cumsum(torch.tensor(lengths), 0).tolist()), dtype=torch.int64)
    return PackedBatch(
        input_ids=input_ids, loss_mask=loss_mask,
        hidden=torch.randn(total, width, generator=generator, dtype=torch.float32).to(dtype),
        position_ids=position_ids, document_ids=document_ids, cu_seqlens=cu_seqlens,
        num_real_tokens=real, corpus_rows=list(range(len(lengths))),
    )


def random_anchors(batch: PackedBatch, block_size: int, count: int, seed: int = 0) -> torch.Tensor:
    """Up to ``count`` distinct valid anchors, uniformly at random (adjacent ones included: spacing down to 1)."""
    valid = torch.nonzero(valid_anchor_mask(batch, block_size)).squeeze(1)
    generator = torch.Generator().manual_seed(seed)
    chosen = valid[torch.randperm(valid.numel(), generator=generator)[:count]]
    return torch.sort(chosen).values
