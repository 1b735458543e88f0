"""Bias vs rejections (Theorems 4 and 5): the Pareto identity, the keep and resampling rules of the
family, and their sampled laws. p = draft, q = target."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import chi_square_pvalue

from genspec.acceptance import Rule, acceptance_probability, residual_distribution
from genspec.errors import ConfigError
from genspec.theory import pareto
from genspec.theory.exact import total_variation
from genspec.theory.simulate import sample_rejection_rule

EPSILONS = np.linspace(0.0, 0.6, 25)


def distribution(size: int):
    entry = st.one_of(st.just(0.0), st.floats(0.001, 1.0))
    return st.lists(entry, min_size=size, max_size=size).filter(lambda xs: sum(xs) > 0).map(
        lambda xs: np.array(xs) / sum(xs))


pairs = st.integers(2, 8).flatmap(lambda v: st.tuples(distribution(v), distribution(v)))


# ------------------------------------------------------------------------------------- Theorem 5


@settings(max_examples=80, deadline=None)
@given(pairs)
def test_pareto_identity_over_the_epsilon_grid(pair):
    """R + Loss* = TV(p, q) to 1e-12 for every eps; OPT's exact law has bias Loss*, UNO's >= Loss*."""
    draft, target = pair
    tv = float(total_variation(draft, target))
    for point in pareto.pareto_table(draft, target, EPSILONS):
        assert point.rejection + point.loss_star == pytest.approx(tv, abs=1e-12)
        assert point.opt_bias == pytest.approx(point.loss_star, abs=1e-12)
        assert point.uno_bias >= point.loss_star - 1e-12


@settings(max_examples=60, deadline=None)
@given(pairs, st.data())
def test_identity_holds_for_every_rule_in_the_family(pair, data):
    """Theorem 5 for any b in [min{1, q/p}, 1], not only over-acceptance."""
    draft, target = pair
    low = pareto.lossless_keep(draft, target)
    mix = np.array(data.draw(st.lists(st.floats(0, 1), min_size=draft.size, max_size=draft.size)))
    keep = low + mix * (1 - low)
    tv = float(total_variation(draft, target))
    loss = pareto.minimal_bias(draft, target, keep)
    assert pareto.rejection_probability(draft, keep) + loss == pytest.approx(tv, abs=1e-12)
    if pareto.rejection_probability(draft, keep) > 1e-9:
        best = pareto.optimal_resampling(draft, target, keep)
        assert pareto.bias(draft, target, keep, best) == pytest.approx(loss, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(pairs, st.floats(0.0, 0.5), st.integers(0, 2**31))
def test_no_resampling_law_beats_loss_star(pair, epsilon, seed):
    """Theorem 4: Loss* is a minimum: random resampling laws P never have smaller bias."""
    draft, target = pair
    keep = pareto.over_acceptance_keep(draft, target, epsilon)
    loss = pareto.minimal_bias(draft, target, keep)
    for law in np.random.default_rng(seed).dirichlet(np.ones(draft.size), size=20):
        assert pareto.bias(draft, target, keep, law) >= loss - 1e-12


def test_worked_example_of_theory_md():
    """p = (0.3, 0.7), q = (0.5, 0.5), TV = 0.2: eps 0 -> R 0.2, Loss* 0, UNO 0.1; eps 0.1 -> 0.1, 0.1,
    0.15; eps 0.3 -> 0, 0.2, 0.2."""
    table = {pt.epsilon: pt for pt in pareto.pareto_table((0.3, 0.7), (0.5, 0.5), (0.0, 0.1, 0.3))}
    expected = {0.0: (0.2, 0.0, 0.1), 0.1: (0.1, 0.1, 0.15), 0.3: (0.0, 0.2, 0.2)}
    for eps, (rejection, loss, uno) in expected.items():
        point = table[eps]
        assert (point.rejection, point.loss_star, point.opt_bias, point.uno_bias) == pytest.approx(
            (rejection, loss, loss, uno), abs=1e-12)
    np.testing.assert_allclose(pareto.pareto_front((0.3, 0.7), (0.5, 0.5)), [[0.2, 0.0], [0.0, 0.2]], atol=1e-15)


def test_numpy_keep_probability_is_the_shared_rule():
    rng = np.random.default_rng(0)
    draft, target = rng.dirichlet(np.ones(9)), rng.dirichlet(np.ones(9))
    for eps in (0.0, 0.05, 0.3):
        shared = acceptance_probability(torch.from_numpy(target), torch.from_numpy(draft), eps).numpy()
        np.testing.assert_allclose(pareto.over_acceptance_keep(draft, target, eps), shared, rtol=1e-15)


@settings(max_examples=100, deadline=None)
@given(pairs, st.sampled_from([0.0, 0.05, 0.3]), st.data())
def test_keep_probabilities_are_the_shared_rule_with_zeros_in_the_draft(pair, epsilon, data):
    """lossless_keep / over_acceptance_keep return exactly acceptance_probability's b, also where p = 0
    (some of those with q = 0 too)."""
    draft, target = pair
    zeros = data.draw(st.lists(st.booleans(), min_size=draft.size, max_size=draft.size))
    zeros[int(np.argmax(draft))] = False  # keep the draft a distribution
    draft = np.where(zeros, 0.0, draft)
    draft = draft / draft.sum()
    target = np.where(zeros[::-1] if data.draw(st.booleans()) else zeros, 0.0, target)
    if target.sum() == 0:
        target = draft.copy()
    target = target / target.sum()
    shared = acceptance_probability(torch.from_numpy(target), torch.from_numpy(draft), epsilon).numpy()
    np.testing.assert_array_equal(pareto.over_acceptance_keep(draft, target, epsilon), shared)
    if epsilon == 0.0:
        np.testing.assert_array_equal(pareto.lossless_keep(draft, target), shared)


def test_token_with_zero_draft_and_target_mass_gets_the_shared_rules_keep_probability():
    """p(y) = q(y) = 0: acceptance_probability keeps y iff q(y) + eps > 0, so b = 0 at eps = 0 and 1 at
    eps > 0 (the old NumPy twin said 1 at eps = 0); where p(y) = 0 < q(y), b = 1. R, the output law and
    the biases do not depend on b where p = 0."""
    draft, target = np.array([0.0, 0.0, 0.6, 0.4]), np.array([0.0, 0.3, 0.2, 0.5])
    np.testing.assert_array_equal(pareto.lossless_keep(draft, target), [0.0, 1.0, 0.2 / 0.6, 1.0])
    np.testing.assert_array_equal(pareto.over_acceptance_keep(draft, target, 0.1)[:2], [1.0, 1.0])
    point = pareto.over_acceptance_point(draft, target, 0.0)
    assert point.rejection == pytest.approx(0.4, abs=1e-15)
    assert point.loss_star == 0.0 and point.opt_bias == pytest.approx(0.0, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(pairs)
def test_opt_resampling_is_the_shared_residual(pair):
    """Decoding-OPT's law is residual_distribution(q, p, "opt"), including its fallback to q when
    [q - p]_+ is all zero (p = q)."""
    draft, target = pair
    for d, t in ((draft, target), (target, target)):
        shared = residual_distribution(torch.from_numpy(t), torch.from_numpy(d), "opt").numpy()
        np.testing.assert_array_equal(pareto.opt_resampling(d, t), shared)
    np.testing.assert_array_equal(pareto.opt_resampling(target, target), target)


@pytest.mark.parametrize("rule", ["opt", "uno"])
def test_sampled_opt_and_uno_follow_their_predicted_laws(rule):
    """N = 10^5 samples of the relaxed rule (eps = 0.1, V = 6) pass a chi-square test (threshold 10^-3)
    against b p + R P, and fail it against q (they are biased)."""
    rng = np.random.default_rng(12)
    draft, target = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    keep = pareto.over_acceptance_keep(draft, target, 0.1)
    law = pareto.opt_resampling(draft, target) if rule == "opt" else target
    tokens, rejected = sample_rejection_rule(draft, keep, law, 100_000, seed=2)
    counts = np.bincount(tokens, minlength=6)
    assert chi_square_pvalue(counts, pareto.output_law(draft, keep, law)) > 1e-3
    assert chi_square_pvalue(counts, target) < 1e-3
    assert rejected.mean() == pytest.approx(pareto.rejection_probability(draft, keep), abs=0.005)


def test_bad_pairs_are_config_errors():
    with pytest.raises(ConfigError, match="sums to"):
        pareto.over_acceptance_point((0.3, 0.6), (0.5, 0.5), 0.1)
    with pytest.raises(ConfigError, match="entries"):
        pareto.over_acceptance_point((0.3, 0.7), (0.2, 0.3, 0.5), 0.1)
    with pytest.raises(ConfigError, match="epsilon"):
        pareto.over_acceptance_point((0.3, 0.7), (0.5, 0.5), -0.1)


# ------------------------------------------------------------------------------------- measured bias (issue 17)
epsilons = st.floats(0.0, 0.5)


@settings(max_examples=120, deadline=None)
@given(pairs, epsilons, st.floats(0.0, 2.0))
def test_uno_bias_is_at_least_opts_on_random_pairs(pair, epsilon, delta):
    """Through the engine's measurement path (pareto.rule_statistics on tensors): for over-acceptance and
    typical acceptance, UNO's bias >= OPT's = Loss* (Theorem 4) >= the front [TV - R]_+ (Theorem 5), and for
    over-acceptance R + Loss* = TV and the tensor path equals the NumPy ParetoPoint."""
    draft, target = (torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in pair)
    for rule in ("overaccept", "typical"):
        opt = pareto.rule_statistics(draft, target, Rule(rule, epsilon, "opt", delta))
        uno = pareto.rule_statistics(draft, target, Rule(rule, epsilon, "uno", delta))
        assert float(uno.bias) >= float(opt.bias) - 1e-12
        assert float(opt.bias) == pytest.approx(float(opt.loss_star), abs=1e-12)
        assert float(opt.pareto_bias) <= float(opt.bias) + 1e-12
        assert float(uno.rejection) == pytest.approx(float(opt.rejection), abs=1e-15)
    over = pareto.rule_statistics(draft, target, Rule("overaccept", epsilon, "opt"))
    assert float(over.rejection + over.loss_star) == pytest.approx(float(over.tv), abs=1e-12)
    point = pareto.over_acceptance_point(*pair, epsilon)
    uno = pareto.rule_statistics(draft, target, Rule("overaccept", epsilon, "uno"))
    assert (point.rejection, point.loss_star, point.opt_bias, point.uno_bias) == pytest.approx(
        (float(over.rejection), float(over.loss_star), float(over.bias), float(uno.bias)), abs=1e-12)


@pytest.mark.parametrize("rule, epsilon, residual", [("overaccept", 0.15, "opt"), ("overaccept", 0.15, "uno"),
                                                     ("overaccept", 0.0, "uno"), ("typical", 0.2, "opt")])
def test_measured_bias_on_a_markov_chain_pair_matches_the_exact_expectation(rule, epsilon, residual):
    """Simulate N = 20,000 runs of a random chain pair (V = 5, T = 8) with the rule (the engine's
    verify code), measure at every visited state with pareto.chain_step_statistics (the engine's
    measurement) and average per position: the bias, R, and the simulated rejection frequency lie within
    4 standard errors of pareto.chain_statistics (exact, states following the rule's own chain); OPT's
    exact bias equals its exact Loss*."""
    from genspec.theory.chains import random_chain
    from genspec.theory.simulate import simulate

    chain = random_chain(5, 8, 3)
    n = 20_000
    rule = Rule(rule, epsilon, residual, 0.3)
    simulation = simulate(chain, n, rule=rule, seed=4)
    per_run = np.zeros((n, 2))  # measured bias and R, summed over positions
    for position in range(chain.horizon):
        states = torch.from_numpy(simulation.sequences[:, position])
        draft = torch.from_numpy(np.array(chain.draft[position]))[states].unsqueeze(1)  # [N, 1, V]
        target = torch.from_numpy(np.array(chain.target[position]))[states].unsqueeze(1).expand(n, 2, -1)
        measured = pareto.chain_step_statistics(torch.zeros(n, 1, dtype=torch.long), draft, target,
                                                torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long),
                                                rule)
        per_run += torch.stack([measured.bias, measured.rejection], 1).numpy()
    exact = pareto.chain_statistics(chain, rule).means()
    assert exact["judged_positions"] == chain.horizon
    for values, expected in ((per_run[:, 0] / chain.horizon, exact["bias_tv"]),
                             (per_run[:, 1] / chain.horizon, exact["rejection_rate"]),
                             (simulation.rejections / chain.horizon, exact["rejection_rate"])):
        stderr = values.std(ddof=1) / np.sqrt(n)
        assert abs(values.mean() - expected) < 4 * stderr + 1e-12
    if residual == "opt":
        assert exact["bias_tv"] == pytest.approx(exact["loss_star"], abs=1e-12)
    if rule == "overaccept":
        assert exact["rejection_rate"] + exact["loss_star"] == pytest.approx(exact["tv"], abs=1e-12)
    assert exact["bias_tv"] > 0.01  # every setting here is lossy: the test has something to see
