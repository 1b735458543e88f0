"""Monte-Carlo simulators (genspec.theory.simulate) against the exact formulas, and unbiasedness.

The simulators draw drafts and verify them with genspec.acceptance.verify_multidraft, the engine's
acceptance code, so these tests also check that code against the theory. p = draft, q = target.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_helpers import chi_square_pvalue

from genspec.acceptance import Rule, acceptance_probability, residual_distribution, verify_multidraft
from genspec.errors import ConfigError
from genspec.randomness import Noise
from genspec.theory import exact
from genspec.theory.chains import ChainPair, random_chain
from genspec.theory.simulate import sample_rejection_rule, simulate

P_THRESHOLD = 1e-3  # docs/theory.md: fail if the chi-square p-value is below 10^-3
N_CHI_SQUARE = 100_000  # docs/theory.md: N = 10^5 samples per chi-square test


# ------------------------------------------------------------------------- exact vs simulation


@pytest.mark.parametrize("seed,vocab,horizon,batch,variant", [
    (1, 3, 50, 1, "batch"),
    (2, 3, 50, 3, "batch"),
    (2, 3, 50, 3, "multidraft"),
    (3, 7, 50, 4, "batch"),
    (3, 7, 50, 4, "multidraft"),
    (4, 20, 30, 1, "batch"),
    (5, 20, 30, 5, "batch"),
    (5, 20, 30, 5, "multidraft"),
])
def test_simulated_mean_within_4_standard_errors_of_exact(seed, vocab, horizon, batch, variant):
    """Mean N_rej of 20,000 simulated runs is within 4 standard errors (std / sqrt(N)) of the exact DP."""
    chain = random_chain(vocab, horizon, seed)
    sim = simulate(chain, 20_000, batch, variant, seed=seed + 100)
    value = exact.expected_rejections(chain, batch, variant)
    assert abs(sim.mean - value) < 4 * sim.stderr, (sim.mean, sim.stderr, value)
    assert sim.sequences.shape == (20_000, horizon + 1)
    assert sim.rejections.min() >= 0 and sim.rejections.max() <= horizon


def test_simulation_is_reproducible_and_seed_dependent():
    chain = random_chain(5, 8, 0)
    a, b = simulate(chain, 500, 3, "multidraft", seed=7), simulate(chain, 500, 3, "multidraft", seed=7)
    np.testing.assert_array_equal(a.sequences, b.sequences)
    np.testing.assert_array_equal(a.rejections, b.rejections)
    c = simulate(chain, 500, 3, "multidraft", seed=8)
    assert not np.array_equal(a.sequences, c.sequences)


def test_chunks_give_the_same_statistics():
    chain = random_chain(4, 10, 1)
    sim = simulate(chain, 3_001, 2, "batch", seed=3, chunk_size=1_000)
    assert sim.num_runs == 3_001 and sim.sequences.shape == (3_001, 11)


def test_identical_pair_never_rejects_in_simulation():
    base = random_chain(5, 20, 2)
    chain = ChainPair.from_arrays(base.initial, base.target, base.target)
    for variant in ("batch", "multidraft"):
        assert simulate(chain, 2_000, 4, variant, seed=1).rejections.max() == 0


def test_disjoint_supports_reject_every_position_in_simulation():
    vocab, horizon = 4, 6
    draft = np.zeros((horizon, vocab, vocab))
    target = np.zeros((horizon, vocab, vocab))
    draft[..., :2] = 0.5
    target[..., 2:] = 0.5
    chain = ChainPair.from_arrays(np.full(vocab, 0.25), draft, target)
    sim = simulate(chain, 1_000, 1, seed=0)
    assert np.all(sim.rejections == horizon)
    assert np.all(sim.sequences[:, 1:] >= 2)  # every token comes from the target's support


def test_bad_arguments_are_config_errors():
    chain = random_chain(3, 2, 0)
    with pytest.raises(ConfigError):
        simulate(chain, 0)
    with pytest.raises(ConfigError):
        simulate(chain, 10, batch=0)
    with pytest.raises(ConfigError):
        simulate(chain, 10, variant="tree")


# ------------------------------------------------------------------------------- unbiasedness


def joint_x1_x2_counts(sequences: np.ndarray, vocab: int) -> np.ndarray:
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (sequences[:, 1], sequences[:, 2]), 1)
    return counts


@pytest.mark.parametrize("batch,variant", [(1, "batch"), (3, "batch"), (3, "multidraft")])
def test_outputs_follow_the_target_chain(batch, variant):
    """Chi-square (cells with expected count < 5 pooled) of N = 10^5 simulated outputs against the
    target chain's exact law: the joint of (x_1, x_2) on a V = 5, T = 2 pair, and the marginal of x_T
    on a V = 7, T = 8 pair. Fails if p-value < 10^-3. SD (M = 1), batch and multidraft."""
    chain = random_chain(5, 2, 21)
    sim = simulate(chain, N_CHI_SQUARE, batch, variant, seed=31)
    assert chi_square_pvalue(joint_x1_x2_counts(sim.sequences, 5), chain.target_joint_first_two()) > P_THRESHOLD

    chain = random_chain(7, 8, 22)
    sim = simulate(chain, N_CHI_SQUARE, batch, variant, seed=32)
    counts = np.bincount(sim.sequences[:, -1], minlength=7)
    assert chi_square_pvalue(counts, chain.target_marginals()[-1]) > P_THRESHOLD


def test_theorem2_over_acceptance_on_one_token_is_biased_on_a_chain():
    """Theorem 2: with V = 2 exactly one token per state has q < p; over-acceptance (eps = 0.1) raises
    b above min{1, q/p} on that token only, with the standard residual. The chi-square test above
    (N = 10^5, threshold 10^-3, joint of (x_1, x_2)) must now fail."""
    chain = random_chain(2, 2, 4)
    lossless = simulate(chain, N_CHI_SQUARE, 1, seed=5)
    assert chi_square_pvalue(joint_x1_x2_counts(lossless.sequences, 2), chain.target_joint_first_two()) > P_THRESHOLD
    biased = simulate(chain, N_CHI_SQUARE, 1, seed=5, rule=Rule(epsilon=0.1, residual="opt"))
    assert chi_square_pvalue(joint_x1_x2_counts(biased.sequences, 2), chain.target_joint_first_two()) < P_THRESHOLD
    assert biased.mean < lossless.mean  # fewer rejections: that is what the bias buys


def test_theorem2_raising_b_on_one_token_is_measurably_biased():
    """Theorem 2 on one step, V = 6: keep y with b(y) = min{1, q/p} except on the token with the largest
    p - q, where b is raised halfway to 1; resample from the standard residual norm([q - p]_+).
    N = 10^5 outputs fail the chi-square test against q (p-value < 10^-3); the lossless rule passes."""
    rng = np.random.default_rng(8)
    draft, target = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    draft_t, target_t = torch.from_numpy(draft), torch.from_numpy(target)
    keep = acceptance_probability(target_t, draft_t).numpy()
    residual = residual_distribution(target_t, draft_t).numpy()
    tokens, _ = sample_rejection_rule(draft, keep, residual, N_CHI_SQUARE, seed=1)
    assert chi_square_pvalue(np.bincount(tokens, minlength=6), target) > P_THRESHOLD

    raised = keep.copy()
    worst = int(np.argmax(draft - target))
    raised[worst] = (1 + keep[worst]) / 2
    tokens, _ = sample_rejection_rule(draft, raised, residual, N_CHI_SQUARE, seed=1)
    assert chi_square_pvalue(np.bincount(tokens, minlength=6), target) < P_THRESHOLD


def test_shared_verifier_matches_the_exact_stage_law():
    """verify_multidraft (the engine's code) on K = 4 i.i.d. candidates: the joint law of (accepting
    stage or 'all rejected', emitted token) matches exact.verifier_stages. N = 10^5, threshold 10^-3."""
    rng = np.random.default_rng(3)
    vocab, stages_count = 5, 4
    draft = 0.7 * rng.dirichlet(np.ones(vocab)) + 0.3 / vocab
    target = rng.dirichlet(np.ones(vocab) * 0.5)
    generator = torch.Generator().manual_seed(0)
    draft_rows = torch.from_numpy(draft).expand(N_CHI_SQUARE, -1)
    candidates = torch.multinomial(draft_rows, stages_count, replacement=True, generator=generator)
    verdict = verify_multidraft(candidates, torch.from_numpy(target).expand(N_CHI_SQUARE, -1), draft_rows,
                                noise=Noise(generator=generator))
    stage = np.where(verdict.accepted_index.numpy() < 0, stages_count, verdict.accepted_index.numpy())
    counts = np.zeros((stages_count + 1, vocab))
    np.add.at(counts, (stage, verdict.token.numpy()), 1)
    law = exact.verifier_stages(target, draft, stages_count)
    expected = np.vstack([law.accepted[:, 0], law.all_rejected[-1, 0] * law.residual[-1, 0][None]])
    assert chi_square_pvalue(counts, expected) > P_THRESHOLD
