"""What a theory computation may cost: estimated from its sizes before it starts, refused above the limits.

The exact DPs, the simulators and the chain files all grow with their arguments (the multi-draft DP as
T M^2 V^2, a chain pair as T V^2, a simulation as N T (V + M)); without a bound, ``genspec theory limit
--max-batch 100000000000`` runs for ever and ``random-chain --vocab 100000 --horizon 1000`` dies of a
MemoryError. Each algorithm's module states its cost (``*_cost`` functions, per-unit rates measured on a CPU:
accurate to a small factor, which is enough to tell minutes from days; the manual's Theory toolkit page has
the measurements), and :func:`check` refuses a computation whose estimate exceeds
:data:`MAX_BYTES` or :data:`MAX_SECONDS` with one line saying the estimate, the limits and why.
Everything the manual and the benchmarks run stays far below them (the largest, ``theory figures``,
is estimated at about a minute).
"""
from __future__ import annotations

from dataclasses import dataclass

from genspec.errors import ConfigError

#: memory one theory computation may plan to use (a modest share of a machine shared by several users and jobs)
MAX_BYTES = 4e9
#: time one theory computation may be estimated to take
MAX_SECONDS = 30 * 60.0


@dataclass(frozen=True)
class Cost:
    """Estimated peak memory (bytes) and time (seconds on a 2-core CPU, as the rates were measured) of a computation."""

    bytes: float = 0.0
    seconds: float = 0.0

    def then(self, other: "Cost") -> "Cost":
        """This computation followed by ``other``: the larger peak, the sum of times."""
        return Cost(max(self.bytes, other.bytes), self.seconds + other.seconds)

    def fits(self) -> bool:
        return self.bytes <= MAX_BYTES and self.seconds <= MAX_SECONDS


def total(costs) -> Cost:
    """Several computations one after the other."""
    result = Cost()
    for cost in costs:
        result = result.then(cost)
    return result


def check(cost: Cost, what: str, hint: str = "") -> None:
    """Raise :class:`ConfigError` (one line: ``what``, the estimate, the limits, ``hint``) if ``cost`` does
    not fit the limits."""
    if cost.fits():
        return
    needs = (f"{format_bytes(cost.bytes)} of memory and " if cost.bytes else "") + format_seconds(cost.seconds)
    raise ConfigError(f"{what} would need about {needs} (estimated for a 2-core CPU); the theory toolkit refuses "
                      f"more than {format_bytes(MAX_BYTES)} or {format_seconds(MAX_SECONDS)}"
                      + (f"; {hint}" if hint else "; use smaller sizes"))


def format_bytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if value >= size:
            return f"{value / size:.3g} {unit}" if value < 1e3 * size or unit != "TB" else f"{value / size:.1e} TB"
    return f"{value / 1e3:.3g} kB"


def format_seconds(value: float) -> str:
    for unit, size in (("years", 3.15e7), ("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if value >= size:
            return f"{value / size:.3g} {unit}" if value < 1e3 * size or unit != "years" else f"{value / size:.1e} years"
    return f"{value:.2g} s"
