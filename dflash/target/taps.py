"""Which target layers a drafter is conditioned on: one rule, used by ``extract``, ``online``, ``run`` and the drafter.

A drafter with ``n`` taps reads the outputs of ``n`` target decoder layers. ``n`` is the number of draft layers
unless a command sets it (``extract --num-taps``); the layer ids are given explicitly (``--target-layer-ids``) or
follow :func:`default_target_layer_ids`. :func:`tapped_layer_ids` applies both rules; every command that picks the
layers of a cache calls it, so an ``online`` run and ``extract`` + ``train`` tap the same layers.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash.errors import TargetError

__all__ = ["LAYER_ID_CONVENTION", "tapped_layer_ids", "default_target_layer_ids", "validate_target_layer_ids"]

#: Recorded in every cache and export: tap ``l`` is the output of decoder layer ``l`` = ``hidden_states[l + 1]``.
LAYER_ID_CONVENTION = "decoder_layer_output"


def tapped_layer_ids(num_target_layers: int, num_taps: int, layer_ids: Sequence[int] | None = None) -> list[int]:
    """The tapped layers of a ``num_target_layers``-layer target: ``layer_ids`` checked when given, else
    :func:`default_target_layer_ids` with ``num_taps`` taps (the number of draft layers unless a command sets it).

    Raises:
        TargetError: an id out of range or out of order, or a tap count the target cannot hold.
    """
    if layer_ids is None:
        layer_ids = default_target_layer_ids(num_target_layers, num_taps)
    return validate_target_layer_ids(list(layer_ids), num_target_layers)


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """DFlash's default tapped layers (z-lab/dflash reference; docs/dflash.md, "The drafter").

    ``num_taps == 1`` -> ``[N // 2]``; otherwise ``round(1 + i * (N - 4) / (n - 1))`` for ``i`` in ``0..n-1``.
    Ids follow :data:`LAYER_ID_CONVENTION` (output of decoder layer ``l``).

    Raises:
        TargetError: fewer than 4 target layers with several taps, or a non-positive tap count.
    """
    if num_taps < 1:
        raise TargetError(f"number of tapped layers must be >= 1, got {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise TargetError(f"a target with {num_target_layers} layers is too shallow for {num_taps} taps")
    return [round(1 + i * (num_target_layers - 4) / (num_taps - 1)) for i in range(num_taps)]


def validate_target_layer_ids(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """Check tapped ids: strictly increasing, each in ``[0, N - 2]`` (never the last layer, whose transformers
    hidden state is taken after the final norm). Returns the ids as a list of ints.

    Raises:
        TargetError: naming the offending id and the valid range.
    """
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise TargetError("target_layer_ids is empty; give at least one layer id")
    for previous, current in zip(ids, ids[1:], strict=False):
        if current <= previous:
            raise TargetError(f"target_layer_ids must be strictly increasing, got {ids}")
    for layer_id in ids:
        if not 0 <= layer_id <= num_target_layers - 2:
            raise TargetError(
                f"target layer id {layer_id} is outside [0, {num_target_layers - 2}] for a {num_target_layers}-layer "
                "target (ids are 0-based decoder layers whose output is tapped; the last layer is never tapped)"
            )
    return ids
