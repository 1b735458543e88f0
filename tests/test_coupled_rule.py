"""The coupled acceptance rule (issue 18, item 2): draft and target draw each position with the same
noise, the token emitted is the target's coupled draw whatever was drafted. So it is lossless, and a
seeded request's tokens do not depend on its draft lengths (tests/test_reliability.py checks that part
on every sampling drafter and policy)."""
from __future__ import annotations

import pytest
import torch
from scipy import stats
from stats_helpers import lossless_pvalue
from tiny_models import peaked, tiny_llama

from genspec.acceptance import Candidates, coupled_tokens, verify
from genspec.acceptance.rules import node_depths
from genspec.drafters import DraftModelDrafter
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.randomness import Noise, RequestRandomness
from genspec.sampling import SamplingConfig, target_law


def _random_law(vocab: int, generator: torch.Generator, zeros: int = 0) -> torch.Tensor:
    law = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 3
    law[:zeros] = 0.0
    return law / law.sum()


def test_a_coupled_draw_has_exactly_its_law():
    """coupled_tokens with i.i.d. exponentials is an exact draw: chi-square of N = 100,000 draws from a
    law over 8 tokens (two of probability 0, never drawn), fail if p < 1e-3."""
    generator = torch.Generator().manual_seed(1)
    law = _random_law(8, generator, zeros=2)
    race = torch.empty(100_000, 8, dtype=torch.float64).exponential_(generator=generator)
    draws = coupled_tokens(law.expand(100_000, -1), race)
    counts = torch.bincount(draws, minlength=8).double()
    assert counts[:2].sum() == 0
    assert stats.chisquare(counts[2:].numpy(), (law[2:] * 100_000).numpy()).pvalue > 1e-3


def test_coupled_draws_agree_at_least_as_the_bound_says_and_never_more_than_one_minus_tv():
    """Two laws drawn with the same noise agree with probability in [(1 - TV)/(1 + TV), 1 - TV] (the lower
    bound of Gumbel-max coupling, the upper one of any coupling): 20 random pairs over 10 tokens,
    N = 40,000 shared draws each, checked within 5 standard errors."""
    generator = torch.Generator().manual_seed(2)
    for _ in range(20):
        draft_probs, target_probs = _random_law(10, generator), _random_law(10, generator)
        tv = 0.5 * float((draft_probs - target_probs).abs().sum())
        race = torch.empty(40_000, 10, dtype=torch.float64).exponential_(generator=generator)
        agree = (coupled_tokens(draft_probs.expand(40_000, -1), race)
                 == coupled_tokens(target_probs.expand(40_000, -1), race)).double().mean().item()
        slack = 5 * (0.25 / 40_000) ** 0.5
        assert (1 - tv) / (1 + tv) - slack <= agree <= 1 - tv + slack, (tv, agree)


def test_node_depths_of_a_chain_and_a_tree():
    chain = node_depths(None, torch.tensor([[3]]), 4)
    assert chain.tolist() == [[0, 1, 2, 3]]
    # tree: chains [a, b] and [a, c, d] share node 1 (a); b is node 2, c node 3, d node 4; a third chain
    # of length 0 points at padding
    node_of = torch.tensor([[[1, 2, 0], [1, 3, 4], [0, 0, 0]]])
    lengths = torch.tensor([[2, 3, 0]])
    assert node_depths(node_of, lengths, 6).tolist() == [[0, 1, 2, 2, 3, 0]]


def test_verify_applies_the_coupled_rule_to_its_rows_and_the_standard_rule_to_the_others():
    """One verify call, 2 rows, same draft, logits and uniforms: the coupled row emits the target's coupled
    draws (token match against them); the other row's verdict is the one verify gives without coupling."""
    generator = torch.Generator().manual_seed(3)
    vocab, k = 6, 3
    logits = torch.randn(2, k + 1, vocab, generator=generator, dtype=torch.float64)
    target_probs = torch.softmax(logits, -1)
    race = torch.empty(2, k + 1, vocab, dtype=torch.float64).exponential_(generator=generator)
    wanted = coupled_tokens(target_probs, race)  # the target's coupled token at each depth
    chains = torch.stack([wanted[0, :k].clone(), wanted[1, :k].clone()]).unsqueeze(1)
    chains[0, 0, 2] = (wanted[0, 2] + 1) % vocab  # row 0: the third draft token differs
    lengths = torch.tensor([[k], [k]])
    sampling = SamplingConfig(temperature=1.0)
    uniforms = dict(accept=torch.rand(2, k, 1, generator=generator, dtype=torch.float64),
                    sample=torch.rand(2, k + 1, generator=generator, dtype=torch.float64))
    draft = Candidates(chains, lengths)
    mixed = verify(draft, target_law(logits, sampling), noise=Noise(coupled=torch.tensor([True, False]), race=race, **uniforms))
    standard = verify(draft, target_law(logits, sampling), noise=Noise(**uniforms))
    assert mixed.accepted_length[0] == 2 and mixed.next_token[0] == wanted[0, 2]
    assert mixed.path[0].tolist() == [0, 1, 2, -1]
    assert mixed.accepted_length[1] == standard.accepted_length[1]
    assert mixed.next_token[1] == standard.next_token[1] and mixed.path[1].tolist() == standard.path[1].tolist()
    everything = verify(draft, target_law(logits, sampling), noise=Noise(coupled=torch.tensor([True, True]), race=race, **uniforms))
    assert everything.accepted_length.tolist() == [2, 3] and everything.next_token[1] == wanted[1, 3]


@pytest.mark.parametrize("seed", [0, None])
def test_the_coupled_rule_is_lossless_with_a_sampling_draft_model(seed):
    """Chi-square of the joint law of the first 3 tokens against the exact target law, draft model = a
    blunter copy of the target (so drafts are rejected), temperature 0.8, top-k 6 on both; N = 20,000,
    cells with expected count < 5 pooled, fail if p < 1e-3. Seeded (each row its own stream) and not."""
    pvalue, acceptance = lossless_pvalue(
        lambda target: DraftModelDrafter(HFCausalLM(peaked(tiny_llama(0, vocab=12, layers=2, dtype=torch.float64), 4.0))),
        SamplingConfig(temperature=0.8, top_k=6), seed=seed, layers=2, rule="coupled")
    assert 0.05 < acceptance < 0.95
    assert pvalue > 1e-3


def test_the_coupled_rule_on_a_tree_gives_plain_coupled_sampling():
    """A tree drafter (point masses, several candidates per depth) under the coupled rule: a seeded
    request's tokens equal plain coupled sampling's (the tree's nodes are matched by depth)."""
    from genspec.drafters import PromptLookupDrafter

    target = HFCausalLM(peaked(tiny_llama(0), 16.0))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 5, 6, 9]
    config = GenerationConfig(max_new_tokens=40, temperature=0.7, seed=5, rule="coupled", eos_token_ids=(),
                              num_draft_tokens=4, draft_length="fixed")
    plain = SpeculativeEngine(target).generate_ids([prompt], config)[0].token_ids
    tree = SpeculativeEngine(target, PromptLookupDrafter(num_candidates=3)).generate_ids([prompt], config)[0]
    assert tree.token_ids == plain
    assert tree.stats.drafted_tokens > 0


def test_auto_picks_the_coupled_rule_only_for_seeded_sampled_lossless_requests_of_sampling_drafters():
    assert GenerationConfig().rule == "auto"
    seeded = GenerationConfig(temperature=0.7, seed=1)
    assert seeded.resolved(True).rule == "coupled"
    assert seeded.resolved(False).rule == "overaccept"  # point-mass drafts are coupled already
    assert GenerationConfig(temperature=0.7).resolved(True).rule == "overaccept"  # no seed: 1 - TV
    assert GenerationConfig(seed=1).resolved(True).rule == "overaccept"  # greedy
    assert GenerationConfig(temperature=0.7, seed=1, rule="overaccept").resolved(True).rule == "overaccept"
    assert GenerationConfig(temperature=0.7, seed=1, epsilon=0.1).resolved(True).rule == "overaccept"  # lossy
    assert GenerationConfig(temperature=0.7, seed=1, measure_bias=True).resolved(True).rule == "overaccept"
    assert GenerationConfig(temperature=0.7, rule="coupled").lossless


@pytest.mark.parametrize("options, fragment", [
    (dict(rule="coupled", epsilon=0.1), "takes no epsilon"),
    (dict(rule="coupled", measure_bias=True), "bias measurement"),
    (dict(rule="best"), "unknown acceptance rule"),
])
def test_bad_coupled_settings_are_refused(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        GenerationConfig(temperature=0.7, **options)


def test_a_positions_noise_depends_on_seed_sample_and_position_only():
    first, again, other_sample = RequestRandomness(4), RequestRandomness(4), RequestRandomness(4, sample_index=1)
    again.uniforms(0, 10)  # drawing other streams first changes nothing
    assert torch.equal(first.race(7, 50), again.race(7, 50))
    assert torch.equal(first.race(7, 50), again.race(7, 200)[:50])  # a longer vocabulary extends it
    assert not torch.equal(first.race(7, 50), other_sample.race(7, 50))
    assert not torch.equal(first.race(7, 50), first.race(8, 50))
    first.advance(8)
    with pytest.raises(ValueError, match="released"):
        first.race(7, 50)
