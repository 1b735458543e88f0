"""Leviathan et al.'s closed forms (genspec.theory.leviathan): expected tokens per target call (the one
implementation of that formula), speedup, optimal gamma and alpha from a chain, and the lazy imports that
keep it cheap for the engine. p = draft, q = target."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genspec.errors import ConfigError
from genspec.theory import leviathan
from genspec.theory.chains import ChainPair, random_chain
from genspec.theory.exact import expected_rejections_sd
from genspec.theory.leviathan import expected_tokens_per_call as expected_tokens

rates = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 1 - 1e-12]), st.floats(0.0, 1.0))


def direct_sum(first: float, later: float, gamma: int) -> float:
    """1 + sum over draft positions i = 1..gamma of P[tokens 1..i all accepted] = first * later^(i-1),
    each probability built as a product along the chain."""
    total, reach = 1.0, first
    for _ in range(gamma):
        total += reach
        reach *= later
    return total


@settings(max_examples=300, deadline=None)
@given(rates, rates, st.integers(0, 40))
def test_two_rate_formula_is_the_sum_over_draft_positions(first, later, gamma):
    expected = direct_sum(first, later, gamma)
    assert leviathan.expected_tokens_per_call(later, gamma, first_alpha=first) == pytest.approx(
        expected, rel=1e-12, abs=0)


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 0.999), st.integers(0, 40))
def test_one_rate_is_the_two_rate_form_with_first_equal_to_alpha(alpha, gamma):
    one_rate = leviathan.expected_tokens_per_call(alpha, gamma)
    assert one_rate == leviathan.expected_tokens_per_call(alpha, gamma, first_alpha=alpha)
    assert one_rate == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha), rel=1e-12)


def test_the_first_rate_matters():
    """first = 0.9, later = 0.5, gamma = 3: 1 + 0.9 (1 + 0.5 + 0.25) = 2.575 (one rate 0.5: 1.875)."""
    assert leviathan.expected_tokens_per_call(0.5, 3, first_alpha=0.9) == pytest.approx(2.575, abs=1e-15)
    assert leviathan.expected_tokens_per_call(0.5, 3) == pytest.approx(1.875, abs=1e-15)


def test_later_rate_one_is_exact_and_gamma_zero_is_one_token():
    assert leviathan.expected_tokens_per_call(1.0, 7, first_alpha=0.25) == 1.0 + 0.25 * 7
    assert leviathan.expected_tokens_per_call(1.0, 7) == 8.0
    for alpha in (0.0, 0.3, 1.0):
        for first in (None, 0.0, 0.7, 1.0):
            assert leviathan.expected_tokens_per_call(alpha, 0, first_alpha=first) == 1.0


def test_later_rate_just_below_one_does_not_cancel():
    """(1 - later^gamma) / (1 - later) loses ~5 digits at later = 1 - 1e-12; the sum must not."""
    later = 1 - 1e-12
    assert leviathan.expected_tokens_per_call(later, 10, first_alpha=0.5) == pytest.approx(
        direct_sum(0.5, later, 10), rel=1e-13, abs=0)


def test_bad_first_rate_is_a_config_error():
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="first_alpha"):
            leviathan.expected_tokens_per_call(0.5, 3, first_alpha=bad)
    with pytest.raises(ConfigError, match="alpha"):
        leviathan.expected_tokens_per_call(1.5, 3, first_alpha=0.5)
    with pytest.raises(ConfigError, match="gamma"):
        leviathan.expected_tokens_per_call(0.5, 2.5)


def test_benchmark_theory_and_calibration_use_this_formula():
    from genspec import calibration
    from genspec.bench import analysis

    assert analysis.expected_tokens_per_call is leviathan.expected_tokens_per_call
    assert calibration.predicted_speedup(0.8, 4, 1.0, 0.0, 1.0) == leviathan.expected_tokens_per_call(0.8, 4)
    assert calibration.predicted_speedup(0.5, 2, 0.02, 0.001, 0.03) == pytest.approx(1.75 * 0.02 / 0.032)


# ------------------------------------------------------------------------------- closed forms


def test_expected_tokens_matches_leviathan_table():
    assert expected_tokens(0.6, 2) == pytest.approx(1.96)
    assert expected_tokens(0.8, 5) == pytest.approx(3.689, abs=1e-3)
    assert expected_tokens(0.9, 10) == pytest.approx(6.862, abs=1e-3)
    assert expected_tokens(1.0, 4) == 5


@pytest.mark.parametrize("alpha,gamma,tokens", [(0.6, 2, 1.96), (0.8, 5, 3.689), (0.9, 10, 6.862)])
def test_leviathan_tokens_per_call(alpha, gamma, tokens):
    assert leviathan.expected_tokens_per_call(alpha, gamma) == pytest.approx(tokens, abs=5e-4)


def test_leviathan_speedup_and_optimal_gamma():
    assert leviathan.speedup(0.9, 10, 0.1) == pytest.approx(3.431, abs=5e-4)
    assert leviathan.expected_tokens_per_call(1.0, 7) == 8.0
    assert leviathan.expected_tokens_per_call(0.0, 7) == 1.0
    gamma, best = leviathan.optimal_gamma(0.9, 0.1)
    brute = [leviathan.speedup(0.9, g, 0.1) for g in range(1, 65)]
    assert best == pytest.approx(max(brute)) and gamma == 1 + int(np.argmax(brute))
    # free drafts: longer is always better; a measured verify cost growing with gamma shortens it
    assert leviathan.optimal_gamma(0.9, 0.0, max_gamma=30)[0] == 30
    assert leviathan.optimal_gamma(0.9, 0.0, 30, verify_cost=lambda g: 1 + 0.1 * g)[0] < 30
    assert leviathan.speedup(0.8, 4, 0.05, verify_cost=1.3) == pytest.approx(
        leviathan.expected_tokens_per_call(0.8, 4) / (4 * 0.05 + 1.3))


def test_leviathan_alpha_from_a_chain_is_one_minus_mean_tv():
    chain = random_chain(7, 50, 0)
    assert leviathan.acceptance_rate(chain) == pytest.approx(1 - expected_rejections_sd(chain) / 50)
    same = ChainPair.from_arrays(chain.initial, chain.target, chain.target)
    assert leviathan.acceptance_rate(same) == pytest.approx(1.0)


def test_leviathan_rejects_bad_arguments():
    with pytest.raises(ConfigError):
        leviathan.expected_tokens_per_call(1.5, 3)
    with pytest.raises(ConfigError):
        leviathan.expected_tokens_per_call(0.5, -1)
    with pytest.raises(ConfigError):
        leviathan.speedup(0.5, 3, -0.1)


# ---------------------------------------------------------------------------------- lazy imports


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (this one has long imported everything); its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_leviathan_does_not_load_scipy():
    """The engine imports Leviathan's formula (draft_length): that must not cost scipy's import."""
    out = _fresh_python(
        "import sys, genspec.theory.leviathan as lev\n"
        "print(lev.expected_tokens_per_call(0.5, 2))\n"
        "print('scipy' in sys.modules)")
    assert out.splitlines() == ["1.75", "False"]


# the names genspec.theory exported when it imported its submodules eagerly
PUBLIC_NAMES = {
    "chains": ["ChainPair", "load_chain", "random_chain", "save_chain"],
    "exact": ["VARIANTS", "bernoulli_improvement", "expected_rejections", "expected_rejections_limit",
              "expected_rejections_sd", "expected_rejections_theorem3", "rejections_curve",
              "single_step_improvement", "total_variation", "uniform_improvement", "verifier_stages"],
    "leviathan": ["acceptance_rate", "expected_tokens_per_call", "optimal_gamma", "speedup"],
    "pareto": ["ParetoPoint", "minimal_bias", "optimal_resampling", "over_acceptance_point", "pareto_front",
               "pareto_table"],
    "simulate": ["Simulation", "sample_rejection_rule", "simulate"],
}


def test_every_public_name_of_the_theory_package_resolves():
    import importlib

    import genspec.theory.simulate  # noqa: F401 - binds the submodule on the package, as figures.py does
    from genspec import theory

    assert sorted(theory.__all__) == sorted(name for names in PUBLIC_NAMES.values() for name in names)
    for module, names in PUBLIC_NAMES.items():
        for name in names:
            assert getattr(theory, name) is getattr(importlib.import_module(f"genspec.theory.{module}"), name)
    assert callable(theory.simulate)  # the function, not the submodule of the same name
    with pytest.raises(AttributeError):
        theory.no_such_name  # noqa: B018
