"""Lookahead's Jacobi branch and the contract it reads through: the engine hands a drafter that declares
``reads_block_predictions`` the target's most likely token at every node of its block (and no other drafter),
the window refreshes from them and feeds n-grams to the pool that the text has not shown, greedy output stays
plain decoding's and sampled output keeps the target's law."""
from __future__ import annotations

import pytest
import torch
from stats_helpers import lossless_pvalue
from tiny_models import tiny_llama

import genspec
from genspec.drafters.base import BlockPredictions, Draft, Drafter, DrafterCapabilities, DraftRequest, RequestContext
from genspec.drafters.lookahead import LookaheadDrafter
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20]]


def _propose(drafter, sequence, limit, request_id=0):
    draft = drafter.propose([DraftRequest(request_id, sequence, limit)])
    return draft.chains(0), draft.evidence_of(0)


def _occurs(text: list[int], gram: list[int]) -> bool:
    return any(text[i:i + len(gram)] == gram for i in range(len(text) - len(gram) + 1))


# ------------------------------------------------------------------------------- the window and the pool
def test_jacobi_window_adds_ngrams_the_text_has_not_shown():
    """The target's predictions over the window (after 6 it says 10, after 7 11, after 8 12) become pool
    n-grams; two steps later the pool offers ``7, 11`` after 6 although the text only ever had ``6, 7, 8``,
    after the text's own n-gram (the text's tier first), and after 10, where the text has none, ``11, 14``
    alone, graded "guessed". The pool alone, on the same text, can only draft what the text showed. The
    window takes a candidate slot the pool leaves free: the only one where the pool has nothing, the third
    of three beside two pool chains."""
    text = [5, 6, 7, 8]
    jacobi, pool_only = LookaheadDrafter(ngram_size=3, window=3), LookaheadDrafter(ngram_size=3, window=0)
    wide = LookaheadDrafter(ngram_size=3, window=3, num_candidates=3)
    for drafter in (jacobi, pool_only, wide):
        drafter.start([RequestContext(0, list(text))])
    later = text + [9, 6]
    for drafter in (jacobi, wide):
        # nothing followed 8 yet: the window starts from the text's last 3 tokens, the only candidate
        assert _propose(drafter, text, 3) == ([[6, 7, 8]], "jacobi")
        drafter.read_predictions([BlockPredictions(0, 4, ((6, 7, 8),), ((9, 10, 11, 12),))])
        # 9 was committed: the window is the target's later predictions, refreshed (a Jacobi iteration)
        assert _propose(drafter, text + [9], 3) == ([[10, 11, 12]], "jacobi")
        drafter.read_predictions([BlockPredictions(0, 5, ((10, 11, 12),), ((6, 13, 14, 15),))])
    assert not _occurs(later, [6, 7, 11]) and not _occurs(later, [10, 11, 14])
    assert _propose(jacobi, later, 2) == ([[7, 8]], "pool")  # the text's n-gram fills the one slot
    # beside the pool's two chains (the text's, then the guessed one), the window: the predictions after 6
    assert _propose(wide, later, 2) == ([[7, 8], [7, 11], [13, 14]], "pool")
    assert _propose(pool_only, later, 2) == ([[7, 8]], None)
    assert _propose(LookaheadDrafter(ngram_size=3, window=0), later, 2) == ([[7, 8]], None)
    fresh = LookaheadDrafter(ngram_size=3, window=3)
    fresh.start([RequestContext(0, list(text))])
    _propose(fresh, text, 3)
    fresh.read_predictions([BlockPredictions(0, 4, ((6, 7, 8),), ((9, 10, 11, 12),))])
    _propose(fresh, text + [9], 3)
    fresh.read_predictions([BlockPredictions(0, 5, ((10, 11, 12),), ((6, 13, 14, 15),))])
    assert _propose(fresh, text + [9, 10], 2) == ([[11, 14]], "guessed")  # the text never showed 10


def test_a_guess_that_survives_an_iteration_is_graded_settled():
    """The evidence of a window draft says whether its first guess is the one drafted for that position a
    step before (Jacobi decoding's sign of convergence), so the draft-length policy prices the two apart."""
    drafter = LookaheadDrafter(ngram_size=2, window=3)
    drafter.start([RequestContext(0, [3, 4, 5])])
    assert _propose(drafter, [3, 4, 5], 3) == ([[3, 4, 5]], "jacobi")
    # 6 committed; the target said 4 after 3 (the guess for position 4 was 4): unchanged, settled
    drafter.read_predictions([BlockPredictions(0, 3, ((3, 4, 5),), ((6, 4, 8, 9),))])
    assert _propose(drafter, [3, 4, 5, 6], 3) == ([[4, 8, 9]], "jacobi-settled")
    # 7 committed; the target now says 1 after 4 where the guess for position 5 was 8: not settled
    drafter.read_predictions([BlockPredictions(0, 4, ((4, 8, 9),), ((7, 1, 2, 3),))])
    assert _propose(drafter, [3, 4, 5, 6, 7], 3) == ([[1, 2, 3]], "jacobi")


def test_guesses_the_plan_cut_off_keep_their_place():
    """A window drafted 4 deep but verified 1 deep (the plan's cut): the first two positions take the
    target's predictions, the two guesses it did not score stay for the positions after them, and the window
    is extended through the pool back to 4 guesses."""
    drafter = LookaheadDrafter(ngram_size=2, window=4)
    drafter.start([RequestContext(0, [3, 4, 5, 6])])
    assert _propose(drafter, [3, 4, 5, 6], 4) == ([[3, 4, 5, 6]], "jacobi")
    drafter.read_predictions([BlockPredictions(0, 4, ((3,),), ((7, 8),))])
    # 7 committed; 8 refreshed, 5 and 6 kept, then 7 (what followed 6 in the text)
    assert _propose(drafter, [3, 4, 5, 6, 7], 4)[0] == [[8, 5, 6, 7]]


def test_a_window_whose_predictions_never_come_is_dropped():
    """Proposed for outside the engine's step (as a hierarchical level would be), the drafter gets no
    predictions back: it stops drafting a window rather than repeat a stale guess."""
    drafter = LookaheadDrafter(ngram_size=2, window=3)
    drafter.start([RequestContext(0, [3, 4, 5])])
    assert _propose(drafter, [3, 4, 5], 3)[0] == [[3, 4, 5]]
    assert _propose(drafter, [3, 4, 5], 3)[0] == [[3, 4, 5]]  # the same step asked again (a retry): same draft
    assert _propose(drafter, [3, 4, 5, 9], 3)[0] == []


# ------------------------------------------------------------------------------- the engine's side
class Recorder(Drafter):
    """Two fixed candidate chains per row; records every :class:`BlockPredictions` it is handed."""

    def __init__(self, name: str, reads: bool):
        self.name = name
        self.capabilities = DrafterCapabilities(free=True, max_candidates=2, reads_block_predictions=reads)
        self.received: list[BlockPredictions] = []
        self.fail_on: set[int] = set()

    def propose(self, requests):
        return Draft.from_chains([[[5, 6, 7], [8, 9]] for _ in requests], num_chains=2)

    def read_predictions(self, predictions):
        if any(p.request_id in self.fail_on for p in predictions):
            raise RuntimeError("boom")
        self.received.extend(predictions)


def _run(engine, configs):
    ids = [engine.add_request(prompt, config) for prompt, config in configs]
    out = {i: [] for i in ids}
    finish = {}
    while engine.has_unfinished():
        for request_id, step in engine.step().requests.items():
            out[request_id] += step.new_tokens
            if step.finish_reason is not None:
                finish[request_id] = step.finish_reason
    return ids, out, finish


def test_the_engine_hands_predictions_only_to_drafters_that_read_them():
    """Two drafters in one batch: the one that declares ``reads_block_predictions`` gets, per request and
    step, its chains as verified (cut to k = 2) and the target's argmax after each of their prefixes (checked
    against a full forward pass; the sampled request's too: temperature, top-k and top-p keep the argmax);
    the other gets nothing."""
    model = tiny_llama(0)
    reads, blind = Recorder("reads", True), Recorder("blind", False)
    engine = SpeculativeEngine(HFCausalLM(model), drafters={"reads": reads, "blind": blind})
    common = dict(max_new_tokens=6, num_draft_tokens=2, draft_length="fixed", eos_token_ids=())
    configs = [(PROMPTS[0], GenerationConfig(drafter="reads", **common)),
               (PROMPTS[1], GenerationConfig(drafter="blind", **common)),
               (PROMPTS[2], GenerationConfig(drafter="reads", temperature=0.8, top_k=5, top_p=0.9, seed=3, **common))]
    ids, out, _ = _run(engine, configs)
    assert blind.received == []
    assert {p.request_id for p in reads.received} == {ids[0], ids[2]}
    texts = {ids[0]: PROMPTS[0] + out[ids[0]], ids[2]: PROMPTS[2] + out[ids[2]]}
    assert any(block.chains == ((5, 6), (8, 9)) for block in reads.received)
    for block in reads.received:  # cut to k = 2, or less where the token budget leaves less room
        depth = len(block.chains[0])
        assert block.chains == ((5, 6)[:depth], (8, 9)[:depth])
        sequence = texts[block.request_id][:block.start]
        with torch.no_grad():
            for chain, predicted in zip(block.chains, block.predicted):
                logits = model(torch.tensor([sequence + list(chain)])).logits[0, -len(chain) - 1:]
                assert list(predicted) == logits.argmax(-1).tolist()
        if block.request_id == ids[0]:  # greedy: the prediction after the last token is the token committed
            assert block.predicted[0][0] == texts[ids[0]][block.start]


def test_a_drafter_failing_on_its_predictions_fails_that_request_alone():
    reads = Recorder("reads", True)
    engine = SpeculativeEngine(HFCausalLM(tiny_llama(0)), reads)
    common = dict(max_new_tokens=6, num_draft_tokens=2, draft_length="fixed", eos_token_ids=())
    ids = [engine.add_request(p, GenerationConfig(**common)) for p in PROMPTS[:2]]
    reads.fail_on = {ids[1]}
    finish = {}
    while engine.has_unfinished():
        for request_id, step in engine.step().requests.items():
            if step.finish_reason is not None:
                finish[request_id] = (step.finish_reason, step.error)
    assert finish[ids[0]] == ("length", None)
    assert finish[ids[1]][0] == "error" and "boom" in finish[ids[1]][1]


# ------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("options", [{}, {"num_candidates": 2, "window": 6, "ngram_size": 2}])
def test_greedy_with_the_jacobi_window_equals_plain_decoding(tiny_target, batch, options):
    prompts = PROMPTS[:batch]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=32, eos_token_ids=())
    drafter = LookaheadDrafter(**options)
    assert drafter.capabilities.reads_block_predictions
    results = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=32, num_draft_tokens=4,
                                                                   draft_length="fixed", eos_token_ids=())
    assert [r.token_ids for r in results] == [p.token_ids for p in plain]
    assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("options, prompt", [
    # two pool chains (6 was followed by 4, 7 and 9) and the window, one tree
    ({"window": 2, "num_candidates": 2, "ngram_size": 2}, [6, 4, 6, 7, 6, 9, 6]),
    # nothing in the pool: the window is the whole draft; it starts as [3, 4], and 3 is the target's most
    # likely token after [3, 4, 6] (q = 0.30)
    pytest.param({"window": 3}, [3, 4, 6], marks=pytest.mark.slow),
])
def test_lossless_sampling_with_the_jacobi_window(options, prompt):
    """Sampled (T 0.7, top-k 8, top-p 0.9) from a sharpened 3-layer tiny Llama (vocabulary 12), 3 tokens, k = 2:
    the joint law of N = 20,000 outputs against the exact target law, chi-square p > 1e-3, with the window's
    point-mass drafts accepted some of the time."""
    pvalue, acceptance = lossless_pvalue(lambda target: LookaheadDrafter(**options),
                                         SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), prompt=prompt)
    assert 0.02 < acceptance < 0.98
    assert pvalue > 1e-3


# ------------------------------------------------------------------------------- options
@pytest.mark.parametrize("options, message", [
    ({"window": -1}, "drafter 'lookahead' option window=-1: expected an integer from 0 to 64"),
    ({"window": 1.5}, "drafter 'lookahead' option window=1.5: expected an integer from 0 to 64"),
    ({"window": "abc"}, "drafter 'lookahead' option window='abc': expected an integer from 0 to 64"),
    ({"window": True}, "drafter 'lookahead' option window=True: expected an integer from 0 to 64"),
    ({"window": 100_000_000}, "drafter 'lookahead' option window=100000000: expected an integer from 0 to 64"),
    ({"ngram_size": "x"}, "drafter 'lookahead' option ngram_size='x': expected an integer from 2 to 32"),
    ({"num_candidates": "two"}, "drafter 'lookahead' option num_candidates='two': expected an integer from 1 to 32"),
])
def test_bad_options_are_refused_in_one_line(tiny_target, options, message):
    with pytest.raises(ConfigError) as caught:
        genspec.build_drafter("lookahead", tiny_target, **options)
    assert str(caught.value) == message


def test_window_zero_is_the_pool_alone(tiny_target):
    drafter = genspec.build_drafter("lookahead", tiny_target, window=0)
    assert not drafter.capabilities.reads_block_predictions and drafter.capabilities.max_candidates == 1
    jacobi = genspec.build_drafter("lookahead", tiny_target).capabilities  # the window fills a free slot
    assert jacobi.reads_block_predictions and jacobi.max_candidates == 1
    assert genspec.build_drafter("lookahead", tiny_target, num_candidates=2).capabilities.max_candidates == 2


def test_a_tree_drafter_cannot_be_a_hierarchical_level_below_another(tiny_target):
    with pytest.raises(ConfigError, match="level 'suffix' drafts trees"):
        genspec.build_drafter("hierarchical", tiny_target, levels="suffix,early-exit")
