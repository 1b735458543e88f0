"""Leviathan et al. (ICML 2023) closed forms for speculative decoding on real models.

i.i.d. approximation: every draft token is accepted with probability alpha = 1 - E[TV(p, q)]
(p = DRAFT, q = TARGET); the draft proposes gamma tokens per target call.

This is the one implementation of the expected-tokens formula (calibration and the benchmark's
theory column use it, and the engine's draft-length policy is to), so importing this module must stay
cheap: nothing here imports scipy or the exact/simulation modules at import time.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

from genspec.errors import ConfigError
from genspec.theory.budget import Cost, check
from genspec.theory.chains import ChainPair
from genspec.theory.exact import expected_rejections_sd

VerifyCost = Union[float, Callable[[int], float]]
#: one speedup evaluation in the optimal-gamma search, in seconds (measured: the manual's Theory toolkit page)
_SECONDS_PER_GAMMA = 1e-6


def _check(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha (acceptance rate) must be in [0, 1], got {alpha}")
    if gamma < 0 or int(gamma) != gamma:
        raise ConfigError(f"gamma (draft tokens per target call) must be an integer >= 0, got {gamma}")


def expected_tokens_per_call(alpha: float, gamma: int, first_alpha: Optional[float] = None) -> float:
    """E[tokens per target call] when gamma draft tokens are verified, counting the bonus token drawn
    from q after a fully accepted draft (or the residual draw after a rejection).

    Two-rate form: draft token 1 is accepted with probability ``first_alpha`` (default ``alpha``),
    token i + 1 with probability ``alpha`` given that token i was, so
    E = 1 + first * (1 + alpha + ... + alpha^(gamma-1)) = 1 + first * (1 - alpha^gamma) / (1 - alpha),
    1 + first * gamma at alpha = 1. With first = alpha it is Leviathan's (1 - alpha^(gamma+1)) / (1 - alpha).
    """
    _check(alpha, gamma)
    first = alpha if first_alpha is None else first_alpha
    if not 0.0 <= first <= 1.0:
        raise ConfigError(f"first_alpha (acceptance rate of draft token 1) must be in [0, 1], got {first}")
    return 1.0 + first * _geometric_sum(alpha, int(gamma))


def _geometric_sum(ratio: float, terms: int) -> float:
    """1 + ratio + ... + ratio^(terms-1) for ratio in [0, 1] (0 for terms = 0)."""
    if terms == 0:
        return 0.0
    if ratio == 1.0:
        return float(terms)
    if ratio == 0.0:
        return 1.0
    # (1 - ratio^terms) / (1 - ratio), with expm1/log so that it stays accurate as ratio -> 1
    # (1 - ratio is exact there; 1 - ratio**terms would cancel)
    return -math.expm1(terms * math.log(ratio)) / (1.0 - ratio)


def speedup(alpha: float, gamma: int, cost_ratio: float, verify_cost: VerifyCost = 1.0) -> float:
    """Wall-time speedup over plain decoding: tokens per call / (gamma c + verify cost).

    ``cost_ratio`` c = cost of one draft step / cost of one target step. ``verify_cost`` is the cost of
    the target call that scores gamma + 1 tokens, in units of one target step: 1 in the idealised model,
    or a measured number (a float, or a function of gamma) on real hardware.
    """
    if not (math.isfinite(cost_ratio) and cost_ratio >= 0):
        raise ConfigError(f"cost ratio c must be a finite number >= 0, got {cost_ratio}")
    verify = verify_cost(gamma) if callable(verify_cost) else float(verify_cost)
    if not (math.isfinite(verify) and verify > 0):
        raise ConfigError(f"verify cost must be a finite number > 0, got {verify}")
    return expected_tokens_per_call(alpha, gamma) / (gamma * cost_ratio + verify)


def optimal_gamma(alpha: float, cost_ratio: float, max_gamma: int = 64,
                  verify_cost: VerifyCost = 1.0) -> tuple[int, float]:
    """The gamma in 1..max_gamma with the largest :func:`speedup`, and that speedup.

    (gamma = 0 is plain decoding, speedup 1/verify cost; compare against it to decide whether to
    speculate at all.)
    """
    if max_gamma < 1:
        raise ConfigError(f"max gamma must be >= 1, got {max_gamma}")
    check(Cost(0.0, max_gamma * _SECONDS_PER_GAMMA), f"searching the optimal gamma in 1..{max_gamma}")
    best = max(range(1, max_gamma + 1), key=lambda g: speedup(alpha, g, cost_ratio, verify_cost))
    return best, speedup(alpha, best, cost_ratio, verify_cost)


def acceptance_rate(chain: ChainPair) -> float:
    """alpha of a chain pair: 1 - E[TV] averaged over the T positions of the target chain
    (= 1 - E[N_rej of SD] / T by Theorem 1)."""
    return 1.0 - expected_rejections_sd(chain) / chain.horizon
