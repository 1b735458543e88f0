"""The acceptance rules (genspec.acceptance) on random tensors, without any model.

Reference implementations written as plain loops, exact output laws checked with chi-square
(N = 20,000 draws, cells with expected count < 5 pooled, fail if p < 1e-3), and the structural
properties the engine relies on: a row's verdict depends only on its own tensors and uniforms; the
point-mass coupling reproduces plain sampling; a one-chain tree is a chain.
"""
from __future__ import annotations

import pytest
import torch
from stats_helpers import chi_square_pvalue

from genspec.acceptance import (
    Candidates,
    sample_with_uniforms,
    verify,
    verify_chain,
    verify_greedy,
    verify_multidraft,
    verify_tree,
)
from genspec.randomness import Noise
from genspec.sampling import SamplingConfig, target_law

N = 20_000


def _laws(*shape, seed=0, sharp=3.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * sharp).softmax(-1)


# ------------------------------------------------------------------------------ greedy
def test_verify_greedy_equals_a_loop_on_random_tensors():
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        batch, k = 7, int(torch.randint(0, 6, (1,), generator=generator))
        argmax = torch.randint(0, 4, (batch, k + 1), generator=generator)
        drafts = torch.where(torch.rand(batch, k, generator=generator) < 0.7, argmax[:, :k],
                             torch.randint(0, 4, (batch, k), generator=generator))
        lengths = torch.randint(0, k + 1, (batch,), generator=generator)
        verdict = verify_greedy(drafts, argmax, lengths)
        for b in range(batch):
            accepted = 0
            while accepted < int(lengths[b]) and int(drafts[b, accepted]) == int(argmax[b, accepted]):
                accepted += 1
            assert int(verdict.accepted_length[b]) == accepted
            assert int(verdict.next_token[b]) == int(argmax[b, accepted])


# ------------------------------------------------------------------------------ sampling with uniforms
def test_sample_with_uniforms_follows_the_law_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0], dtype=torch.float64)
    uniforms = torch.rand(N, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tokens = sample_with_uniforms(probs.expand(N, -1), uniforms)
    counts = torch.bincount(tokens, minlength=6)
    assert counts[probs == 0].sum() == 0
    assert chi_square_pvalue(counts.numpy(), probs.numpy()) > 1e-3
    # monotone in the uniform, and the extreme uniforms land on the first / last token with mass
    ordered = sample_with_uniforms(probs.expand(5, -1), torch.tensor([0.0, 0.19, 0.21, 0.69, 1 - 2 ** -53]))
    assert ordered.tolist() == [1, 1, 3, 3, 4]
    # float32 rows that do not sum to 1 exactly: the top uniform still picks the last token with mass
    rough = torch.tensor([[0.3, 0.3, 0.4000001, 0.0]], dtype=torch.float32)
    assert sample_with_uniforms(rough, torch.tensor([1 - 2 ** -24])).item() == 2


# ------------------------------------------------------------------------------ one chain
def _emitted(verdict, drafts, position: int) -> torch.Tensor:
    """The token each row emitted at ``position`` (a kept draft, or the token after the kept ones)."""
    kept = verdict.accepted_length > position
    after = verdict.accepted_length == position
    token = torch.where(kept, drafts[:, min(position, drafts.shape[1] - 1)], verdict.next_token)
    return torch.where(kept | after, token, torch.full_like(token, -1))


@pytest.mark.parametrize("deterministic", [False, True])
def test_verify_chain_emits_the_target_law(deterministic):
    """Context-free laws per position (the target's law at position i does not depend on the kept
    prefix): the first emitted token follows q_0, and the second, among rows that reached it, q_1."""
    vocab, k = 6, 2
    target = _laws(k + 1, vocab, seed=3)
    draft = _laws(k, vocab, seed=4)
    generator = torch.Generator().manual_seed(6)
    drafts = torch.stack([torch.multinomial(draft[i], N, replacement=True, generator=generator) for i in range(k)], 1)
    if deterministic:  # the same fixed draft in every row (its law is a point mass), often right at first
        drafts = torch.tensor([int(target[0].argmax()), 2]).expand(N, k)
    verdict = verify_chain(drafts, target.expand(N, -1, -1), None if deterministic else draft.expand(N, -1, -1),
                           noise=Noise(generator=generator))
    first = _emitted(verdict, drafts, 0)
    assert chi_square_pvalue(torch.bincount(first, minlength=vocab).numpy(), target[0].numpy()) > 1e-3
    second = _emitted(verdict, drafts, 1)
    second = second[verdict.accepted_length >= 1]
    assert chi_square_pvalue(torch.bincount(second, minlength=vocab).numpy(), target[1].numpy()) > 1e-3
    rate = (verdict.accepted_length >= 1).double().mean().item()
    expected = float(target[0].max()) if deterministic else float(torch.minimum(draft[0], target[0]).sum())
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / N) ** 0.5  # P(keep) = sum min(p, q)


def test_point_mass_coupling_reproduces_plain_sampling():
    """With deterministic drafts the emitted tokens are exactly what sampling each position's law with
    that position's uniform gives, whatever was drafted (and drafts equal to those draws are kept)."""
    batch, k, vocab = 64, 4, 9
    target = _laws(batch, k + 1, vocab, seed=6)
    uniforms = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    plain = sample_with_uniforms(target, uniforms)  # [B, k + 1]
    generator = torch.Generator().manual_seed(8)
    right = torch.rand(batch, k, generator=generator) < 0.6
    drafts = torch.where(right, plain[:, :k], torch.randint(0, vocab, (batch, k), generator=generator))
    verdict = verify_chain(drafts, target, None, noise=Noise(sample=uniforms))
    for b in range(batch):
        a = int(verdict.accepted_length[b])
        assert drafts[b, :a].tolist() == plain[b, :a].tolist()
        assert a == k or int(drafts[b, a]) != int(plain[b, a])
        assert int(verdict.next_token[b]) == int(plain[b, a])


def test_a_rows_verdict_depends_only_on_its_own_tensors():
    """Rows verified together or one at a time, with the same uniforms: the same verdicts."""
    batch, k, vocab = 12, 3, 7
    target, draft = _laws(batch, k + 1, vocab, seed=9), _laws(batch, k, vocab, seed=10)
    drafts = sample_with_uniforms(draft, torch.rand(batch, k, dtype=torch.float64))
    accept = torch.rand(batch, k, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    sample = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    lengths = torch.randint(0, k + 1, (batch,))
    together = verify_chain(drafts, target, draft, lengths, noise=Noise(sample, accept.unsqueeze(-1)))
    for b in range(batch):
        alone = verify_chain(drafts[b:b + 1], target[b:b + 1], draft[b:b + 1], lengths[b:b + 1],
                             noise=Noise(sample[b:b + 1], accept[b:b + 1].unsqueeze(-1)))
        assert int(alone.accepted_length) == int(together.accepted_length[b])
        assert int(alone.next_token) == int(together.next_token[b])


# ------------------------------------------------------------------------------ several candidates
def test_verify_multidraft_with_a_candidate_mask_emits_the_target_law():
    """Three i.i.d. candidates per row of which a random subset (not a prefix) is live."""
    vocab = 6
    target, draft = _laws(vocab, seed=13), _laws(vocab, seed=14)
    generator = torch.Generator().manual_seed(15)
    candidates = torch.multinomial(draft, N * 3, replacement=True, generator=generator).reshape(N, 3)
    mask = torch.rand(N, 3, generator=generator) < 0.6
    verdict = verify_multidraft(candidates, target.expand(N, -1), draft.expand(N, -1), candidate_mask=mask,
                                noise=Noise(generator=generator))
    assert (verdict.accepted_index[~mask.any(1)] == -1).all()
    chosen = verdict.accepted_index >= 0
    assert mask[chosen, verdict.accepted_index[chosen]].all()  # only live candidates are kept
    assert chi_square_pvalue(torch.bincount(verdict.token, minlength=vocab).numpy(), target.numpy()) > 1e-3


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_one_chain_tree_is_a_chain(deterministic):
    """The tree walk on M = 1 gives the chain rule's verdicts with the same uniforms."""
    batch, k, vocab = 40, 3, 8
    target, draft = _laws(batch, k + 1, vocab, seed=16), _laws(batch, k, vocab, seed=17)
    drafts = sample_with_uniforms(draft, torch.rand(batch, k, dtype=torch.float64))
    lengths = torch.randint(0, k + 1, (batch,))
    accept = torch.rand(batch, k, dtype=torch.float64)
    sample = torch.rand(batch, k + 1, dtype=torch.float64)
    probs = None if deterministic else draft
    chain = verify_chain(drafts, target, probs, lengths, noise=Noise(sample, accept.unsqueeze(-1)))
    node_of = (torch.arange(k) + 1).expand(batch, 1, k)
    draft = Candidates(drafts.unsqueeze(1), lengths.unsqueeze(1), node_of, None if probs is None else probs.unsqueeze(1))
    tree = verify_tree(draft, target_probs=target, noise=Noise(sample, accept.unsqueeze(-1)))
    assert torch.equal(tree.accepted_length, chain.accepted_length)
    assert torch.equal(tree.next_token, chain.next_token)
    greedy = verify_greedy(drafts, target.argmax(-1), lengths)
    greedy_tree = verify_tree(draft, target_argmax=target.argmax(-1))
    assert torch.equal(greedy_tree.accepted_length, greedy.accepted_length)
    assert torch.equal(greedy_tree.next_token, greedy.next_token)


def test_tree_walk_follows_the_matching_branch():
    """Deterministic candidates [a b], [a c], [d e] merged as nodes a(1) b(2) c(3) d(4) e(5): the walk
    keeps the branch equal to each depth's draw from the target at the current node."""
    chains = torch.tensor([[[1, 2], [1, 3], [4, 5]]])
    lengths = torch.tensor([[2, 2, 2]])
    node_of = torch.tensor([[[1, 2], [1, 3], [4, 5]]])
    target = torch.zeros(1, 6, 6, dtype=torch.float64)
    target[0, 0, 1] = 1.0  # at the root the target says 1 (node 1) ...
    target[0, 1, 3] = 1.0  # ... then 3 (the second chain's node 3) ...
    target[0, 3, 0] = 1.0  # ... then the bonus 0
    verdict = verify_tree(Candidates(chains, lengths, node_of), target_probs=target,
                          noise=Noise(sample=torch.full((1, 3), 0.5, dtype=torch.float64)))
    assert verdict.path.tolist() == [[0, 1, 3]]
    assert verdict.accepted_length.tolist() == [2] and verdict.next_token.tolist() == [0]
    greedy = verify_tree(Candidates(chains, lengths, node_of), target_argmax=target.argmax(-1))
    assert greedy.path.tolist() == [[0, 1, 3]] and greedy.next_token.tolist() == [0]


def test_tree_of_independent_draft_chains_emits_the_target_law():
    """M = 3 i.i.d. chains of 2 tokens from context-free draft laws, verified as a tree by the recursive
    residual verifier: the first emitted token follows q (chi-square, N = 20,000)."""
    vocab, k, m = 5, 2, 3
    target, draft = _laws(k + 1, vocab, seed=18), _laws(k, vocab, seed=19)
    generator = torch.Generator().manual_seed(20)
    chains = torch.stack([torch.multinomial(draft[d], N * m, replacement=True, generator=generator).reshape(N, m)
                          for d in range(k)], -1)  # [N, M, k]
    # every chain its own nodes (node 1 + chain * k + depth; the verifier treats chains as candidates
    # either way); the target's law at a node is the context-free law of the next depth
    node_of = (torch.arange(m * k).reshape(m, k) + 1).expand(N, m, k)
    laws = torch.cat([target[:1], target[1:].repeat(m, 1)])  # node 0, then per chain depths 1..k
    verdict = verify_tree(Candidates(chains, torch.full((N, m), k), node_of, draft.expand(N, m, -1, -1)),
                          target_probs=laws.expand(N, -1, -1), noise=Noise(generator=generator))
    kept = verdict.path[:, 1]
    first = torch.where(kept >= 0, chains[torch.arange(N), (kept.clamp(min=1) - 1) // k, 0], verdict.next_token)
    assert chi_square_pvalue(torch.bincount(first, minlength=vocab).numpy(), target[0].numpy()) > 1e-3


# ------------------------------------------------------------------------------ the entry
def test_verify_dispatches_per_row_in_a_mixed_batch():
    """Greedy and sampled rows in one call: each row's verdict equals verifying it alone with its own
    settings (greedy: token match on the argmax; sampled: the standard rule on its processed law)."""
    batch, k, vocab = 6, 3, 11
    logits = torch.randn(batch, k + 1, vocab, generator=torch.Generator().manual_seed(21), dtype=torch.float64) * 3
    drafts = logits[:, :k].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % vocab
    lengths = torch.full((batch, 1), k)
    sampling = [SamplingConfig(), SamplingConfig(), SamplingConfig(0.7, top_k=4), SamplingConfig(1.0, top_p=0.8),
                SamplingConfig(0.0, repetition_penalty=1.0), SamplingConfig(1.3)]
    sample = torch.rand(batch, k + 1, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    accept = torch.rand(batch, k, 1, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
    together = verify(Candidates(drafts.unsqueeze(1), lengths), target_law(logits, sampling), noise=Noise(sample, accept))
    for b in range(batch):
        alone = verify(Candidates(drafts[b:b + 1].unsqueeze(1), lengths[b:b + 1]),
                       target_law(logits[b:b + 1], [sampling[b]]), noise=Noise(sample[b:b + 1], accept[b:b + 1]))
        assert torch.equal(alone.path, together.path[b:b + 1]), b
        assert int(alone.next_token) == int(together.next_token[b]), b
    greedy = verify_greedy(drafts[:2], logits[:2].argmax(-1))
    assert together.accepted_length[:2].tolist() == greedy.accepted_length.tolist() == [k, 1]
    assert together.next_token[:2].tolist() == greedy.next_token.tolist()
