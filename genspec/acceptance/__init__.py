"""Acceptance rules as pure functions on probability tensors.

Shared by the engine (real models), the draft-model drafter (hierarchical levels) and the theory
simulators (Markov chains), so that the one implementation that is checked against the theory is the
one that generates text. Convention: ``draft_probs`` = speculator (p in the theory), ``target_probs``
= large model (q). The rule itself is one value, :class:`Rule`.
"""
from genspec.acceptance.rule import BIAS_RULES, RESIDUALS, RULES, STANDARD, Residual, Rule, RuleKind  # noqa: F401
from genspec.acceptance.rules import (  # noqa: F401
    Candidates,
    ChainVerdict,
    MultiDraftVerdict,
    TargetLaw,
    Verdict,
    acceptance_probability,
    coupled_tokens,
    keep_probabilities,
    resampling_law,
    residual_distribution,
    sample_with_uniforms,
    typical_threshold,
    verify_chain,
    verify_greedy,
    verify,
    verify_multidraft,
    verify_tree,
)
