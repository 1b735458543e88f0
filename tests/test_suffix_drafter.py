"""The suffix drafter (SuffixDecoding): its cache against a brute-force search, FIFO eviction under the
cap, frequency scoring and tree pruning, greedy equality with plain decoding (chains and trees, batch 1
and 4, continuous batching), chi-square losslessness at temperature > 0, and learning across requests."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from stats_helpers import lossless_pvalue
from test_drafters_model_free import run_requests

import genspec
from genspec.drafters.base import DraftRequest, RequestContext
from genspec.drafters.suffix import MATCH_LEVELS, SuffixCache, SuffixDrafter, clear_suffix_caches, frequency_tree, match_level
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.sampling import SamplingConfig

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20]]
NEW_TOKENS = 24


@pytest.fixture(autouse=True)
def empty_process_cache():
    clear_suffix_caches()
    yield
    clear_suffix_caches()


def _live(cache: SuffixCache) -> list[int]:
    return [int(t) for t in cache.tokens[np.arange(cache.start, cache.end) % cache.capacity]]


def _brute_force(live: list[int], context: list[int], max_match: int) -> tuple[int, list[int]]:
    """Longest suffix of ``context`` found before some position of ``live``, and those positions."""
    best, where = 0, []
    for j in range(1, len(live)):
        if live[j] < 0:
            continue
        length = 0
        while length < min(max_match, len(context)) and j - 1 - length >= 0 and live[j - 1 - length] == context[-1 - length]:
            length += 1
        if length > best:
            best, where = length, [j]
        elif length == best and length > 0:
            where.append(j)
    return best, where


@pytest.mark.parametrize("cap", [None, 64, 300])
def test_cache_finds_the_longest_match_like_a_brute_force_search(cap):
    """Random documents over a 4-token alphabet (many repeats, hash collisions across anchors): the
    longest match and every position after it equal a brute-force scan of the live tokens."""
    rng = random.Random(cap or 0)
    for _ in range(150):
        cache = SuffixCache(cap)
        for _ in range(rng.randrange(1, 6)):
            cache.add_document([rng.randrange(4) for _ in range(rng.randrange(1, 90))])
            if rng.random() < 0.5:
                cache.extend([rng.randrange(4) for _ in range(rng.randrange(1, 9))])
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
        length, positions = cache.find(context, 16, max_scan=10 ** 9)
        best, where = _brute_force(_live(cache), context, 16)
        assert length == best
        assert sorted((positions - cache.start).tolist()) == (where if best else [])


def test_fifo_eviction_keeps_the_cap_and_forgets_the_oldest_documents():
    cache = SuffixCache(max_tokens=100)
    documents = [[1000 + 50 * d + i for i in range(30)] for d in range(10)]  # distinct tokens per document
    for number, document in enumerate(documents):
        cache.add_document(document)
        assert len(cache) <= 100 and cache.capacity <= 100
        live = _live(cache)
        assert live[-30:] == document  # the newest is whole
        kept = [d for d in range(number + 1) if set(documents[d]) <= set(live)]
        assert kept == list(range(number + 1 - len(kept), number + 1))  # a suffix of the history
        assert len(kept) == min(number + 1, 3)  # 3 x (30 + 1 boundary) <= 100 < 4 x 31
    assert cache.find(documents[0][:5], 32, 256)[0] == 0  # evicted: not found
    assert cache.find(documents[9][:5], 32, 256) == (5, np.array([cache.end - 25]))
    cache.add_document(list(range(500, 800)))  # longer than the cap: its last 99 tokens stay
    assert len(cache) <= 100 and [t for t in _live(cache) if t >= 0] == list(range(701, 800))


def test_frequency_scoring_picks_the_most_frequent_continuation():
    follow = np.array([[1, 2, 3], [4, 5, 6], [1, 2, 7], [4, 5, 6], [4, 5, 8], [9, -1, -1]])
    assert frequency_tree(follow, max_nodes=8, max_leaves=1, min_prob=0.0) == [[4, 5, 6]]
    # the process cache: the continuation seen 3 times wins over the one seen once, even if more recent
    drafter = SuffixDrafter(num_candidates=1, namespace="frequency-test")
    for tail in ([40, 41], [40, 41], [40, 41], [50, 51]):
        drafter.cache.add_document([30, 31, 32] + tail)
    chains, evidence = drafter.candidates(drafter.new_row(RequestContext(0, [1, 2])), [1, 30, 31, 32], 8)
    assert chains == [[40, 41]] and evidence == match_level(3) == 3


def test_tree_pruning_by_minimum_probability_and_node_budget():
    # 10 occurrences: 6 x [1, 2, 3], 3 x [4, 5], 1 x [7]
    follow = np.array([[1, 2, 3]] * 6 + [[4, 5, -1]] * 3 + [[7, -1, -1]])
    assert frequency_tree(follow, 16, 4, min_prob=0.0) == [[1, 2, 3], [4, 5], [7]]
    assert frequency_tree(follow, 16, 4, min_prob=0.2) == [[1, 2, 3], [4, 5]]  # [7] is 0.1 of the votes
    assert frequency_tree(follow, 16, 4, min_prob=0.5) == [[1, 2, 3]]
    assert frequency_tree(follow, 4, 4, min_prob=0.0) == [[1, 2, 3], [4]]  # the 4 most probable nodes
    assert frequency_tree(follow, 2, 4, min_prob=0.0) == [[1, 2]]
    assert frequency_tree(follow, 16, 2, min_prob=0.0) == [[1, 2, 3], [4, 5]]  # at most 2 leaves
    for budget in range(1, 8):  # never more nodes than the budget
        nodes = {tuple(chain[:d + 1]) for chain in frequency_tree(follow, budget, 4, 0.0) for d in range(len(chain))}
        assert len(nodes) == min(budget, 6)


def test_draft_length_follows_the_match_length():
    drafter = SuffixDrafter(num_candidates=1, factor=1.0, namespace="length-test")
    row = drafter.new_row(RequestContext(0, [1]))
    text = list(range(100, 120))
    chains, evidence = drafter.candidates(row, text + [7] + text[:3], 16)  # a 3-token match
    assert chains == [text[3:6]] and evidence == 3
    row = drafter.new_row(RequestContext(1, [1]))
    chains, evidence = drafter.candidates(row, text + [7] + text[:9], 16)  # 9 tokens
    assert chains == [text[9:18]] and evidence == 9
    assert SuffixDrafter(factor=0.5, namespace="length-test").candidates(
        row, text + [7] + text[:9], 16)[0] == [text[9:13]]


# ------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def plain(tiny_target):
    return [r.token_ids for r in SpeculativeEngine(tiny_target).generate_ids(PROMPTS, max_new_tokens=NEW_TOKENS,
                                                                             eos_token_ids=())]


@pytest.mark.parametrize("leaves", [1, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_equals_plain_decoding(tiny_target, plain, leaves, batch):
    """Chains (1 leaf) and trees (3 leaves, min_prob 0: every branch kept), with the process cache
    holding noisy copies of the answers, so drafts are partly right and trees branch."""
    drafter = SuffixDrafter(num_candidates=leaves, min_prob=0.0, factor=4.0, namespace="greedy-test")
    rng = random.Random(1)
    for prompt, output in zip(PROMPTS, plain):
        noisy = [t if rng.random() < 0.8 else rng.randrange(3, 64) for t in output]
        drafter.cache.add_document(prompt + noisy)
        drafter.cache.add_document(prompt + output[:8] + [rng.randrange(3, 64) for _ in range(8)])
    results = run_requests(SpeculativeEngine(tiny_target, drafter), PROMPTS[:batch], max_new_tokens=NEW_TOKENS,
                           num_draft_tokens=4, eos_token_ids=(), draft_length="fixed")
    tokens, steps = [t for t, _ in results], [s for _, s in results]
    assert tokens == plain[:batch]
    assert sum(s.stats.accepted_tokens for s in steps) > 0
    if leaves > 1:
        # trees were verified: more draft nodes than draft depth in all
        assert any(s.stats.drafted_tokens > sum(s.stats.drafted_per_position) for s in steps)


def test_continuous_batching_with_the_suffix_drafter(tiny_target, plain):
    """Requests join mid-decode and one is cancelled: each finished request has its solo output."""
    engine = SpeculativeEngine(tiny_target, SuffixDrafter(namespace="batching-test"), max_batch_size=2)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, num_draft_tokens=4, eos_token_ids=(), draft_length="fixed")
    ids = [engine.add_request(PROMPTS[0], config), engine.add_request(PROMPTS[1], config)]
    out = {i: [] for i in range(4)}
    steps = 0
    while engine.has_unfinished():
        if steps == 2:
            ids.append(engine.add_request(PROMPTS[2], config))
            ids.append(engine.add_request(PROMPTS[3], config))
        if steps == 3:
            engine.cancel(ids[1])
        for request_id, step in engine.step().requests.items():
            out[ids.index(request_id)] += step.new_tokens
        steps += 1
    assert out[0] == plain[0] and out[2] == plain[2] and out[3] == plain[3]
    assert out[1] == plain[1][:len(out[1])]


def test_learning_across_requests_drafts_the_earlier_answer(tiny_target):
    """A second request repeating the first one's question drafts the first one's answer from the
    process cache (a new drafter instance, same namespace); after clearing, it is cold again."""
    prompt = [[13, 17, 19, 23]]

    def run():
        engine = SpeculativeEngine(tiny_target, SuffixDrafter(namespace="learn-test", factor=8.0))
        return engine.generate_ids(prompt, max_new_tokens=40, num_draft_tokens=6, eos_token_ids=(),
                                   draft_length="fixed")[0]

    first, second = run(), run()
    assert second.token_ids == first.token_ids
    assert second.stats.accepted_tokens > first.stats.accepted_tokens + 10
    assert second.stats.mean_accepted_length > 4
    clear_suffix_caches()
    assert run().stats.accepted_tokens == first.stats.accepted_tokens


def test_the_drafter_declares_its_depth_and_a_request_may_set_another(tiny_target):
    """Without ``num_draft_tokens`` a request drafts to the suffix drafter's own depth (24, SuffixDecoding's),
    prompt lookup to the general 8; a request's k overrides either. The answer is already in the cache,
    so every draft is as long as the depth (and the node budget) allows."""
    prompt = [[13, 17, 19, 23]]
    first = SpeculativeEngine(tiny_target).generate_ids(prompt, max_new_tokens=60, eos_token_ids=())[0]
    drafter = SuffixDrafter(namespace="depth-test", factor=8.0, max_nodes=30)  # (24 nodes by default)
    drafter.cache.add_document(prompt[0] + first.token_ids)

    def deepest(engine, **k):
        result = engine.generate_ids(prompt, max_new_tokens=60, eos_token_ids=(), draft_length="fixed", **k)[0]
        assert result.token_ids == first.token_ids
        return len(result.stats.drafted_per_position)

    assert SuffixDrafter.capabilities.default_draft_tokens == 24
    assert deepest(SpeculativeEngine(tiny_target, drafter)) == 24
    assert deepest(SpeculativeEngine(tiny_target, drafter), num_draft_tokens=5) == 5
    lookup = genspec.build_drafter("prompt-lookup", tiny_target)
    assert lookup.capabilities.default_draft_tokens == 8
    assert GenerationConfig().resolved(False, lookup.capabilities.default_draft_tokens).num_draft_tokens == 8
    assert GenerationConfig(num_draft_tokens=3).resolved(False, 24).num_draft_tokens == 3
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        GenerationConfig(num_draft_tokens=0)


def test_evidence_reaches_the_draft_length_policy(tiny_target):
    """Every step reports the match level behind the row's proposal (the cost policy's evidence)."""
    engine = SpeculativeEngine(tiny_target, SuffixDrafter(namespace="evidence-test"))
    request = engine.add_request([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], GenerationConfig(max_new_tokens=16, eos_token_ids=()))
    seen = []
    while engine.has_unfinished():
        seen.append(engine.step().requests[request].evidence)
    assert set(seen) <= {None, 0, *MATCH_LEVELS}  # None: no room left to draft (the last step)
    assert seen[0] == 6  # the 7-token suffix [5, 6, 7, 8, 5, 6, 7] occurred 4 tokens earlier


@pytest.mark.parametrize("leaves", [1, 4])
def test_lossless_sampling(leaves):
    """Temperature 0.7, top-k 8, top-p 0.9 on a sharpened tiny target, the process cache seeded with 16
    of the target's own samples (temperature 1.5) after the prompt, so the drafter proposes chains
    (1 leaf) or trees (4 leaves) of partly-right tokens. N = 20,000 joint samples of 3 tokens,
    chi-square against the exact law, fail if p < 1e-3."""

    def make(target):
        drafter = SuffixDrafter(num_candidates=leaves, sampled_candidates=leaves, min_prob=0.0, namespace="chi-test")
        for seed in range(16):
            sample = SpeculativeEngine(target).generate_ids([[3, 5, 7]], max_new_tokens=4, temperature=1.5, seed=seed,
                                                             eos_token_ids=())[0]
            drafter.cache.add_document([3, 5, 7] + sample.token_ids)
        drafter.learn = False  # the 20,000 test requests do not add to it
        return drafter

    pvalue, acceptance = lossless_pvalue(make, SamplingConfig(0.7, 8, 0.9), num_samples=20_000, k=3)
    assert 0.05 < acceptance < 0.95
    assert pvalue > 1e-3


def test_registry_options_and_errors(tiny_target):
    drafter = genspec.build_drafter("suffix", tiny_target, num_drafts=3, cache_tokens=5000)
    assert drafter.name == "suffix" and drafter.capabilities.free and drafter.greedy_leaves == 3
    assert drafter.capabilities.max_candidates == 4 and drafter.cache.max_tokens == 5000
    for bad in ({"min_prob": 2}, {"max_nodes": 0}, {"factor": 0}, {"cache_tokens": 3}, {"num_candidates": 0},
                {"learn": "yes"}):
        with pytest.raises(ConfigError):
            genspec.build_drafter("suffix", tiny_target, **bad)
    with pytest.raises(ConfigError, match="does not take option"):
        genspec.build_drafter("suffix", tiny_target, bogus=1)


def test_rollback_rebuilds_the_request_cache():
    """Proposing on a sequence that is not an extension of the last one (a hierarchical stack's
    uncommitted text) gives what a fresh drafter gives."""
    drafter, fresh = SuffixDrafter(namespace="rollback-test"), SuffixDrafter(namespace="rollback-test")
    first = [1, 2, 3, 4, 1, 2, 3, 9, 9]
    second = [1, 2, 3, 4, 1, 2, 3]
    drafter.propose([DraftRequest(0, first, 4)])
    again = drafter.propose([DraftRequest(0, second, 4)])
    assert torch.equal(again.tokens, fresh.propose([DraftRequest(0, second, 4)]).tokens)
