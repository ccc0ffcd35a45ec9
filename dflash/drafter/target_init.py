"""Initialize draft layers from the target's own decoder layers (``train.drafter.init = "target"``).

A DFlash drafter has the target's widths (``DFlashConfig.from_target_config``), so each draft decoder layer has
exactly the tensors of a target decoder layer: ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm`` (and ``self_attn.{q,k}_norm`` for Qwen3-style targets). Copying
them gives the drafter the target's token-level language knowledge at step 0 instead of Normal(0, 0.02) weights; the
fusion ``fc`` / ``hidden_norm`` (which have no target counterpart) keep their random / unit initialization. The
drafter's final ``norm`` takes the target's final norm, as it feeds the same (shared) LM head.

What is not copied, and why: attention biases (Qwen2-style targets have q/k/v biases; the drafter's layers have
none unless ``attention_bias``: then they are copied too); a Llama target has no ``q_norm`` / ``k_norm`` (the
drafter's stay at ones, so its attention logits start at a different scale than the target's and are learned).

The exported drafter is unchanged in format: this is an initialization, not an architecture change (vLLM
``qwen3_dflash.py`` / SGLang ``models/dflash.py`` load the same tensor names).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from dflash.errors import ConfigError, MismatchError

if TYPE_CHECKING:
    from dflash.drafter.model import DFlashDrafter

__all__ = ["LAYER_TENSORS", "default_init_layers", "init_from_target_layers", "target_layer_prefix"]

#: Per-layer tensors a draft layer takes from a target layer (suffixes after ``<prefix>layers.<i>.``); the
#: optional ones are copied when both sides have them.
LAYER_TENSORS: tuple[str, ...] = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
_OPTIONAL_TENSORS: tuple[str, ...] = (
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
)


def default_init_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers that initialize the draft layers when ``init_target_layers`` is not given: the LAST
    ``num_draft_layers`` decoder layers (their outputs feed the final norm and LM head the drafter shares).

    Raises:
        ConfigError: more draft layers than the target has.
    """
    if num_draft_layers > num_target_layers:
        raise ConfigError(
            f"train.drafter.init = 'target' needs one target layer per draft layer: the drafter has {num_draft_layers}, "
            f"the target {num_target_layers}; give train.drafter.init_target_layers or fewer num_draft_layers"
        )
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def target_layer_prefix(names: Iterable[str]) -> str:
    """The prefix before ``layers.<i>.`` in a target's tensor names (``model.`` for Llama/Qwen/Mistral,
    ``model.language_model.`` for multimodal wrappers), found from ``layers.0.self_attn.q_proj.weight``.

    Raises:
        MismatchError: no such name, or several prefixes (e.g. a vision tower with the same layout).
    """
    pattern = re.compile(r"^(.*?)layers\.0\.self_attn\.q_proj\.weight$")
    prefixes = sorted({m.group(1) for name in names if (m := pattern.match(name))})
    candidates = [p for p in prefixes if "vision" not in p and "visual" not in p] or prefixes
    if len(candidates) != 1:
        raise MismatchError(
            "train.drafter.init = 'target': cannot tell the target's decoder layers from its tensor names "
            f"(prefixes before 'layers.0.self_attn.q_proj.weight': {candidates or 'none'}); use init = 'random'"
        )
    return candidates[0]


def init_from_target_layers(
    drafter: DFlashDrafter,
    names: Iterable[str],
    read: Callable[[str], torch.Tensor],
    layer_ids: Sequence[int],
) -> dict[str, object]:
    """Copy target decoder layer ``layer_ids[j]`` into draft layer ``j`` (and the target's final norm into the
    drafter's ``norm``), in place, under ``torch.no_grad()``; values are cast to the drafter's parameter dtype.

    Args:
        drafter: a freshly built drafter (its ``fc`` / ``hidden_norm`` keep their initialization).
        names: every tensor name of the target (its safetensors index).
        read: reads one named target tensor (CPU), e.g. from the target's safetensors files.
        layer_ids: one 0-based target decoder layer per draft layer, ``len == num_hidden_layers``; a layer may repeat.

    Returns:
        ``{"layers": [...], "tensors": n copied, "final_norm": bool, "not_in_target": [...]}`` for run.json.

    Raises:
        ConfigError: wrong number of layer ids, or one outside ``[0, num_target_layers)``.
        MismatchError: a target tensor's shape differs from the draft tensor's, or a required tensor is missing.
    """
    config = drafter.config
    layer_ids = [int(i) for i in layer_ids]
    if len(layer_ids) != config.num_hidden_layers:
        raise ConfigError(
            f"train.drafter.init_target_layers has {len(layer_ids)} layers, the drafter {config.num_hidden_layers} "
            "(num_draft_layers): give one target layer per draft layer"
        )
    bad = [i for i in layer_ids if not 0 <= i < config.num_target_layers]
    if bad:
        raise ConfigError(
            f"train.drafter.init_target_layers {bad} out of range: the target has layers 0..{config.num_target_layers - 1}"
        )
    names = set(names)
    prefix = target_layer_prefix(names)
    own = dict(drafter.named_parameters())
    copied, missing = 0, []
    with torch.no_grad():
        for draft_index, target_index in enumerate(layer_ids):
            for suffix in LAYER_TENSORS + _OPTIONAL_TENSORS:
                source, dest = f"{prefix}layers.{target_index}.{suffix}", f"layers.{draft_index}.{suffix}"
                if dest not in own:
                    continue
                if source not in names:
                    if suffix in LAYER_TENSORS:
                        raise MismatchError(f"train.drafter.init = 'target': the target has no tensor {source}")
                    missing.append(dest)
                    continue
                _copy(own[dest], read(source), source, dest)
                copied += 1
        final_norm = f"{prefix}norm.weight" in names
        if final_norm:
            _copy(own["norm.weight"], read(f"{prefix}norm.weight"), f"{prefix}norm.weight", "norm.weight")
            copied += 1
    return {"layers": layer_ids, "tensors": copied, "final_norm": final_norm, "not_in_target": sorted(set(missing))}


def _copy(dest: torch.Tensor, source: torch.Tensor, source_name: str, dest_name: str) -> None:
    if tuple(source.shape) != tuple(dest.shape):
        raise MismatchError(
            f"train.drafter.init = 'target': target tensor {source_name} has shape {tuple(source.shape)}, draft "
            f"tensor {dest_name} {tuple(dest.shape)}; the drafter must have the target's widths"
        )
    dest.copy_(source.to(device=dest.device, dtype=dest.dtype))
