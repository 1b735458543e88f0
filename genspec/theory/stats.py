"""Two statistics the toolkit reports: chi-square goodness of fit (docs/theory.md, "How it is tested": pool the
cells with expected count below 5) and the Wilson score interval of a proportion (WinRate)."""
from __future__ import annotations

import math

import numpy as np


def chi_square_pvalue(observed_counts, expected_probs, min_expected: float = 5.0) -> float:
    """p-value of observed counts against exact probabilities; cells with expected count below
    ``min_expected`` are pooled into one cell. An observation in a zero-probability cell gives 0."""
    from scipy import stats  # here, not at import: the engine imports the theory's formulas, not scipy

    observed = np.asarray(observed_counts, dtype=float).ravel()
    probs = np.asarray(expected_probs, dtype=float).ravel()
    total = observed.sum()
    if observed[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * total
    big = expected >= min_expected
    obs = list(observed[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    exp = np.asarray(exp)
    exp *= total / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def wilson_interval(successes: float, trials: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / trials`` (default 95%: z = 1.96). Half
    successes (ties counted half) are allowed. (0, 1) for no trials."""
    if trials <= 0:
        return 0.0, 1.0
    share = successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)
