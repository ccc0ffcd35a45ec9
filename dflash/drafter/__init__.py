"""The DFlash drafter: config, model, anchor sampling, attention masks and the training loss.

Follows DFlash (arXiv 2602.06036) and the serving implementations (vLLM ``qwen3_dflash.py``, SGLang
``models/dflash.py``, z-lab/dflash). Knows nothing of Dask or the CLI.

The names below are imported on first use (PEP 562), so that ``dflash.drafter.config`` (torch-free: the train
stage's ``DrafterTrainingConfig``) is importable without loading torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash.drafter.anchors import sample_anchors, valid_anchor_mask
    from dflash.drafter.attention_kernels import (
        attention_backend,
        attention_implementation,
        flash_attention_available,
        set_attention_backend,
    )
    from dflash.drafter.config import DFlashConfig, DrafterTrainingConfig, select_mask_token_id
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

#: Public name -> the submodule that defines it.
_EXPORTS = {
    "sample_anchors": "dflash.drafter.anchors",
    "valid_anchor_mask": "dflash.drafter.anchors",
    "attention_backend": "dflash.drafter.attention_kernels",
    "attention_implementation": "dflash.drafter.attention_kernels",
    "flash_attention_available": "dflash.drafter.attention_kernels",
    "set_attention_backend": "dflash.drafter.attention_kernels",
    "DFlashConfig": "dflash.drafter.config",
    "DrafterTrainingConfig": "dflash.drafter.config",
    "select_mask_token_id": "dflash.drafter.config",
    "CE_KERNELS": "dflash.drafter.loss",
    "LossOutput": "dflash.drafter.loss",
    "ce_kernel": "dflash.drafter.loss",
    "chunked_linear_cross_entropy": "dflash.drafter.loss",
    "default_gamma": "dflash.drafter.config",
    "dflash_loss": "dflash.drafter.loss",
    "expected_acceptance_length": "dflash.drafter.loss",
    "position_weights": "dflash.drafter.loss",
    "set_ce_kernel": "dflash.drafter.loss",
    "AttentionLayout": "dflash.drafter.masks",
    "attention_layout": "dflash.drafter.masks",
    "dense_attention_mask": "dflash.drafter.masks",
    "flex_block_mask": "dflash.drafter.masks",
    "DFlashDrafter": "dflash.drafter.model",
}

__all__ = [
    "CE_KERNELS",
    "ce_kernel",
    "set_ce_kernel",
    "AttentionLayout",
    "DFlashConfig",
    "DFlashDrafter",
    "DrafterTrainingConfig",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")  # a submodule (dflash.drafter.loss)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
