"""Model-free drafters (prompt lookup, n-gram cache, retrieval, edit, lookahead): greedy equality with
plain decoding, exact sampling with deterministic (tree) drafts, edit re-alignment on a copying
target, prompt lookup's matches and evidence, the retrieval datastore round trip, learning across
requests, and clear errors for bad drafter options."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from stats_helpers import chi_square_pvalue
from tiny_models import byte_tokenizer, exact_joint, peaked, tiny_llama

import genspec
from genspec.datastore import SEPARATOR, RetrievalIndex, suffix_array, suffix_array_doubling
from genspec.drafters.base import DraftRequest, RequestContext
from genspec.drafters.edit import EditDrafter
from genspec.drafters.lookahead import LookaheadDrafter
from genspec.drafters.ngram_cache import CountTable, NGramCacheDrafter, StaticTable, clear_process_tables
from genspec.drafters.prompt_lookup import NGramIndex, PromptLookupDrafter
from genspec.drafters.retrieval import RetrievalDrafter
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.models.base import CausalLM
from genspec.sampling import SamplingConfig, process_logits

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def plain(tiny_target):
    """Plain greedy outputs of PROMPTS (the reference every drafter must reproduce)."""
    return [r.token_ids for r in SpeculativeEngine(tiny_target).generate_ids(PROMPTS, max_new_tokens=NEW_TOKENS,
                                                                             eos_token_ids=())]


def _noisy(tokens: list[int], seed: int) -> list[int]:
    """``tokens`` with a few substitutions, deletions and insertions (an imperfect source)."""
    rng = random.Random(seed)
    out = list(tokens)
    for _ in range(3):
        at = rng.randrange(1, len(out) - 1)
        kind = rng.choice(("sub", "del", "ins"))
        if kind == "sub":
            out[at] = rng.randrange(3, 64)
        elif kind == "del":
            del out[at]
        else:
            out.insert(at, rng.randrange(3, 64))
    return out


def model_free_drafters(plain_outputs):
    """name -> factory(batch) of a drafter whose drafts are partly right on the tiny target."""
    sources = [p + _noisy(o, i) for i, (p, o) in enumerate(zip(PROMPTS, plain_outputs))]
    index = RetrievalIndex.from_documents([_noisy(s, 7) for s in sources] + [list(range(3, 60))])
    return {
        "prompt-lookup": lambda batch: PromptLookupDrafter(),
        "prompt-lookup-tree": lambda batch: PromptLookupDrafter(num_candidates=3),
        "ngram-cache": lambda batch: NGramCacheDrafter(namespace="greedy-test", static=StaticTable(
            index.tokens, 1, 4, SEPARATOR)),
        "retrieval": lambda batch: RetrievalDrafter(index),
        "retrieval-tree": lambda batch: RetrievalDrafter(index, num_candidates=3, min_suffix=1),
        "retrieval-context": lambda batch: RetrievalDrafter(index, context=True),
        "retrieval-context-tree": lambda batch: RetrievalDrafter(index, num_candidates=3, context=True),
        "edit": lambda batch: EditDrafter(),  # each request's source: PER_REQUEST_SOURCE
        "edit-tree": lambda batch: EditDrafter(num_candidates=3),
        "edit-prompt-source": lambda batch: EditDrafter(),
        "lookahead": lambda batch: LookaheadDrafter(),
        "lookahead-tree": lambda batch: LookaheadDrafter(num_candidates=4),
        "lookahead-pool": lambda batch: LookaheadDrafter(window=0),
        "lookahead-pool-tree": lambda batch: LookaheadDrafter(num_candidates=4, window=0),
    }


DRAFTER_NAMES = list(model_free_drafters([[0] * NEW_TOKENS] * 4))
#: drafters whose requests each bring their own edit source (a noisy copy of the plain output)
PER_REQUEST_SOURCE = ("edit", "edit-tree")


def run_requests(engine, prompts, per_request_options=None, **config) -> list:
    """Decode ``prompts`` through the step API, request i with drafter options ``per_request_options[i]``;
    returns ``(tokens, final RequestStep)`` per prompt."""
    ids = [engine.add_request(p, GenerationConfig(**config, drafter_options=(per_request_options or [{}] * len(prompts))[i]))
           for i, p in enumerate(prompts)]
    tokens, done = {i: [] for i in ids}, {}
    while engine.has_unfinished():
        for request_id, step in engine.step().requests.items():
            tokens[request_id] += step.new_tokens
            if step.finish_reason is not None:
                done[request_id] = step
    return [(tokens[i], done[i]) for i in ids]


def chains_of(draft, row: int = 0) -> list[list[int]]:
    return [draft.tokens[row, m, :int(draft.lengths[row, m])].tolist() for m in range(draft.num_chains)]


def propose(drafter, sequences, limits):
    """A drafter's draft for token-id sequences (request ids 0, 1, ...)."""
    return drafter.propose([DraftRequest(i, s, n) for i, (s, n) in enumerate(zip(sequences, limits))])


# ------------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("name", DRAFTER_NAMES)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_equals_plain_decoding(tiny_target, plain, name, batch):
    drafter = model_free_drafters(plain)[name](batch)
    options = ([{"source": _noisy(o, 10 + i)} for i, o in enumerate(plain[:batch])] if name in PER_REQUEST_SOURCE
               else None)
    # fixed k: with the cost policy a tiny model's timings may switch drafting off, and the test
    # below is that the drafts were really used
    results = run_requests(SpeculativeEngine(tiny_target, drafter), PROMPTS[:batch], options,
                           max_new_tokens=NEW_TOKENS, num_draft_tokens=4, eos_token_ids=(), draft_length="fixed")
    assert [tokens for tokens, _ in results] == plain[:batch]
    if name not in ("edit-prompt-source",):
        assert sum(step.stats.accepted_tokens for _, step in results) > 0  # the drafts really were used


def test_registry_builds_every_model_free_drafter(tiny_target, tmp_path):
    index_dir = RetrievalIndex.from_documents([[5, 6, 7, 8]]).save(tmp_path / "index")
    for name, options in [("prompt-lookup", {"num_drafts": 2}), ("ngram-cache", {}),
                          ("retrieval", {"index": str(index_dir)}), ("edit", {"edit_source": [5, 6, 7]}),
                          ("lookahead", {"ngram_size": 3})]:
        drafter = genspec.build_drafter(name, tiny_target, **options)
        assert drafter.name == name and drafter.capabilities.free
    assert genspec.build_drafter("prompt-lookup", tiny_target, num_drafts=2).num_candidates == 2
    with pytest.raises(ConfigError, match="does not take option"):
        genspec.build_drafter("lookahead", tiny_target, bogus=1)
    with pytest.raises(ConfigError, match="needs a datastore"):
        genspec.build_drafter("retrieval", tiny_target)


# ------------------------------------------------------------------------------- lossless sampling
def _lossless_pvalue(drafter, prompt: list[int], num_samples: int = 20_000, length: int = 3, k: int = 3,
                     seed: int = 21):
    """Joint law of ``length`` sampled tokens (T 0.7, top-k 8, top-p 0.9) against the exact law."""
    sampling = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)
    model = peaked(tiny_llama(0, vocab=12))
    results = SpeculativeEngine(HFCausalLM(model), drafter).generate_ids(
        [prompt] * num_samples, max_new_tokens=length, num_draft_tokens=k, temperature=0.7, top_k=8, top_p=0.9,
        seed=seed, eos_token_ids=(), draft_length="fixed")
    counts = torch.zeros([12] * length)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    exact = exact_joint(model, prompt, length, lambda logits: process_logits(logits, sampling))
    accepted = sum(r.stats.accepted_tokens for r in results) / sum(r.stats.drafted_tokens for r in results)
    return chi_square_pvalue(counts.numpy(), exact.numpy()), accepted


def test_lossless_sampling_deterministic_drafter():
    """The edit drafter (one-hot draft law; its source is the target's greedy path, so drafts are
    often but not always right) keeps sampling exact: N = 20,000, chi-square p > 1e-3."""
    pvalue, acceptance = _lossless_pvalue(EditDrafter([0, 4, 0, 0]), [3, 5, 7], num_samples=20_000)
    assert 0.05 < acceptance < 0.95
    assert pvalue > 1e-3


def test_lossless_sampling_deterministic_tree_drafts():
    """Three deterministic candidate chains per row (prompt lookup after a token seen three times
    with different successors, each of which the target samples 7-13% of the time), verified as a
    tree. N = 20,000, p > 1e-3."""
    pvalue, acceptance = _lossless_pvalue(PromptLookupDrafter(num_candidates=3), [6, 4, 6, 7, 6, 9, 6])
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


# ------------------------------------------------------------------------------- edit drafter
class CopyModel(CausalLM):
    """A target that copies: at position p of row b every logit is 0 except ``documents[b][p + 1]``
    (100), whatever the tokens. Greedy decoding after ``prompt`` reproduces the rest of the
    document exactly, so a drafter's acceptance on it is exactly known."""

    max_context = None

    def __init__(self, documents: list[list[int]], vocab_size: int, tokenizer=None):
        self.documents, self.vocab_size, self.tokenizer = documents, vocab_size, tokenizer
        self.reset(0)

    def reset(self, batch_size=0):
        self._lengths = torch.zeros(batch_size, dtype=torch.long)
        self._rows = list(range(batch_size))  # the document of each row
        self._added = batch_size

    def add_rows(self, prefixes, return_hidden=False, hidden_layers=(), hidden_last=None):  # rows take the documents in the order they join
        if return_hidden:
            raise ConfigError("CopyModel has no hidden states")
        self._rows += [(self._added + i) % len(self.documents) for i in range(len(prefixes))]
        self._added += len(prefixes)
        self._lengths = torch.cat([self._lengths, torch.tensor([len(p) for p in prefixes], dtype=torch.long)])

    def remove_rows(self, rows):
        kept = [r for r in range(len(self._rows)) if r not in set(rows)]
        self._rows = [self._rows[r] for r in kept]
        self._lengths = self._lengths[kept]

    def hidden_states(self, tokens, valid=None, tree_mask=None):
        raise NotImplementedError

    def forward(self, tokens, valid=None, tree_mask=None, last_only=False, prefix=None, return_hidden=False,
                hidden_layers=()):
        if return_hidden:
            raise ConfigError("CopyModel has no hidden states")
        batch, width = tokens.shape
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        depth = torch.arange(width).expand(batch, width) if tree_mask is None else tree_mask.sum(-1) - 1
        positions = self._lengths.unsqueeze(1) + depth
        logits = torch.zeros(batch, width, self.vocab_size)
        for b in range(batch):
            document = self.documents[self._rows[b]]
            for i in range(width):
                p = int(positions[b, i]) + 1
                logits[b, i, document[p] if p < len(document) else 0] = 100.0
        if last_only:
            last = valid.long().sum(1).clamp(min=1) - 1
            return logits[torch.arange(batch), last].unsqueeze(1)
        return logits

    def keep_block(self, keep):
        self._lengths = self._lengths + (keep >= 0).sum(1)

    def commit_all(self, valid=None):  # the engine commits a prefill with it
        self._lengths = self._lengths + (valid.sum(1) if valid is not None else 0)

    def truncate(self, lengths):
        self._lengths = torch.minimum(self._lengths, lengths)

    @property
    def lengths(self):
        return self._lengths


def _with_errors(text: list[int], rng: random.Random, vocab: int, count: int = 8) -> list[int]:
    """``text`` with ``count`` errors: substitutions, deletions and insertions of 1-3 tokens, spread out."""
    source = list(text)
    spots = sorted(rng.sample(range(10, len(text) - 10, 12), count), reverse=True)
    for i, at in enumerate(spots):
        size = 1 + i % 3
        kind = ("sub", "del", "ins")[i % 3]
        if kind == "sub":
            source[at:at + size] = [rng.randrange(3, vocab) for _ in range(size)]
        elif kind == "del":  # the source lacks tokens the correction has
            del source[at:at + size]
        else:  # the source has extra tokens the correction drops
            source[at:at] = [rng.randrange(3, vocab) for _ in range(size)]
    return source


@pytest.mark.parametrize("batch", [1, 4])
def test_edit_drafter_realigns_after_edits(batch):
    """On a target that writes a corrected version of the source (8 insertions, deletions and
    substitutions in 300 tokens), the edit drafter re-aligns after every edit: output exact, mean
    accepted length > 5 with k = 8."""
    rng, vocab = random.Random(5), 500
    prompts = [[1, 3 + b] for b in range(batch)]
    corrected = [[rng.randrange(3, vocab) for _ in range(300)] for _ in range(batch)]
    sources = [_with_errors(c, rng, vocab) for c in corrected]
    model = CopyModel([p + c for p, c in zip(prompts, corrected)], vocab)
    results = run_requests(SpeculativeEngine(model, EditDrafter()), prompts, [{"source": s} for s in sources],
                           max_new_tokens=300, num_draft_tokens=8, eos_token_ids=(), draft_length="fixed")
    for (tokens, step), text in zip(results, corrected):
        assert tokens == text
        assert step.stats.mean_accepted_length > 5
    # without re-alignment (pointer only advances) the same task does much worse
    naive = _no_realign_mean(CopyModel(model.documents[:1], vocab), prompts[:1], sources[0])
    assert results[0][1].stats.mean_accepted_length > 1.5 * naive


def _no_realign_mean(model, prompts, source) -> float:
    class Naive(EditDrafter):  # after a mismatch: assume a substitution, never search
        def _realign(self, row, sequence):
            return [row.anchor + row.written]

    result = SpeculativeEngine(model, Naive(source)).generate_ids(
        prompts, max_new_tokens=300, num_draft_tokens=8, eos_token_ids=(), draft_length="fixed")[0]
    return result.stats.mean_accepted_length


def test_edit_drafter_on_text_with_tokenizer():
    """Text in, text out: the source is tokenised with the target's tokenizer (byte level)."""
    tokenizer = byte_tokenizer()
    corrected = ("The committee met on Tuesday to discuss the new public library. The library will have three "
                 "floors, a reading room for children, a maker space with printers, and a small cafe. Construction "
                 "will start in March and is expected to take eighteen months. The council approved a budget of "
                 "twelve million dollars for the project, which will be paid for by a local bond and a state grant.")
    source = ("The committee met on tuesday to discuss the the new public library. The library will have three "
              "floors, a reading room for children, a maker space with printers, and small cafe. Construction "
              "will start in March and is expected to take eighteen month. The council approved a budget of "
              "twelve million dollars for the project, which will be payed for by a local bond and a state grant.")
    prompt = tokenizer("Fix: ", add_special_tokens=False)["input_ids"]
    ids = tokenizer(corrected, add_special_tokens=False)["input_ids"]
    model = CopyModel([prompt + ids], len(tokenizer), tokenizer)
    drafter = genspec.build_drafter("edit", model, edit_source=source)
    result = SpeculativeEngine(model, drafter).generate_ids([prompt], max_new_tokens=len(ids), num_draft_tokens=8,
                                                            eos_token_ids=(), draft_length="fixed")[0]
    assert tokenizer.decode(result.token_ids) == corrected
    assert result.stats.mean_accepted_length > 5


def test_edit_drafter_uses_the_prompt_without_source():
    rng = random.Random(9)
    text = [rng.randrange(3, 200) for _ in range(120)]
    prompt = [1] + _with_errors(text, rng, 200, count=4) + [2]
    model = CopyModel([prompt + text], 200)
    result = SpeculativeEngine(model, EditDrafter()).generate_ids([prompt], max_new_tokens=120, num_draft_tokens=8,
                                                                  eos_token_ids=(), draft_length="fixed")[0]
    assert result.token_ids == text
    assert result.stats.mean_accepted_length > 4


def test_edit_drafter_drafts_the_outputs_own_repeats():
    """Text the output wrote itself (not in the source) and now repeats is drafted from the output."""
    from genspec.sampling import SamplingConfig

    source = list(range(100, 140))
    drafter = EditDrafter(source)
    prompt = [1, 2]
    drafter.start([RequestContext(0, prompt, SamplingConfig())])
    sequence = prompt + [100, 101, 102, 103] + [50, 51, 52, 53, 54, 55] + [104, 105] + [50, 51, 52]
    assert chains_of(propose(drafter, [sequence], [3])) == [[53, 54, 55]]
    # while the output copies the source along, the source wins
    drafter.start([RequestContext(0, prompt, SamplingConfig())])
    propose(drafter, [prompt + [100, 101]], [3])
    assert chains_of(propose(drafter, [prompt + [100, 101, 102]], [3])) == [[103, 104, 105]]


# ------------------------------------------------------------------------------- prompt lookup
def test_prompt_lookup_longest_then_most_recent():
    drafter = PromptLookupDrafter(max_ngram=3, num_candidates=3)
    sequence = [1, 2, 3, 40, 9, 2, 3, 41, 7, 3, 42, 1, 2, 3]
    tree = propose(drafter, [sequence], [2])
    # [1 2 3] matched once (-> 40), then [2 3] most recent first (-> 41), then [3] (-> 42)
    assert chains_of(tree) == [[40, 9], [41, 7], [42, 1]]
    single = propose(PromptLookupDrafter(max_ngram=3), [sequence], [3])
    assert chains_of(single) == [[40, 9, 2]]


def test_prompt_lookup_repeats_a_period_past_the_end():
    draft = propose(PromptLookupDrafter(), [[7, 1, 2, 1, 2]], [6])
    assert chains_of(draft) == [[1, 2, 1, 2, 1, 2]]


def test_prompt_lookup_reports_match_length_as_evidence():
    drafter = PromptLookupDrafter(max_ngram=3)
    seq = [1, 2, 3, 4, 9, 9, 1, 2, 3]  # last 3 tokens seen before: a 3-gram match
    draft = drafter.propose([DraftRequest(i, s, 4) for i, s in enumerate([seq, [5, 6, 7], [1, 8, 1]])])
    assert draft.evidence == (3, 0, 1)
    assert draft.first_chain(0) == [4, 9, 9, 1]


def test_ngram_index_is_exact_after_rollback():
    rng = random.Random(0)
    sequence = [rng.randrange(5) for _ in range(200)]
    index = NGramIndex(1, 4)
    index.sync(sequence)
    index.sync(sequence[:150] + [9, 9, 9])  # a changed tail (hierarchical stacks propose on drafts)
    fresh = NGramIndex(1, 4)
    fresh.sync(sequence[:150] + [9, 9, 9])
    assert index.positions == fresh.positions


# ------------------------------------------------------------------------------- n-gram cache
def test_ngram_cache_learns_across_requests(tiny_target):
    """A second request with the same prompt is drafted from what the first one generated, even by a
    new drafter instance (the table lives in the process)."""
    clear_process_tables()
    prompt = [[13, 17, 19, 23]]

    def run():
        return SpeculativeEngine(tiny_target, NGramCacheDrafter(namespace="learn-test")).generate_ids(
            prompt, max_new_tokens=40, num_draft_tokens=6, eos_token_ids=(), draft_length="fixed")[0]

    first, second = run(), run()
    assert second.token_ids == first.token_ids
    assert second.stats.accepted_tokens > first.stats.accepted_tokens + 10
    assert second.stats.mean_accepted_length > 3
    clear_process_tables()
    assert run().stats.accepted_tokens == first.stats.accepted_tokens  # forgotten: as the first time
    # a drafter built before the clear forgets too (benchmark repeats reuse their drafter instances)
    clear_process_tables()
    kept = NGramCacheDrafter(namespace="learn-test")
    engine = SpeculativeEngine(tiny_target, kept)
    engine.generate_ids(prompt, max_new_tokens=40, num_draft_tokens=6, eos_token_ids=(), draft_length="fixed")
    clear_process_tables()
    again = engine.generate_ids(prompt, max_new_tokens=40, num_draft_tokens=6, eos_token_ids=(),
                                draft_length="fixed")[0]
    assert again.stats.accepted_tokens == first.stats.accepted_tokens


def test_count_table_leader_and_removal():
    table = CountTable(1, 2)
    tokens = [1, 2, 1, 3, 1, 3, 1, 2, 1, 2]
    table.add(tokens, 0, len(tokens))
    assert table.best((1,)) == (2, 3, 5)  # 1 -> 2 three times, -> 3 twice
    table.remove(tokens, 7, len(tokens))  # un-count the last two "1 -> 2"
    assert table.best((1,)) == (3, 2, 3)
    assert table.best((9,)) is None


def test_static_table_counts_like_a_dict():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 6, 3000)
    table = StaticTable(tokens, 1, 3)
    for n in (1, 2, 3):
        counts: dict = {}
        for j in range(n, len(tokens)):
            counts.setdefault(tuple(tokens[j - n:j].tolist()), {}).setdefault(int(tokens[j]), 0)
            counts[tuple(tokens[j - n:j].tolist())][int(tokens[j])] += 1
        for key, following in counts.items():
            token, count, total = table.best(key)
            assert count == max(following.values()) and following[token] == count
            assert total == sum(following.values())
    assert table.best((7, 7)) is None


# ------------------------------------------------------------------------------- retrieval
def test_suffix_arrays_agree_with_sorting():
    rng = np.random.default_rng(0)
    for size, vocab in [(1, 3), (7, 2), (500, 3), (800, 40)]:
        tokens = rng.integers(0, vocab, size).astype(np.uint32)
        expected = sorted(range(size), key=lambda i: tokens[i:].tolist())
        assert suffix_array(tokens).tolist() == expected
        assert suffix_array_doubling(tokens).tolist() == expected


def test_retrieval_index_round_trip_and_longest_match(tmp_path):
    documents = [[5, 6, 7, 8, 9, 10], [1, 6, 7, 8, 11, 12], [6, 7, 8, 9, 13]]
    index = RetrievalIndex.from_documents(documents, {"note": "x"})
    loaded = RetrievalIndex.load(index.save(tmp_path / "ds"))
    assert loaded.tokens.tolist() == index.tokens.tolist()
    assert loaded.reversed_suffix_array.tolist() == index.reversed_suffix_array.tolist()
    assert loaded.meta["note"] == "x" and loaded.meta["num_tokens"] == len(index)
    length, lo, hi = loaded.longest_suffix_match([99, 6, 7, 8], 16)
    assert (length, hi - lo) == (3, 3)
    drafter = RetrievalDrafter(loaded, num_candidates=2)
    tree = propose(drafter, [[99, 6, 7, 8]], [3])
    assert chains_of(tree) == [[9, 10], [11, 12]]  # most frequent first token first; no draft across documents
    draft = propose(RetrievalDrafter(loaded), [[5, 6, 7, 8, 9]], [4])
    assert chains_of(draft) == [[10]]  # the document ends there


def test_retrieval_with_context_takes_the_longer_match():
    index = RetrievalIndex.from_documents([[5, 6, 7, 8, 9, 10], [1, 6, 7, 8, 11, 12]])
    drafter = RetrievalDrafter(index, context=True, num_candidates=2)
    drafter.start([RequestContext(0, [40, 41, 42])])
    # nothing in the datastore; the request saw 41, 42 followed by 43 44: the context drafts
    tree = propose(drafter, [[40, 41, 42, 43, 44, 41, 42]], [2])
    assert chains_of(tree)[0] == [43, 44]
    assert tree.evidence == (("context", 2),)
    # datastore suffix 3 (6 7 8) beats the request's 2-gram (7 8 -> 30): datastore candidates first,
    # then the request's candidate with a new first token
    drafter.finish([0])
    tree = propose(drafter, [[7, 8, 30, 6, 7, 8]], [2])
    assert sorted(chains_of(tree)) == [[9, 10], [11, 12]] and tree.evidence == (("datastore", 3),)
    chains = chains_of(propose(RetrievalDrafter(index, context=True, num_candidates=3), [[7, 8, 30, 6, 7, 8]], [2]))
    assert sorted(chains[:2]) == [[9, 10], [11, 12]] and chains[2] == [30, 6]
    # a tie goes to the request; no match anywhere: no draft
    draft = propose(RetrievalDrafter(index, context=True), [[7, 8, 50, 99, 7, 8]], [2])
    assert chains_of(draft) == [[50, 99]] and draft.evidence == (("context", 2),)
    draft = propose(RetrievalDrafter(index, context=True), [[90, 91]], [3])
    assert chains_of(draft) == [[]]
    with pytest.raises(ConfigError, match="option context='yes': expected true or false"):
        RetrievalDrafter(index, context="yes")


def test_index_built_for_another_tokenizer_is_refused(tmp_path, tiny_target):
    class Other:
        name_or_path = "other"

        def __len__(self):
            return 64

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [7] * 3}

    index = RetrievalIndex.from_documents([[5, 6, 7]], {"tokenizer_probe": [1, 2], "tokenizer_size": 64})
    target_with_tokenizer = CopyModel([[0]], 64, Other())
    with pytest.raises(ConfigError, match="another tokenizer"):
        RetrievalDrafter.for_target(target_with_tokenizer, index=index)
