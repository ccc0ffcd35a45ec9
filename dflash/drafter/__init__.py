"""The DFlash drafter: config, model, anchor sampling, attention masks and the training loss.

Follows DFlash (arXiv 2602.06036) and the serving implementations (vLLM ``qwen3_dflash.py``, SGLang
``models/dflash.py``, z-lab/dflash). Knows nothing of Dask or the CLI.
"""

from __future__ import annotations

from dflash.drafter.anchors import sample_anchors, valid_anchor_mask
from dflash.drafter.attention_kernels import (
    attention_backend,
    attention_implementation,
    flash_attention_available,
    set_attention_backend,
)
from dflash.drafter.config import DFlashConfig, select_mask_token_id
from dflash.drafter.loss import (
    CE_KERNELS,
    LossOutput,
    ce_kernel,
    chunked_linear_cross_entropy,
    default_gamma,
    dflash_loss,
    expected_acceptance_length,
    position_weights,
    set_ce_kernel,
)
from dflash.drafter.masks import AttentionLayout, attention_layout, dense_attention_mask, flex_block_mask
from dflash.drafter.model import DFlashDrafter

__all__ = [
    "CE_KERNELS",
    "ce_kernel",
    "set_ce_kernel",
    "AttentionLayout",
    "DFlashConfig",
    "DFlashDrafter",
    "LossOutput",
    "attention_backend",
    "attention_implementation",
    "attention_layout",
    "chunked_linear_cross_entropy",
    "default_gamma",
    "dense_attention_mask",
    "dflash_loss",
    "expected_acceptance_length",
    "flash_attention_available",
    "flex_block_mask",
    "position_weights",
    "sample_anchors",
    "select_mask_token_id",
    "set_attention_backend",
    "valid_anchor_mask",
]
