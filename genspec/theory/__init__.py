"""The theory of speculative decoding as a toolkit: compute it exactly, simulate it, draw it.

Specification: docs/theory.md (Yin et al., NeurIPS 2024; Leviathan et al., ICML 2023).
**p is the DRAFT, q is the TARGET**; the code says ``draft_probs`` / ``target_probs``.

- :mod:`~genspec.theory.chains`    Markov-chain pairs: JSON loading with validation, random pairs.
- :mod:`~genspec.theory.exact`     exact expected rejections (Thm 1, Thm 3, DPs of both M-draft variants,
                                   Prop. 1 limit, single-step improvement), float64 NumPy.
- :mod:`~genspec.theory.simulate`  Monte-Carlo simulators (vectorised over runs) built on
                                   :mod:`genspec.acceptance`, the engine's acceptance code.
- :mod:`~genspec.theory.pareto`    bias vs rejections (Thm 4/5), over-acceptance with OPT / UNO, typical
                                   acceptance; on arrays or tensors (the engine's bias measurement).
- :mod:`~genspec.theory.optimality` Theorem 2: standard SD against other rejection-based rules.
- :mod:`~genspec.theory.stats`     chi-square with pooled cells, Wilson interval.
- :mod:`~genspec.theory.leviathan` tokens per target call, speedup, optimal gamma.
- :mod:`~genspec.theory.figures`   the paper's figures (``genspec theory figures``).
"""
from genspec.theory.chains import ChainPair, load_chain, random_chain, save_chain  # noqa: F401
from genspec.theory.exact import (  # noqa: F401
    VARIANTS,
    bernoulli_improvement,
    expected_rejections,
    expected_rejections_limit,
    expected_rejections_sd,
    expected_rejections_theorem3,
    rejections_curve,
    single_step_improvement,
    total_variation,
    uniform_improvement,
    verifier_stages,
)
from genspec.theory.leviathan import acceptance_rate, expected_tokens_per_call, optimal_gamma, speedup  # noqa: F401
from genspec.theory.pareto import (  # noqa: F401
    ParetoPoint,
    minimal_bias,
    optimal_resampling,
    over_acceptance_point,
    pareto_front,
    pareto_table,
)
from genspec.theory.simulate import Simulation, sample_rejection_rule, simulate  # noqa: F401

__all__ = [
    "ChainPair", "load_chain", "random_chain", "save_chain",
    "VARIANTS", "bernoulli_improvement", "expected_rejections", "expected_rejections_limit", "expected_rejections_sd",
    "expected_rejections_theorem3", "rejections_curve", "single_step_improvement", "total_variation",
    "uniform_improvement", "verifier_stages",
    "acceptance_rate", "expected_tokens_per_call", "optimal_gamma", "speedup",
    "ParetoPoint", "minimal_bias", "optimal_resampling", "over_acceptance_point", "pareto_front", "pareto_table",
    "Simulation", "sample_rejection_rule", "simulate",
]
