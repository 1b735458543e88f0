"""Exact formulas of genspec.theory.exact (theory.md): Theorems 1 and 3, the DPs of both M-draft
variants, the residual verifier's facts, Proposition 1's limit and the single-step closed forms.
p = draft, q = target."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genspec.errors import ConfigError
from genspec.theory import exact
from genspec.theory.chains import ChainPair, random_chain


def distribution(size: int, allow_zeros: bool = True):
    """Hypothesis strategy: a probability vector of ``size`` entries (some may be exactly 0)."""
    entry = st.one_of(st.just(0.0), st.floats(0.001, 1.0)) if allow_zeros else st.floats(0.001, 1.0)
    return st.lists(entry, min_size=size, max_size=size).filter(lambda xs: sum(xs) > 0).map(
        lambda xs: np.array(xs) / sum(xs))


def mixed_chain(vocab: int, horizon: int, seed: int, floor: float = 0.5) -> ChainPair:
    """A random pair whose draft rows are mixed with the uniform law (p >= floor / V everywhere)."""
    base = random_chain(vocab, horizon, seed)
    draft = (1 - floor) * base.draft + floor / vocab
    return ChainPair.from_arrays(base.initial, draft, base.target)


chain_params = st.tuples(st.integers(0, 10_000), st.sampled_from([2, 3, 5, 7]), st.integers(1, 12))


# ------------------------------------------------------------------------------------------- Thm 1


def test_theorem1_by_hand_on_a_two_step_chain():
    initial = np.array([1.0, 0.0])
    draft = np.array([[[0.5, 0.5], [0.5, 0.5]], [[1.0, 0.0], [0.2, 0.8]]])
    target = np.array([[[0.9, 0.1], [0.5, 0.5]], [[0.0, 1.0], [0.2, 0.8]]])
    chain = ChainPair.from_arrays(initial, draft, target)
    # n = 1: state 0 surely, TV((.5,.5), (.9,.1)) = 0.4; n = 2: x_1 ~ (0.9, 0.1): 0.9 * 1 + 0.1 * 0
    assert exact.expected_rejections_sd(chain) == pytest.approx(0.4 + 0.9)


@settings(max_examples=25, deadline=None)
@given(chain_params)
def test_dp_with_one_draft_is_theorem1(params):
    seed, vocab, horizon = params
    chain = random_chain(vocab, horizon, seed)
    sd = exact.expected_rejections_sd(chain)
    for variant in exact.VARIANTS:
        assert exact.expected_rejections(chain, 1, variant) == pytest.approx(sd, rel=1e-12)


# ------------------------------------------------------------------------------------------- Thm 3


@settings(max_examples=30, deadline=None)
@given(chain_params, st.integers(1, 8))
def test_theorem3_closed_formula_matches_the_dp(params, batch):
    """Thm 3 with f(empty) = 1 agrees with the fresh/single DP to 1e-10 relative."""
    seed, vocab, horizon = params
    chain = random_chain(vocab, horizon, seed)
    dp = exact.expected_rejections(chain, batch, "batch")
    formula = exact.expected_rejections_theorem3(chain, batch)
    assert formula == pytest.approx(dp, rel=1e-10, abs=1e-12)


def _theorem3_reading(chain: ChainPair, batch: int, f_empty: float, weight_by_next: bool) -> float:
    """Theorem 3 as written, with the base case f(empty) and which f weights the n-th correction
    (f(x_{1:n-1}) is right; f(x_{1:n}) is a misreading) as knobs."""
    marginal, f_marginal = chain.initial.copy(), f_empty * chain.initial
    total = 0.0
    for n in range(chain.horizon):
        draft, target = chain.draft[n], chain.target[n]
        tv = exact.total_variation(draft, target)
        stages = exact.verifier_stages(target, draft, batch)
        saved = tv - stages.all_rejected[-1]
        next_f = (marginal - f_marginal) @ exact.positive_part(target - draft) + \
            (f_marginal * stages.all_rejected[-1]) @ stages.residual[-1]
        total += float(marginal @ tv)
        if weight_by_next:  # sum over x_n of f(x_{1:n}), as a weight on the state x_{n-1}
            weight = (marginal - f_marginal) * tv + f_marginal * stages.all_rejected[-1]
        else:
            weight = f_marginal
        total -= float(weight @ saved)
        marginal, f_marginal = marginal @ target, next_f
    return total


def test_theorem3_misreadings_are_clearly_off():
    """theory.md: f(empty) = 1 is exact; f(empty) = 0, or weighting the n-th correction by f(x_{1:n}),
    is off by about 0.1-0.2 at V = 7, T = 10 (well outside simulation error)."""
    chain = random_chain(7, 10, 0)
    dp = exact.expected_rejections(chain, 4, "batch")
    assert _theorem3_reading(chain, 4, 1.0, False) == pytest.approx(dp, rel=1e-12)
    assert abs(_theorem3_reading(chain, 4, 0.0, False) - dp) > 0.05
    assert abs(_theorem3_reading(chain, 4, 1.0, True) - dp) > 0.05


@settings(max_examples=20, deadline=None)
@given(chain_params, st.integers(1, 6))
def test_fresh_plus_single_is_the_target_marginal(params, batch):
    seed, vocab, horizon = params
    chain = random_chain(vocab, horizon, seed)
    fresh, single = exact.batch_dp_masses(chain, batch)
    np.testing.assert_allclose(fresh + single, chain.target_marginals()[:-1], atol=1e-12)
    assert np.all(fresh >= -1e-15) and np.all(single >= -1e-15)


# ------------------------------------------------------------------------------ residual verifier


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6).flatmap(lambda v: st.tuples(distribution(v), distribution(v, allow_zeros=False))),
       st.integers(1, 8))
def test_verifier_facts(pair, stages_count):
    """Stage j rejects w.p. r_j = TV(q^j, p); accepts y w.p. (prod_{i<j} r_i) min{p, q^j}(y);
    all K reject w.p. prod r_j; the output law is exactly q."""
    target, draft = pair
    stages = exact.verifier_stages(target, draft, stages_count)
    for j in range(stages_count):
        law = stages.residual[j][0]
        assert stages.stage_rejection[j, 0] == pytest.approx(float(exact.total_variation(law, draft)), abs=1e-12)
        expected = stages.all_rejected[j, 0] * np.minimum(draft, law)
        np.testing.assert_allclose(stages.accepted[j, 0], expected, atol=1e-14)
    assert stages.all_rejected[-1, 0] == pytest.approx(np.prod(stages.stage_rejection[:, 0]), abs=1e-14)
    np.testing.assert_allclose(stages.output_law()[0], target, atol=1e-12)
    # a rejected token keeps zero residual mass afterwards: the residual after a stage lives on q^j > p
    for j in range(1, stages_count + 1):
        previous = stages.residual[j - 1][0]
        assert np.all(stages.residual[j][0][previous <= draft] == 0) or stages.all_rejected[j, 0] == 0


def test_round_start_accepted_mass_is_q_minus_rejected_residual():
    """DP check of theory.md: the accepted mass from fresh(x) totals q - prod r_j q^{M+1}."""
    chain = random_chain(5, 3, 11)
    for n in range(chain.horizon):
        out = exact.verifier_outcome(chain.target[n], chain.draft[n], 4)
        np.testing.assert_allclose(out.accepted, chain.target[n] - out.rejected[:, None] * out.residual,
                                   atol=1e-14)


# ---------------------------------------------------------------------- variants, limit, degenerate


@settings(max_examples=20, deadline=None)
@given(chain_params, st.integers(2, 6))
def test_multidraft_never_worse_than_batch_and_both_decrease_in_m(params, batch):
    seed, vocab, horizon = params
    chain = random_chain(vocab, horizon, seed)
    curve_batch = exact.rejections_curve(chain, range(1, batch + 1), "batch")
    curve_multi = exact.rejections_curve(chain, range(1, batch + 1), "multidraft")
    assert np.all(curve_multi <= curve_batch + 1e-12)
    assert np.all(np.diff(curve_batch) <= 1e-12) and np.all(np.diff(curve_multi) <= 1e-12)
    assert exact.expected_rejections_limit(chain, "batch") <= curve_batch[-1] + 1e-12
    assert exact.expected_rejections_limit(chain, "multidraft") <= curve_multi[-1] + 1e-12


def test_batch_limit_matches_large_m_and_is_positive():
    """Prop. 1: the DP at M = 400 equals the fixed-point limit when every stage rejects with
    probability <= 1 - 1/(2V) (draft mixed with uniform); the limit is strictly positive."""
    chain = mixed_chain(3, 6, seed=5)
    limit = exact.expected_rejections_limit(chain, "batch")
    assert limit > 0.1
    assert exact.expected_rejections(chain, 400, "batch") == pytest.approx(limit, rel=1e-9)


def test_multidraft_limit_on_one_position_matches_large_m():
    chain = mixed_chain(4, 1, seed=2)
    for variant in exact.VARIANTS:
        limit = exact.expected_rejections_limit(chain, variant)
        assert limit == pytest.approx(0.0, abs=1e-15)
        assert exact.expected_rejections(chain, 300, variant) == pytest.approx(limit, abs=1e-9)


def test_limit_keeps_rejections_when_the_fixed_point_is_outside_the_draft_support():
    """Target puts mass on a token the draft never proposes: prod r_j stays positive."""
    draft = np.array([[0.5, 0.5, 0.0]] * 3)
    target = np.array([[0.2, 0.3, 0.5]] * 3)
    chain = ChainPair.from_arrays(np.array([1.0, 0, 0]), draft[None], target[None])
    # stage 1: r = 0.5, residual (0, 0, 1) outside p's support: r = 1 afterwards -> limit 0.5
    for variant in exact.VARIANTS:
        assert exact.expected_rejections_limit(chain, variant) == pytest.approx(0.5, abs=1e-15)
        assert exact.expected_rejections(chain, 7, variant) == pytest.approx(0.5, abs=1e-15)


def test_identical_draft_and_target_give_zero_rejections_for_every_m():
    base = random_chain(6, 20, 3)
    chain = ChainPair.from_arrays(base.initial, base.target, base.target)
    assert exact.expected_rejections_sd(chain) == 0.0
    for variant in exact.VARIANTS:
        for batch in (1, 2, 3, 5, 8, 16, math.inf):
            assert exact.expected_rejections(chain, batch, variant) == pytest.approx(0.0, abs=1e-13)
    assert exact.expected_rejections_theorem3(chain, 4) == pytest.approx(0.0, abs=1e-13)


def test_disjoint_supports_give_horizon_rejections():
    """Draft only on tokens {0, 1}, target only on {2, 3}: every position rejects, for every M."""
    vocab, horizon = 4, 9
    rng = np.random.default_rng(0)
    draft = np.zeros((horizon, vocab, vocab))
    target = np.zeros((horizon, vocab, vocab))
    draft[..., :2] = rng.dirichlet(np.ones(2), size=(horizon, vocab))
    target[..., 2:] = rng.dirichlet(np.ones(2), size=(horizon, vocab))
    chain = ChainPair.from_arrays(np.full(vocab, 0.25), draft, target)
    assert exact.expected_rejections_sd(chain) == pytest.approx(horizon)
    for variant in exact.VARIANTS:
        for batch in (1, 3, math.inf):
            assert exact.expected_rejections(chain, batch, variant) == pytest.approx(horizon)


def test_flat_dirichlet_pairs_are_about_23_at_v7_t50():
    """theory.md: flat-Dirichlet pairs give about 23 rejections at V = 7, T = 50."""
    values = [exact.expected_rejections_sd(random_chain(7, 50, seed)) for seed in range(5)]
    assert 21 < np.mean(values) < 25


def test_bad_batch_or_variant_is_a_config_error():
    chain = random_chain(3, 2, 0)
    with pytest.raises(ConfigError):
        exact.expected_rejections(chain, 0)
    with pytest.raises(ConfigError):
        exact.expected_rejections(chain, 2, "tree")


# -------------------------------------------------------------------- single-step improvement


@settings(max_examples=60, deadline=None)
@given(st.floats(0.01, 0.99), st.floats(0.01, 0.99), st.integers(1, 20))
def test_bernoulli_closed_form_matches_recursion(u, v, batch):
    draft, target = exact.bernoulli_pair(u, v)
    assert exact.single_step_improvement(draft, target, batch) == pytest.approx(
        exact.bernoulli_improvement(u, v, batch), abs=1e-12)


@pytest.mark.parametrize("vocab,ratio", [(12, 1), (12, 2), (12, 3), (12, 4), (20, 5), (8, 8)])
@pytest.mark.parametrize("batch", [1, 2, 3, 7, 20])
def test_uniform_closed_form_matches_recursion_and_swapped_roles_give_zero(vocab, ratio, batch):
    draft, target = exact.uniform_pair(vocab, ratio)
    assert exact.single_step_improvement(draft, target, batch) == pytest.approx(
        exact.uniform_improvement(ratio, batch), abs=1e-12)
    assert exact.single_step_improvement(target, draft, batch) == pytest.approx(0.0, abs=1e-12)


def test_improvements_saturate():
    """Both improvements grow with M towards TV(q, p) (prod r_j -> 0)."""
    assert exact.bernoulli_improvement(0.6, 0.3, 200) == pytest.approx(0.3)
    assert exact.uniform_improvement(4, 200) == pytest.approx(0.75)
