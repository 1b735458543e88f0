"""The timing the cost scripts share: the median wall time of a call, after warm-up calls."""
from __future__ import annotations

import statistics
import time


def median_seconds(function, repeats: int = 20, warmup: int = 1) -> float:
    """The median wall time of ``repeats`` calls of ``function`` (seconds), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
