"""Theorem 2 in numbers: no unbiased rejection-based rule rejects less than standard speculative decoding.

A rejection-based rule drafts y ~ p, keeps it with probability b(y) and otherwise resamples from P
(p = DRAFT, q = TARGET). Its output law is b p + R P (:mod:`genspec.theory.pareto`); it is unbiased iff
that is q, which needs q - b p >= 0, i.e. b <= min{1, q/p}, and then P = (q - b p) / R is the only law
that works (it is Theorem 4's norm([q - b p]_+), which every rule here resamples from). R = sum (1 - b) p
is smallest at b = min{1, q/p}: standard speculative decoding.

:func:`compare_rules` runs, on a Markov-chain pair, the standard rule against unbiased rivals with less
acceptance (its b scaled by a factor c < 1, or raised to a power > 1) and, for contrast, a rule above the
bound (over-acceptance, eps > 0), which rejects less but is biased. For each: the exact expected
rejections over the T positions (states following the rule's own output chain), the largest exact bias
TV(b p + R P, q) over positions and states, and optionally a simulation (:func:`genspec.theory.simulate.
simulate_rule`) with the chi-square p-value of its last token against the target chain's law.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from genspec.acceptance import STANDARD
from genspec.acceptance import Rule as AcceptanceRule
from genspec.acceptance import keep_probabilities, residual_distribution
from genspec.errors import ConfigError
from genspec.theory.chains import ChainPair
from genspec.theory.pareto import bias, output_law, rejection_probability
from genspec.theory.simulate import simulate_rule
from genspec.theory.stats import chi_square_pvalue

#: an exact bias at or below this counts as unbiased (float64 rounding of laws over V <= a few hundred)
UNBIASED_TOLERANCE = 1e-12
DEFAULT_FACTORS = (0.9, 0.75, 0.5)
DEFAULT_POWERS = (2.0,)
DEFAULT_EPSILON = 0.1


@dataclass(frozen=True)
class Rule:
    """A rejection-based rule: ``keep(draft, target)`` gives b ``[S, V]`` for laws ``[S, V]``."""

    name: str
    description: str
    keep: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RuleOutcome:
    name: str
    description: str
    expected_rejections: float  # exact, over the T positions
    max_bias: float  # exact, max over positions and states of TV(b p + R P, q)
    unbiased: bool
    simulated_mean: float | None = None
    simulated_stderr: float | None = None
    chi_square_pvalue: float | None = None  # simulated x_T against the target chain's marginal

    def as_dict(self) -> dict:
        return asdict(self)


def _standard(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return keep_probabilities(target, draft, STANDARD)


def comparison_rules(factors=DEFAULT_FACTORS, powers=DEFAULT_POWERS, epsilon: float = DEFAULT_EPSILON) -> list[Rule]:
    """The standard rule first, then the scaled (b = c min{1, q/p}), power (b = min{1, q/p}^g) and, if
    ``epsilon`` > 0, over-acceptance (b = min{1, (q + eps)/p}) rules."""
    for c in factors:
        if not 0 < c <= 1:
            raise ConfigError(f"scaling factors must be in (0, 1], got {c}")
    for g in powers:
        if g < 1:
            raise ConfigError(f"powers must be >= 1, got {g}")
    if epsilon < 0:
        raise ConfigError(f"epsilon must be >= 0, got {epsilon}")
    rules = [Rule("standard", "b = min{1, q/p} (speculative decoding)", _standard)]
    rules += [Rule(f"scaled {c:g}", f"b = {c:g} min{{1, q/p}}", lambda d, t, c=c: c * _standard(d, t)) for c in factors]
    rules += [Rule(f"power {g:g}", f"b = min{{1, q/p}}^{g:g}", lambda d, t, g=g: _standard(d, t) ** g) for g in powers]
    if epsilon > 0:
        rules.append(Rule(f"overaccept {epsilon:g}", f"b = min{{1, (q + {epsilon:g})/p}} (above the bound)",
                          lambda d, t: keep_probabilities(t, d, AcceptanceRule(epsilon=epsilon))))
    return rules


def rule_laws(chain: ChainPair, rule: Rule) -> tuple[np.ndarray, np.ndarray]:
    """(b ``[T, V, V]``, P ``[T, V, V]``) of a rule at every position and state; P = norm([q - b p]_+)."""
    draft, target = torch.from_numpy(np.array(chain.draft)), torch.from_numpy(np.array(chain.target))
    keep = rule.keep(draft, target)
    return keep.numpy(), residual_distribution(target, draft, "opt", keep).numpy()


def evaluate_rule(chain: ChainPair, rule: Rule, num_runs: int = 0, seed: int = 0) -> RuleOutcome:
    """Exact expected rejections and largest bias of one rule on ``chain``; with ``num_runs`` also simulated."""
    keep, resample = rule_laws(chain, rule)
    marginal, expected, worst = chain.initial, 0.0, 0.0
    for n in range(chain.horizon):
        expected += float(marginal @ rejection_probability(chain.draft[n], keep[n]))
        worst = max(worst, float(np.max(bias(chain.draft[n], chain.target[n], keep[n], resample[n]))))
        marginal = marginal @ output_law(chain.draft[n], keep[n], resample[n])
    outcome = RuleOutcome(rule.name, rule.description, expected, worst, worst <= UNBIASED_TOLERANCE)
    if num_runs:
        simulation = simulate_rule(chain, keep, resample, num_runs, seed)
        counts = np.bincount(simulation.sequences[:, -1], minlength=chain.vocab_size)
        outcome.simulated_mean, outcome.simulated_stderr = simulation.mean, simulation.stderr
        outcome.chi_square_pvalue = chi_square_pvalue(counts, chain.target_marginals()[-1])
    return outcome


def compare_rules(chain: ChainPair, rules: list[Rule] | None = None, num_runs: int = 0,
                  seed: int = 0) -> list[RuleOutcome]:
    """:func:`evaluate_rule` for each rule (default :func:`comparison_rules`), all with the same seed."""
    return [evaluate_rule(chain, rule, num_runs, seed) for rule in (rules or comparison_rules())]


def single_step_chain(draft_probs, target_probs) -> ChainPair:
    """One distribution pair as a chain of horizon 1 (every state has the same laws)."""
    draft, target = np.asarray(draft_probs, dtype=np.float64), np.asarray(target_probs, dtype=np.float64)
    vocab = draft.shape[0]
    return ChainPair.from_arrays(np.full(vocab, 1.0 / vocab), np.tile(draft, (1, vocab, 1)),
                                 np.tile(target, (1, vocab, 1)))
