"""Bias versus rejections (docs/theory.md, Theorems 4 and 5): every formula of it, once.

p = DRAFT = ``draft_probs``, q = TARGET = ``target_probs``, laws over the last axis ``[..., V]``. A
rejection-based rule keeps the draft token y with probability b(y) = ``keep_probs`` and otherwise
resamples from a law P = ``resample_probs``:

- rejection probability R = sum_y (1 - b(y)) p(y),
- output law            out = b p + R P,
- bias                  TV(out, q),
- Loss* (Theorem 4)     the least bias over all P for this b, sum_y [b p - q]_+,
- Pareto front (Thm 5)  bias >= TV(p, q) - R for every b (equality for b >= min{1, q/p} with the OPT
                        law); so the front's bias at the rule's own rejection R is [TV(p, q) - R]_+.

The formula functions (:func:`rejection_probability` ... :func:`step_statistics`) take NumPy arrays or
torch tensors with any leading shape and return ``[...]``: the theory calls them on float64 arrays of
one pair, the engine (``GenerationConfig.measure_bias``) on the float32 laws of real generations, via
:func:`chain_step_statistics`. The rules' b and resampling laws are the engine's
(:func:`genspec.acceptance.keep_probabilities`, :func:`genspec.acceptance.resampling_law`).

What "bias per step" averages over on real generations: every *judged* draft position, i.e. each
position of a chain draft up to and including the first rejected one (the positions after it are never
judged), given its accepted prefix; at it the rule draws the position's token from b p + R P with p
the draft's processed law there and q the target's. Bonus tokens and steps without a draft are exact
draws from q (bias 0, no rejection) and are not counted.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from genspec.acceptance import STANDARD, Rule, keep_probabilities, resampling_law, residual_distribution
from genspec.errors import ConfigError
from genspec.theory.exact import keep_probability, residual_law, total_variation

# the worked example of docs/theory.md
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


def _positive(values):
    """[v]_+ of an array or a tensor."""
    return values * (values > 0)


def rejection_probability(draft_probs, keep_probs):
    """R = sum_y (1 - b(y)) p(y): ``[..., V] -> [...]``."""
    return ((1.0 - keep_probs) * draft_probs).sum(-1)


def output_law(draft_probs, keep_probs, resample_probs):
    """out = b p + R P ``[..., V]``."""
    return keep_probs * draft_probs + rejection_probability(draft_probs, keep_probs)[..., None] * resample_probs


def bias(draft_probs, target_probs, keep_probs, resample_probs):
    """TV(b p + R P, q): ``[..., V] -> [...]``."""
    return total_variation(output_law(draft_probs, keep_probs, resample_probs), target_probs)


def optimal_resampling(draft_probs: np.ndarray, target_probs: np.ndarray, keep_probs: np.ndarray) -> np.ndarray:
    """Theorem 4: P = norm([A]_+) with A = (q - b p) / R minimises the bias (R > 0; the sign of A
    is that of q - b p, so norm([q - b p]_+) is the same law), computed by
    :func:`genspec.acceptance.residual_distribution`. With R = 0 nothing is resampled and q is returned."""
    def tensor(values):
        return torch.as_tensor(np.asarray(values, dtype=np.float64))

    return residual_distribution(tensor(target_probs), tensor(draft_probs), "opt", tensor(keep_probs)).numpy()


def minimal_bias(draft_probs, target_probs, keep_probs):
    """Theorem 4: Loss* = 1/2 sum |q - b p| - R/2 = sum_y [b p - q]_+ : ``[..., V] -> [...]``."""
    return _positive(keep_probs * draft_probs - target_probs).sum(-1)


def front_bias(tv, rejection):
    """Theorem 5's front: the least bias a rule rejecting with probability R can have where TV(p, q) =
    ``tv``, [TV - R]_+ (the segment from (TV, 0) to (0, TV); = Loss* for every b >= min{1, q/p})."""
    return _positive(tv - rejection)


def pareto_bias(draft_probs, target_probs, keep_probs):
    """:func:`front_bias` at the rule's own rejection R: ``[..., V] -> [...]``."""
    return front_bias(total_variation(draft_probs, target_probs), rejection_probability(draft_probs, keep_probs))


@dataclass
class StepStatistics:
    """Sums over judged positions (each field ``[...]``, or a number): how many positions, the rule's
    rejection probability R, its bias TV(b p + R P, q), TV(p, q), Loss* and the front's bias
    [TV - R]_+. :meth:`means` divides by ``positions``."""

    positions: object
    rejection: object
    bias: object
    tv: object
    loss_star: object
    pareto_bias: object

    def row(self, index: int) -> "StepStatistics":
        """Row ``index`` of batched statistics, as Python numbers."""
        return StepStatistics(*(float(getattr(self, f.name)[index]) for f in fields(self)))

    def add(self, other: "StepStatistics") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def means(self) -> dict:
        """Per judged position (None without any): rejection_rate, bias_tv, tv, loss_star, pareto_bias;
        and the count, judged_positions."""
        n = float(self.positions)
        mean = (lambda v: float(v) / n) if n else (lambda v: None)
        return {"judged_positions": int(n), "rejection_rate": mean(self.rejection), "bias_tv": mean(self.bias),
                "tv": mean(self.tv), "loss_star": mean(self.loss_star), "pareto_bias": mean(self.pareto_bias)}

    @classmethod
    def zero(cls) -> "StepStatistics":
        return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)


def step_statistics(draft_probs, target_probs, keep_probs, resample_probs) -> StepStatistics:
    """Every quantity of one judged position per law pair ``[..., V]`` (``positions`` is 1 each)."""
    rejection = rejection_probability(draft_probs, keep_probs)
    tv = total_variation(draft_probs, target_probs)
    return StepStatistics(positions=rejection * 0 + 1, rejection=rejection,
                          bias=bias(draft_probs, target_probs, keep_probs, resample_probs), tv=tv,
                          loss_star=minimal_bias(draft_probs, target_probs, keep_probs),
                          pareto_bias=front_bias(tv, rejection))


def rule_statistics(draft_probs: torch.Tensor, target_probs: torch.Tensor, rule: Rule = STANDARD) -> StepStatistics:
    """:func:`step_statistics` of an acceptance rule of :mod:`genspec.acceptance` (its b and resampling
    law) on tensors ``[..., V]``; the rule's ``epsilon`` / ``delta`` broadcast against ``[...]``."""
    keep = keep_probabilities(target_probs, draft_probs, rule)
    resample = resampling_law(target_probs, draft_probs, rule)
    return step_statistics(draft_probs, target_probs, keep, resample)


def chain_step_statistics(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                          accepted_length: torch.Tensor, draft_lengths: torch.Tensor,
                          rule: Rule = STANDARD) -> StepStatistics:
    """One verify step of chain drafts, per row: the sums of :class:`StepStatistics` over its judged
    positions (module docstring), each field ``[B]``.

    ``draft_tokens`` ``[B, k]``; ``draft_probs`` ``[B, k, V]`` (None: point masses on the tokens);
    ``target_probs`` ``[B, >= k, V]`` the processed target laws the rule judged against;
    ``accepted_length``, ``draft_lengths`` ``[B]``; the rule's ``epsilon`` / ``delta`` numbers or ``[B]``.
    """
    batch, k = draft_tokens.shape
    positions = torch.arange(k, device=draft_tokens.device)
    judged = (positions < draft_lengths.unsqueeze(1)) & (positions <= accepted_length.unsqueeze(1))  # [B, k]
    row_of = torch.arange(batch, device=draft_tokens.device).unsqueeze(1).expand(batch, k)[judged]
    target = target_probs[:, :k][judged]  # [n, V]
    if draft_probs is None:
        draft = torch.nn.functional.one_hot(draft_tokens[judged], target.shape[-1]).to(target.dtype)
    else:
        draft = draft_probs[judged].to(target.dtype)

    statistics = rule_statistics(draft, target, rule.per_row(lambda values: values[row_of]))
    sums = {}
    for f in fields(StepStatistics):
        total = torch.zeros(batch, dtype=torch.float64, device=draft_tokens.device)
        sums[f.name] = total.index_add_(0, row_of, getattr(statistics, f.name).to(torch.float64))
    return StepStatistics(**sums)


def chain_statistics(chain, rule: Rule = STANDARD) -> StepStatistics:
    """Exact expected sums of :class:`StepStatistics` over the T positions of a Markov-chain pair
    (``genspec.theory.ChainPair``) decoded with a rule, one draft token judged at every position (the
    paper's abstraction), the states following the rule's own output chain (b p + R P at every state),
    not the target's. ``.means()`` is what a simulation measures per position on average."""
    def tensor(values):
        return torch.from_numpy(np.array(values, dtype=np.float64))

    marginal = tensor(chain.initial)
    totals = StepStatistics.zero()
    for n in range(chain.horizon):
        draft, target = tensor(chain.draft[n]), tensor(chain.target[n])  # [V states, V tokens]
        keep = keep_probabilities(target, draft, rule)
        resample = resampling_law(target, draft, rule)
        per_state = step_statistics(draft, target, keep, resample)
        totals.add(StepStatistics(*(float(marginal @ getattr(per_state, f.name).to(torch.float64))
                                    for f in fields(StepStatistics))))
        marginal = marginal @ output_law(draft, keep, resample)
    return totals


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
        rejection=float(rejection_probability(draft, keep)),
        loss_star=float(minimal_bias(draft, target, keep)),
        opt_bias=float(bias(draft, target, keep, opt_resampling(draft, target))),
        uno_bias=float(bias(draft, target, keep, residual_law(target, draft, "uno"))),  # = q
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
