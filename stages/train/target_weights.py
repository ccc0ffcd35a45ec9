"""The target's embedding and LM head read from its safetensors files alone, so a drafter rank never loads the
whole target (:func:`load_target_embeddings`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash.errors import TargetError
from dflash.io.files import load_json
from dflash.io.weights import open_safetensors
from dflash.target.load import load_target

if TYPE_CHECKING:
    pass

__all__ = ["load_target_embeddings", "read_target_tensor", "target_weight_map"]

_TARGET_WEIGHTS_FIX = "the target's weights are truncated or damaged: restore or re-download the target"


def target_weight_map(target_path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a local transformers folder (its ``model.safetensors.index.json``, or
    the names in every ``*.safetensors`` file); ``{}`` when it has no safetensors.

    Raises:
        TargetError: a damaged index or safetensors file (naming it).
    """
    index = target_path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = load_json(index, error=TargetError, fix=_TARGET_WEIGHTS_FIX)["weight_map"]
            return {name: target_path / file for name, file in weight_map.items()}
        except (ValueError, KeyError, AttributeError, TypeError) as error:
            raise TargetError(f"{index}: not a safetensors index ({error}); {_TARGET_WEIGHTS_FIX}") from error
    weight_map: dict[str, Path] = {}
    for file in sorted(target_path.glob("*.safetensors")):
        with open_safetensors(file, error_type=TargetError, fix=_TARGET_WEIGHTS_FIX) as handle:
            weight_map.update(dict.fromkeys(handle.keys(), file))
    return weight_map


def read_target_tensor(weight_map: dict[str, Path], name: str) -> torch.Tensor:
    """One named tensor of the target, on CPU, in its stored dtype and shape, from its safetensors file
    (``target_weight_map``).

    Raises:
        KeyError: ``name`` is not in ``weight_map``.
        TargetError: the file is missing or damaged (naming it)."""
    with open_safetensors(weight_map[name], error_type=TargetError, fix=_TARGET_WEIGHTS_FIX) as handle:
        return handle.get_tensor(name)


def load_target_embeddings(target_path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's input embedding ``[V, H]`` and LM head ``[V, H]`` (``None`` when tied), read from its
    safetensors files alone, so a drafter rank never loads the whole target. Falls back to loading the model.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weight_map = target_weight_map(target_path)
    embed_names = [n for n in weight_map if n.endswith("embed_tokens.weight")]
    head_names = [n for n in weight_map if n.endswith("lm_head.weight")]
    if len(embed_names) == 1 and (tied or len(head_names) == 1):
        embed = read_target_tensor(weight_map, embed_names[0])
        return embed, (None if tied or not head_names else read_target_tensor(weight_map, head_names[0]))

    model = load_target(target_path).model
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    return embed, (None if head.data_ptr() == embed.data_ptr() else head)
