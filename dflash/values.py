"""Checks of single setting values that config dataclasses in every layer share (their ``__post_init__``):
seeds and finite numbers. One home, so ``--print-config`` refuses what a run would refuse."""

from __future__ import annotations

import math
from typing import Any

from dflash.errors import ConfigError

__all__ = ["SEED_MAX", "check_seed", "finite_number", "shown"]

#: Largest seed accepted: a signed 64-bit integer, which every generator it seeds (torch, numpy) holds.
SEED_MAX = 2**63 - 1


def shown(value: Any) -> str:
    """``repr(value)``, shortened (a 400-digit integer is not repeated in full)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def check_seed(name: str, value: Any) -> None:
    """A config's seed check (its ``__post_init__``): an integer from 0 to :data:`SEED_MAX`.

    Raises:
        ConfigError: naming ``name``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= SEED_MAX:
        raise ConfigError(f"{name} must be an integer from 0 to 2**63-1, got {shown(value)}")


def finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool) that is a finite float (an integer of hundreds of digits
    is not: it overflows a float)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
