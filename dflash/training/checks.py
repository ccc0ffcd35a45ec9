"""Checks that the artefacts of a training run agree, before any step runs.

A hidden-state cache, a drafter config (new, or read from a checkpoint) and the loaded target must describe the
same thing: the same target weights, the same tapped layers under the same indexing convention, the same hidden
size and vocabulary, and a mask token that is a real row of the target's embedding. Each disagreement is a
:class:`~dflash.errors.MismatchError` naming the field, both values and the fix (docs/dflash.md, "Ways to get it
silently wrong": tapped ids off by one or a different set with the same count; mask token outside the real rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dflash.errors import MismatchError

if TYPE_CHECKING:
    from dflash.cache.format import CacheMetadata
    from dflash.drafter import DFlashConfig
    from dflash.target.load import TargetIdentity

__all__ = ["IDENTITY_FIELDS", "check_training_inputs", "check_target_identity", "recorded_identity"]

#: Target identity fields that must agree (the name may differ: a renamed folder holds the same weights).
IDENTITY_FIELDS = ("content_hash", "num_hidden_layers", "hidden_size", "vocab_size", "model_type")


def _mismatch(field: str, expected: Any, got: Any, where: str, fix: str) -> MismatchError:
    return MismatchError(f"{field} differs: {where} has {expected!r}, got {got!r}; {fix}")


def recorded_identity(record: Mapping[str, Any]) -> dict[str, Any]:
    """The target identity fields of any record that carries them: a ``TargetIdentity`` dict, a checkpoint's
    ``target.json`` (identity fields at the top, plus ``target_spec`` and weight hashes), an export's provenance
    ``target``, or a record nesting them under ``identity`` or ``target``."""
    nested = record.get("identity") or record.get("target")
    source = nested if isinstance(nested, Mapping) else record
    return {key: source[key] for key in ("name", *IDENTITY_FIELDS) if source.get(key) is not None}


def check_target_identity(recorded: Mapping[str, Any], identity: TargetIdentity | Mapping[str, Any], *, where: str,
                          fix: str) -> None:
    """The one check that an artefact (cache, checkpoint, export, evaluated drafter) belongs to the loaded target:
    :data:`IDENTITY_FIELDS` compared one by one where both sides record them (the name may differ).

    Args:
        recorded: what the artefact recorded (any form :func:`recorded_identity` reads).
        identity: the loaded target's ``TargetIdentity`` (or its dict).
        where: names the artefact in the message (``cache /data/c``, ``the drafter at RUN``).
        fix: what to do instead.

    Raises:
        MismatchError: ``target.<field> differs: WHERE has RECORDED, got LOADED; FIX``.
    """
    recorded = recorded_identity(recorded)
    loaded = identity.to_dict() if hasattr(identity, "to_dict") else recorded_identity(identity)
    for field in IDENTITY_FIELDS:
        if field in recorded and loaded.get(field) is not None and recorded[field] != loaded[field]:
            raise _mismatch(f"target.{field}", recorded[field], loaded[field], where, fix)


def check_training_inputs(
    metadata: CacheMetadata,
    drafter_config: DFlashConfig,
    *,
    target_identity: TargetIdentity,
    embedding_rows: int,
    layer_id_convention: str,
    cache_path: str = "the cache",
) -> None:
    """Refuse a cache / drafter config / target combination that would train a wrong drafter.

    Args:
        metadata: the cache's root metadata (``CacheReader.metadata``).
        drafter_config: the config the drafter is (or was) built with.
        target_identity: identity of the loaded target (``dflash.target.load.target_identity``).
        embedding_rows: rows of the loaded target's input embedding (the real token rows).
        layer_id_convention: this code's convention (``dflash.target.taps.LAYER_ID_CONVENTION``).
        cache_path: for messages.

    Raises:
        MismatchError: naming the first differing field (``target.content_hash``, ``layer_id_convention``,
            ``target_layer_ids``, ``hidden_size``, ``vocab_size``, ``num_target_layers``, ``mask_token_id``).
    """
    where = f"cache {cache_path}"
    check_target_identity(
        metadata.target,
        target_identity,
        where=where,
        fix=f"train with the target the cache was extracted with (target_spec={metadata.target_spec!r}), or "
        "re-extract the cache with this target",
    )
    if metadata.layer_id_convention != layer_id_convention:
        raise _mismatch(
            "layer_id_convention", metadata.layer_id_convention, layer_id_convention, where,
            "the cache counts tapped layers differently from this code (tap l = output of decoder layer l = "
            "transformers hidden_states[l + 1]); re-extract the cache with this version",
        )
    if list(metadata.target_layer_ids) != list(drafter_config.target_layer_ids):
        raise _mismatch(
            "target_layer_ids", list(metadata.target_layer_ids), list(drafter_config.target_layer_ids), where,
            "omit --target-layer-ids to use the cache's, or re-extract the cache with the wanted layers",
        )
    if metadata.num_taps != drafter_config.num_taps:
        raise _mismatch("num_taps", metadata.num_taps, drafter_config.num_taps, where, "the cache is inconsistent")
    for field, drafter_value, target_value in (
        ("hidden_size", drafter_config.hidden_size, target_identity.hidden_size),
        ("num_target_layers", drafter_config.num_target_layers, target_identity.num_hidden_layers),
        ("vocab_size", drafter_config.vocab_size, embedding_rows),
    ):
        if drafter_value != target_value:
            raise _mismatch(
                field, target_value, drafter_value, "the loaded target",
                "the drafter config was made for another target; build it from this target",
            )
    if metadata.hidden_size != target_identity.hidden_size:
        raise _mismatch(
            "hidden_size", metadata.hidden_size, target_identity.hidden_size, where,
            "the cache was extracted from another target; re-extract it",
        )
    if target_identity.vocab_size != embedding_rows:
        raise _mismatch(
            "vocab_size", target_identity.vocab_size, embedding_rows, "the target's recorded identity",
            "the target folder changed after it was identified; clear its identity memo and retry",
        )
    if not 0 <= drafter_config.mask_token_id < embedding_rows:
        raise _mismatch(
            "mask_token_id", f"a row in [0, {embedding_rows})", drafter_config.mask_token_id,
            "the target embedding",
            "pick an existing, unused special token of the target's tokenizer (never a newly added row)",
        )
