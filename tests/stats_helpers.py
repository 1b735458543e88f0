"""Chi-square goodness of fit with pooling of small cells (theory.md, "How to test")."""
from __future__ import annotations

import numpy as np
from scipy import stats


def chi_square_pvalue(observed_counts, expected_probs, min_expected: float = 5.0) -> float:
    """p-value of observed counts against exact probabilities; cells with expected count below
    ``min_expected`` are pooled into one cell. An observation in a zero-probability cell gives 0."""
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
