"""Bias versus rejections for one distribution pair (theory.md, Theorems 4 and 5). Pure NumPy.

p = DRAFT = ``draft_probs [V]``, q = TARGET = ``target_probs [V]``. A relaxed rule keeps the draft
token y with probability b(y) = ``keep_probs [V]`` in [min{1, q/p}, 1] and otherwise resamples from a
law P = ``resample_probs [V]``:

- rejection probability R = sum_y (1 - b(y)) p(y),
- output law            out = b p + R P,
- bias                  TV(out, q).

The over-acceptance family's b and the OPT / UNO resampling laws are the engine's rule
(:func:`genspec.acceptance.acceptance_probability`, :func:`genspec.acceptance.residual_distribution`,
through :mod:`genspec.theory.exact`); Theorem 4's and 5's formulas for arbitrary b are computed here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from genspec.errors import ConfigError
from genspec.theory.exact import keep_probability, normalize, positive_part, residual_law, total_variation

# the worked example of theory.md
EXAMPLE_DRAFT = (0.3, 0.7)
EXAMPLE_TARGET = (0.5, 0.5)
DEFAULT_EPSILONS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3)


def check_pair(draft_probs, target_probs) -> tuple[np.ndarray, np.ndarray]:
    """Two distributions over the same V symbols as float64 arrays, or a ConfigError."""
    draft = np.asarray(draft_probs, dtype=np.float64)
    target = np.asarray(target_probs, dtype=np.float64)
    for name, law in (("draft", draft), ("target", target)):
        if law.ndim != 1 or law.size == 0:
            raise ConfigError(f"{name} must be a non-empty list of probabilities")
        if not np.all(np.isfinite(law)) or np.any(law < 0):
            raise ConfigError(f"{name} has a negative or non-finite entry: {law.tolist()}")
        if abs(law.sum() - 1.0) > 1e-9:
            raise ConfigError(f"{name} sums to {law.sum():.12g}, not 1")
    if draft.shape != target.shape:
        raise ConfigError(f"draft has {draft.size} entries but target has {target.size}")
    return draft, target


def lossless_keep(draft_probs: np.ndarray, target_probs: np.ndarray) -> np.ndarray:
    """b = min{1, q/p} (standard SD), computed by :func:`genspec.acceptance.acceptance_probability`.

    Tokens with p = 0 are never drafted; there the shared rule gives b = 1 if q > 0 and b = 0 if
    q = 0. b is always weighted by p, so its value there changes neither R, nor the output law, nor
    the biases."""
    return over_acceptance_keep(draft_probs, target_probs, 0.0)


def over_acceptance_keep(draft_probs: np.ndarray, target_probs: np.ndarray, epsilon: float) -> np.ndarray:
    """b = min{1, (q + eps) / p}, eps >= 0, computed by :func:`genspec.acceptance.acceptance_probability`.

    Where p = 0 the shared rule gives b = 1 if q + eps > 0, else 0 (so 0 only at eps = 0 and q = 0)."""
    if epsilon < 0:
        raise ConfigError(f"epsilon must be >= 0, got {epsilon}")
    return keep_probability(target_probs, draft_probs, epsilon)


def rejection_probability(draft_probs: np.ndarray, keep_probs: np.ndarray) -> float:
    """R = sum_y (1 - b(y)) p(y)."""
    return float(((1.0 - keep_probs) * draft_probs).sum())


def output_law(draft_probs: np.ndarray, keep_probs: np.ndarray, resample_probs: np.ndarray) -> np.ndarray:
    """out = b p + R P ``[V]``."""
    return keep_probs * draft_probs + rejection_probability(draft_probs, keep_probs) * resample_probs


def bias(draft_probs, target_probs, keep_probs, resample_probs) -> float:
    """TV(b p + R P, q)."""
    return float(total_variation(output_law(draft_probs, keep_probs, resample_probs), target_probs))


def optimal_resampling(draft_probs: np.ndarray, target_probs: np.ndarray, keep_probs: np.ndarray) -> np.ndarray:
    """Theorem 4: P = norm([A]_+) with A = (q - b p) / R minimises the bias (R > 0; the sign of A
    is that of q - b p, so norm([q - b p]_+) is the same law). With R = 0 nothing is resampled and
    q is returned."""
    return normalize(positive_part(target_probs - keep_probs * draft_probs), target_probs)


def minimal_bias(draft_probs: np.ndarray, target_probs: np.ndarray, keep_probs: np.ndarray) -> float:
    """Theorem 4: Loss* = 1/2 sum |q - b p| - R/2 = sum_y [b p - q]_+."""
    return float(positive_part(keep_probs * draft_probs - target_probs).sum())


@dataclass
class ParetoPoint:
    """One over-acceptance level: R, Loss*, and the biases of Decoding-OPT and Decoding-UNO."""

    epsilon: float
    rejection: float  # R
    loss_star: float  # minimal bias over all resampling laws (Theorem 4)
    opt_bias: float  # resample from norm([q - b p]_+) = norm([q - p]_+)
    uno_bias: float  # resample from q

    def as_dict(self) -> dict:
        return asdict(self)


def over_acceptance_point(draft_probs, target_probs, epsilon: float) -> ParetoPoint:
    """The family b = min{1, (q + eps)/p} at one eps, with OPT and UNO resampling."""
    draft, target = check_pair(draft_probs, target_probs)
    keep = over_acceptance_keep(draft, target, epsilon)
    return ParetoPoint(
        epsilon=float(epsilon),
        rejection=rejection_probability(draft, keep),
        loss_star=minimal_bias(draft, target, keep),
        opt_bias=bias(draft, target, keep, opt_resampling(draft, target)),
        uno_bias=bias(draft, target, keep, residual_law(target, draft, "uno")),  # = q
    )


def opt_resampling(draft_probs: np.ndarray, target_probs: np.ndarray) -> np.ndarray:
    """Decoding-OPT's law: the standard residual norm([q - p]_+) (equal to Theorem 4's optimum
    norm([q - b p]_+) for every b of the over-acceptance family), computed by
    :func:`genspec.acceptance.residual_distribution`; q where [q - p]_+ is all zero (p = q)."""
    return residual_law(target_probs, draft_probs, "opt")


def pareto_table(draft_probs, target_probs, epsilons=DEFAULT_EPSILONS) -> list[ParetoPoint]:
    """:func:`over_acceptance_point` over an eps grid."""
    return [over_acceptance_point(draft_probs, target_probs, eps) for eps in epsilons]


def pareto_front(draft_probs, target_probs, num_points: int = 2) -> np.ndarray:
    """Theorem 5: the front is the segment R + Loss* = TV(p, q) from (TV, 0) (standard SD) to (0, TV)
    (accept everything). Returns ``[num_points, 2]`` points (R, bias) along it."""
    draft, target = check_pair(draft_probs, target_probs)
    tv = float(total_variation(draft, target))
    rejection = np.linspace(tv, 0.0, num_points)
    return np.stack([rejection, tv - rejection], axis=1)
