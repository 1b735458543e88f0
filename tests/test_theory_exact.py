"""Exact formulas of genspec.theory.exact (docs/theory.md): Theorems 1 and 3, the DPs of both M-draft
variants, the residual verifier's facts, Proposition 1's limit and the single-step closed forms.
p = draft, q = target."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import genspec.acceptance
from genspec.acceptance import acceptance_probability, residual_distribution
from genspec.errors import ConfigError
from genspec.theory import exact, pareto
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
    """docs/theory.md: f(empty) = 1 is exact; f(empty) = 0, or weighting the n-th correction by f(x_{1:n}),
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
    # (unless [q^j - p]_+ is all zero and the shared rule falls back to q: then q^j = p up to rounding
    # and the rule's rejection probability sum p (1 - b) is 0 or a few ulps, see the test below)
    for j in range(1, stages_count + 1):
        previous = stages.residual[j - 1][0]
        assert np.all(stages.residual[j][0][previous <= draft] == 0) or stages.all_rejected[j, 0] <= 1e-15


def rows_with_zeros(seed: int, states: int = 6, vocab: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """(target [S, V], draft [S, V]) random rows with zeros in both, one token with p = q = 0 per row,
    and one row where the draft equals the target."""
    rng = np.random.default_rng(seed)
    target = rng.dirichlet(np.ones(vocab), size=states) * (rng.random((states, vocab)) < 0.7)
    draft = rng.dirichlet(np.ones(vocab), size=states) * (rng.random((states, vocab)) < 0.6)
    target[:, 0] = draft[:, 0] = 0.0
    target[:, 1] += 0.1  # no row is all zero
    draft[:, 2] += 0.1
    target /= target.sum(-1, keepdims=True)
    draft /= draft.sum(-1, keepdims=True)
    draft[-1] = target[-1]
    return target, draft


@pytest.mark.parametrize("seed", range(5))
def test_rule_helpers_are_the_engine_rule_on_float64(seed):
    target, draft = rows_with_zeros(seed)
    assert np.any(draft == 0) and np.any((draft == 0) & (target > 0))
    target_t, draft_t = torch.from_numpy(target), torch.from_numpy(draft)
    for eps in (0.0, 0.1):
        keep = exact.keep_probability(target, draft, eps)
        assert keep.dtype == np.float64
        np.testing.assert_array_equal(keep, acceptance_probability(target_t, draft_t, eps).numpy())
    for residual in genspec.acceptance.RESIDUALS:
        np.testing.assert_array_equal(exact.residual_law(target, draft, residual),
                                      residual_distribution(target_t, draft_t, residual).numpy())
    # the standard rule's accepted mass p b is min{p, q} (to rounding: p * (q / p))
    accepted = exact.accepted_mass(target, draft)
    np.testing.assert_array_equal(accepted, draft * acceptance_probability(target_t, draft_t).numpy())
    np.testing.assert_allclose(accepted, np.minimum(draft, target), rtol=1e-15, atol=0)


def test_a_token_neither_law_can_produce_gets_the_shared_rules_answer():
    """p(y) = q(y) = 0: the shared rule says b = 0 (q + eps > 0 is false) at eps = 0 and 1 at eps > 0;
    y gets no accepted mass and no residual mass, at every stage of the verifier."""
    target, draft = np.array([0.0, 0.5, 0.5]), np.array([0.0, 0.8, 0.2])
    assert exact.keep_probability(target, draft)[0] == 0.0
    assert exact.keep_probability(target, draft, 0.1)[0] == 1.0
    stages = exact.verifier_stages(target, draft, 3)
    assert np.all(stages.accepted[:, 0, 0] == 0) and np.all(stages.residual[:, 0, 0] == 0)
    np.testing.assert_allclose(stages.output_law()[0], target, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_verifier_stages_apply_the_shared_rule_stage_by_stage(seed):
    target, draft = rows_with_zeros(seed)
    stages = exact.verifier_stages(target, draft, 4)
    law, reach = torch.from_numpy(target), np.ones(target.shape[0])
    draft_t = torch.from_numpy(draft)
    for j in range(4):
        keep = acceptance_probability(law, draft_t).numpy()
        np.testing.assert_array_equal(stages.residual[j], law.numpy())
        np.testing.assert_array_equal(stages.accepted[j], reach[:, None] * (draft * keep))
        np.testing.assert_allclose(stages.stage_rejection[j], (draft * (1 - keep)).sum(-1), rtol=1e-15,
                                   atol=1e-17)
        reach = reach * stages.stage_rejection[j]
        law = residual_distribution(law, draft_t)


def test_rejection_is_the_rules_even_when_the_residual_falls_back_to_q():
    """q = p up to one ulp with q <= p everywhere: [q - p]_+ is all zero, so the shared residual is q,
    while the rule still rejects with probability sum p (1 - q/p), a few ulps (the engine would too)."""
    target, draft = np.full(3, 0.1), np.full(3, 0.3)
    target, draft = target / target.sum(), draft / draft.sum()  # 1/3 rounded two ways
    assert np.all(target <= draft) and np.any(target < draft)
    rejection = exact.verifier_stages(target, draft, 1).stage_rejection[0, 0]
    assert 0 < rejection <= 1e-15
    np.testing.assert_array_equal(exact.verifier_stages(target, draft, 1).residual[1, 0], target)


def test_the_exact_dps_follow_whatever_rule_genspec_acceptance_defines(monkeypatch):
    """Swap the rule the exact module calls for the relaxed one (eps = 0.2, OPT residual): both DPs at
    M = 1 become the relaxed rule's exact E[N_rej], computed here from Theorem 4's output law b p + R P.
    A DP that re-implemented min{p, q} or [q - p]_+ anywhere would not follow the swap."""
    chain, eps = random_chain(4, 6, 9), 0.2
    relaxed, marginal = 0.0, chain.initial
    for n in range(chain.horizon):
        rows = [pareto.over_acceptance_point(d, t, eps).rejection for d, t in zip(chain.draft[n], chain.target[n])]
        out = [pareto.output_law(d, pareto.over_acceptance_keep(d, t, eps), pareto.opt_resampling(d, t))
               for d, t in zip(chain.draft[n], chain.target[n])]
        relaxed += float(marginal @ np.array(rows))
        marginal = marginal @ np.array(out)
    lossless = exact.expected_rejections_sd(chain)
    assert relaxed < lossless - 0.5

    def relaxed_rule(target_prob_of_draft, draft_prob_of_draft, epsilon=0.0):
        return acceptance_probability(target_prob_of_draft, draft_prob_of_draft, epsilon + eps)

    monkeypatch.setattr(exact, "acceptance_probability", relaxed_rule)
    for variant in exact.VARIANTS:
        assert exact.expected_rejections(chain, 1, variant) == pytest.approx(relaxed, rel=1e-12)


def test_round_start_accepted_mass_is_q_minus_rejected_residual():
    """DP check of docs/theory.md: the accepted mass from fresh(x) totals q - prod r_j q^{M+1}."""
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
    """docs/theory.md: flat-Dirichlet pairs give about 23 rejections at V = 7, T = 50."""
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
