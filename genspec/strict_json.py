"""JSON as RFC 8259 defines it, which has no NaN or infinity (Python's json module writes ``NaN`` and
``Infinity`` by default, which strict parsers refuse): every ``--json`` output and results file goes
through :func:`dumps`, and numbers a user writes as JSON (``-O KEY=VALUE``) through :func:`loads`."""
from __future__ import annotations

import json
import math

from genspec.errors import GenerationError


def dumps(obj, **kwargs) -> str:
    """``json.dumps(obj, allow_nan=False, ...)``; a NaN or an infinity in ``obj`` raises
    :class:`~genspec.errors.GenerationError` naming where it is (e.g. ``results[2].speedup``)."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        where = _non_finite(obj, "")
        if where is None:
            raise
        raise GenerationError(f"the output's {where[0] or 'value'} is {where[1]}, which JSON cannot hold") from None


def loads(text: str):
    """``json.loads`` refusing ``NaN``, ``Infinity`` and numbers too large for a float (ValueError)."""
    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"{literal} is not a finite number")
        return value

    def constant(literal: str):
        raise ValueError(f"{literal} is not a JSON number")

    return json.loads(text, parse_float=number, parse_constant=constant)


def _non_finite(obj, path: str) -> tuple[str, float] | None:
    """The path and value of the first non-finite float in ``obj`` (None if there is none)."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path, obj)
    if isinstance(obj, dict):
        items = ((f"{path}.{key}" if path else str(key), value) for key, value in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{path}[{i}]", value) for i, value in enumerate(obj))
    else:
        return None
    for where, value in items:
        found = _non_finite(value, where)
        if found is not None:
            return found
    return None
