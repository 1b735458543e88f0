"""Checks of the values handed to genspec's public entry points (``GenerationConfig``, ``SamplingConfig``,
``generate_ids``, ...): a value of the wrong type or out of range raises :class:`~genspec.errors.ConfigError`
naming the argument, rather than a TypeError from deep inside or a silently wrong result."""
from __future__ import annotations

import math
import numbers
import operator

from genspec.errors import ConfigError


def integer(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int: an integer (a NumPy or 0-d torch integer too) or an integral float, not a
    bool; at least ``minimum`` if given."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer{_at_least(minimum)}, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name} must be an integer{_at_least(minimum)}, got {number}")
    return number


def finite(name: str, value) -> float:
    """``value`` as a float: a real number (not a bool, not a string), neither NaN nor infinite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    return float(value)


def _at_least(minimum: int | None) -> str:
    return "" if minimum is None else f" >= {minimum}"
