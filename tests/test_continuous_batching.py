"""The engine's step API: requests that join and leave mid-decode, each with its own settings.

Greedy equality with each request decoded alone, for every drafter, under staggered arrivals,
different lengths and a cancellation; a chi-square test on a batch mixing temperatures, top-p and
drafters; seeded requests reproducible whatever shares their batch; step records; bad requests.
"""
from __future__ import annotations

import pytest
import torch
from stats_helpers import chi_square_pvalue
from tiny_models import peaked, tiny_llama

import genspec
from genspec.datastore import RetrievalIndex
from genspec.drafters import DraftModelDrafter, PromptLookupDrafter
from genspec.drafters.head import HeadDrafter
from genspec.drafters.hybrid import HybridDrafter
from genspec.drafters.medusa import MedusaDrafter
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError, ContextLengthError
from genspec.models import HFCausalLM
from genspec.speculators.head import DraftHead, HeadConfig
from genspec.speculators.medusa import MedusaConfig, MedusaHeads

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20],
           [30, 31, 32, 33, 30, 31], [40, 41]]
#: (step at which the request joins, max_new_tokens): staggered arrivals, different lengths
SCHEDULE = [(0, 30), (0, 12), (2, 25), (3, 8), (7, 20), (9, 16)]
CANCELLED = 4  # this request is cancelled a few steps after it joins


def run_schedule(engine: SpeculativeEngine, configs: list[GenerationConfig], schedule=SCHEDULE,
                 cancel: dict[int, int] | None = None, prompts=PROMPTS):
    """Drive the step API: request i joins at step ``schedule[i][0]``; ``cancel`` maps a request index
    to the step at which it is cancelled. Returns per request (tokens, final RequestStep) and the records."""
    ids: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    final: dict[int, object] = {}
    records = []
    step = 0
    while len(ids) < len(schedule) or engine.has_unfinished():
        for i, (join, _) in enumerate(schedule):
            if join == step:
                ids[i] = engine.add_request(prompts[i], configs[i])
                tokens[ids[i]] = []
        for i, at in (cancel or {}).items():
            if at == step:
                engine.cancel(ids[i])
        record = engine.step()
        records.append(record)
        for request_id, request_step in record.requests.items():
            tokens[request_id] += request_step.new_tokens
            if request_step.finish_reason is not None:
                final[request_id] = request_step
        step += 1
        assert step < 500
    return [(tokens[ids[i]], final[ids[i]]) for i in range(len(schedule))], records


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target


@pytest.fixture(scope="module")
def alone(target):
    """Each request decoded alone by plain decoding (the reference)."""
    engine = SpeculativeEngine(target)
    return [engine.generate_ids([p], max_new_tokens=n, eos_token_ids=())[0].token_ids
            for p, (_, n) in zip(PROMPTS, SCHEDULE)]


def _half_right(outputs: list[list[int]]) -> list[list[int]]:
    """The reference outputs with every other token of the second half replaced (imperfect text)."""
    return [o[:len(o) // 2] + [t if j % 2 else 3 + (t + 1) % 60 for j, t in enumerate(o[len(o) // 2:])]
            for o in outputs]


_HEAD = HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


def _random(module):
    """A trained speculator's stand-in: random weights (its drafts are sometimes right, often wrong)."""
    torch.manual_seed(0)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return module.to(torch.float64)


#: name -> (factory(target, reference outputs), per-request drafter options(reference outputs) or None)
DRAFTERS = {
    "prompt-lookup": (lambda t, ref: PromptLookupDrafter(), None),
    "prompt-lookup-tree": (lambda t, ref: PromptLookupDrafter(num_candidates=3), None),
    "ngram-cache": (lambda t, ref: genspec.build_drafter("ngram-cache", t, namespace="batching-test"), None),
    "retrieval": (lambda t, ref: genspec.build_drafter(
        "retrieval", t, index=RetrievalIndex.from_documents([p + o for p, o in zip(PROMPTS, _half_right(ref))]),
        num_candidates=2, min_suffix=1), None),
    "edit": (lambda t, ref: genspec.build_drafter("edit", t), lambda ref: [{"source": o} for o in _half_right(ref)]),
    "lookahead": (lambda t, ref: genspec.build_drafter("lookahead", t, num_candidates=2), None),
    "draft-model": (lambda t, ref: DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1))), None),
    "draft-model-self": (lambda t, ref: DraftModelDrafter(HFCausalLM(tiny_llama(0))), None),
    "early-exit": (lambda t, ref: genspec.build_drafter("early-exit", t, exit_layer=1), None),
    "layer-skip": (lambda t, ref: genspec.build_drafter("layer-skip", t, skip=[1]), None),
    "hierarchical": (lambda t, ref: genspec.build_drafter("hierarchical", t, levels="prompt-lookup,early-exit"), None),
    "head": (lambda t, ref: HeadDrafter(t, _random(DraftHead(_HEAD)), list(range(3, 64)), tree_nodes=0), None),
    "head-tree": (lambda t, ref: HeadDrafter(t, _random(DraftHead(_HEAD)), list(range(3, 64)), tree_nodes=6), None),
    "medusa": (lambda t, ref: MedusaDrafter(t, _random(MedusaHeads(MedusaConfig(64, 3))), list(range(3, 64))), None),
    "medusa-tree": (lambda t, ref: MedusaDrafter(t, _random(MedusaHeads(MedusaConfig(64, 3))), list(range(3, 64)),
                                                 tree_nodes=6), None),
    "hybrid": (lambda t, ref: HybridDrafter(PromptLookupDrafter(), HeadDrafter(t, _random(DraftHead(_HEAD)),
                                                                                 list(range(3, 64)))), None),
}


#: drafters whose drafts the tiny target never accepts (the test is then rollback after every draft)
UNLIKE = ("draft-model", "early-exit", "layer-skip", "head", "head-tree")


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_requests_joining_and_leaving_equal_each_decoded_alone(target, alone, name):
    """Staggered arrivals, different lengths, one request cancelled mid-decode: every finished request's
    tokens equal that request decoded alone, and the cancelled one's are a prefix of them."""
    make, options = DRAFTERS[name]
    drafter = make(target, alone)
    options = options(alone) if options else [{}] * len(PROMPTS)
    engine = SpeculativeEngine(target, drafter)
    configs = [GenerationConfig(max_new_tokens=n, num_draft_tokens=4, draft_length="fixed", eos_token_ids=(),
                                drafter_options=options[i]) for i, (_, n) in enumerate(SCHEDULE)]
    results, records = run_schedule(engine, configs, cancel={CANCELLED: SCHEDULE[CANCELLED][0] + 2})
    for i, ((tokens, step), reference) in enumerate(zip(results, alone)):
        if i == CANCELLED:
            assert step.finish_reason == "cancelled"
            assert 0 < len(tokens) < len(reference) and tokens == reference[:len(tokens)]
        else:
            assert step.finish_reason == "length"
            assert tokens == reference, f"request {i}"
    assert max(r.batch_size for r in records) >= 3  # requests really overlapped
    assert sum(step.stats.drafted_tokens for _, step in results) > 0  # drafts were verified
    if name not in UNLIKE:
        assert sum(step.stats.accepted_tokens for _, step in results) > 0  # and some kept
    assert engine.num_running == engine.num_waiting == 0 and target.num_rows == 0  # every row was freed
    if isinstance(drafter, DraftModelDrafter):
        assert drafter.model.num_rows == 0


def test_requests_with_different_drafters_share_one_batch(target, alone):
    """One engine holding several drafters; requests pick one each (or none), in one batch."""
    drafters = {"lookup": PromptLookupDrafter(), "tree": PromptLookupDrafter(num_candidates=3),
                "model": DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1))),
                "exit": genspec.build_drafter("early-exit", target, exit_layer=1)}
    engine = SpeculativeEngine(target, drafters=drafters)
    names = ["lookup", "none", "tree", "model", "exit", "lookup"]
    configs = [GenerationConfig(max_new_tokens=n, num_draft_tokens=3, draft_length="fixed", eos_token_ids=(),
                                drafter=name) for name, (_, n) in zip(names, SCHEDULE)]
    results, records = run_schedule(engine, configs)
    assert [tokens for tokens, _ in results] == alone
    assert results[1][1].stats.drafted_tokens == 0  # "none": speculation off for that request alone
    assert all(step.stats.drafted_tokens > 0 for i, (_, step) in enumerate(results) if names[i] != "none")
    assert any(r.batch_size >= 4 for r in records)


def test_max_batch_size_queues_the_rest(target, alone):
    engine = SpeculativeEngine(target, PromptLookupDrafter(), max_batch_size=2)
    configs = [GenerationConfig(max_new_tokens=n, eos_token_ids=()) for _, n in SCHEDULE]
    results, records = run_schedule(engine, configs)
    assert [tokens for tokens, _ in results] == alone
    assert max(r.batch_size for r in records) == 2


def test_step_records_add_up(target):
    engine = SpeculativeEngine(target, PromptLookupDrafter())
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=4, draft_length="fixed", eos_token_ids=())
    results, records = run_schedule(engine, [config] * 2, schedule=[(0, 20), (3, 20)])
    for request, (tokens, final) in enumerate(results):
        stats = final.stats
        assert stats.new_tokens == len(tokens) == 20
        assert stats.target_calls == sum(1 for r in records for rid, s in r.requests.items()
                                         if s.finish_reason != "cancelled" and rid == request)
    for record in records:
        assert record.total_time_s >= record.prefill_time_s + record.target_time_s - 1e-9
        assert record.verify_time_s >= record.target_time_s >= 0 and record.outside_model_time_s >= -1e-9
        for step in record.requests.values():
            assert step.accepted <= step.drafted
            assert len(step.new_tokens) <= step.accepted + 1
            assert step.accepted_per_position == [j < step.accepted for j in range(len(step.accepted_per_position))]
    assert records[0].joined == [0] and records[3].joined == [1]


# ------------------------------------------------------------------------------ sampling
def _sample_config(temperature, top_p=1.0, top_k=0, drafter=None, seed=None, n=6):
    return GenerationConfig(max_new_tokens=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            drafter=drafter, num_draft_tokens=3, draft_length="fixed", eos_token_ids=())


def test_seeded_request_is_the_same_whatever_shares_its_batch(target):
    """A seeded request alone, and in a batch with other requests (other settings, drafters, arrival
    times): the same tokens, for a deterministic drafter and for a sampling draft model."""
    drafters = {"lookup": PromptLookupDrafter(), "model": DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1)))}
    for name in drafters:
        engine = SpeculativeEngine(target, drafters=drafters)
        mine = _sample_config(0.8, top_p=0.95, drafter=name, seed=123, n=24)
        solo = engine.generate_ids([PROMPTS[0]], mine)[0].token_ids
        others = [_sample_config(1.2, drafter="lookup", n=30), _sample_config(0.0, drafter="model", n=9),
                  _sample_config(0.5, top_k=5, drafter="none", n=40)]
        results, _ = run_schedule(engine, [others[0], mine, others[1], others[2]],
                                  schedule=[(0, 30), (2, 24), (2, 9), (5, 40)],
                                  prompts=[PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2]])
        assert results[1][0] == solo, name


def test_seeded_sampling_with_a_deterministic_drafter_equals_plain_sampling(target):
    """Point-mass drafts are verified by the coupling (draw from the target with the position's uniform,
    keep the draft iff it equals the draw): the tokens are plain sampling's, whatever k or policy."""
    plain = SpeculativeEngine(target).generate_ids(PROMPTS[:3], _sample_config(0.9, seed=7, n=30))
    for drafter, k, policy in ((PromptLookupDrafter(), 4, "fixed"), (PromptLookupDrafter(num_candidates=3), 6, "fixed"),
                               (PromptLookupDrafter(), 8, "cost")):
        config = GenerationConfig(max_new_tokens=30, temperature=0.9, seed=7, num_draft_tokens=k, draft_length=policy,
                                  eos_token_ids=())
        speculative = SpeculativeEngine(target, drafter).generate_ids(PROMPTS[:3], config)
        assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
        if policy == "fixed":
            assert sum(r.stats.accepted_tokens for r in speculative) > 0


def _exact_law(model, prompt, length, temperature, top_k, top_p):
    """Exact joint law of ``length`` tokens under transformers' own warpers (not genspec's function)."""
    from tiny_models import exact_joint
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + [TopPLogitsWarper(top_p)])
    return exact_joint(model, prompt, length, lambda logits: torch.softmax(warpers(None, logits.double()), -1))


def test_lossless_sampling_in_a_batch_mixing_settings_and_drafters():
    """One batch (vocab 12, sharpened target) holding three groups of requests, each with its own
    temperature / top-k / top-p and drafter (a different draft model, prompt lookup as a 3-chain tree,
    none), plus greedy requests. Each group's joint law of its first 3 tokens is tested against its
    own exact law, built with transformers' warpers: N = 8,000 per group, cells with expected count
    < 5 pooled, fail if p < 1e-3."""
    vocab, length, n = 12, 3, 8_000
    model = peaked(tiny_llama(0, vocab=vocab, layers=3))
    target = HFCausalLM(peaked(tiny_llama(0, vocab=vocab, layers=3)))
    drafters = {"model": DraftModelDrafter(HFCausalLM(peaked(tiny_llama(1, vocab=vocab, layers=1)))),
                "tree": PromptLookupDrafter(num_candidates=3)}
    engine = SpeculativeEngine(target, drafters=drafters)
    groups = {  # name -> (prompt, temperature, top_k, top_p, drafter)
        "model": ([3, 5, 7], 0.7, 8, 0.9, "model"),
        "tree": ([6, 4, 6, 7, 6, 9, 6], 1.0, 0, 0.8, "tree"),
        "plain": ([2, 9], 0.5, 0, 1.0, "none"),
    }
    ids = {name: [] for name in groups}
    for i in range(n):  # interleaved, so that every step mixes the groups
        for name, (prompt, temperature, top_k, top_p, drafter) in groups.items():
            config = GenerationConfig(max_new_tokens=length, temperature=temperature, top_k=top_k, top_p=top_p,
                                      drafter=drafter, num_draft_tokens=2, draft_length="fixed", eos_token_ids=(),
                                      seed=1000 + i)
            ids[name].append(engine.add_request(prompt, config))
        if i % 400 == 0:
            engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=length, eos_token_ids=(), drafter="model"))
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for request_id, step in engine.step().requests.items():
            tokens.setdefault(request_id, []).extend(step.new_tokens)
    for name, (prompt, temperature, top_k, top_p, _) in groups.items():
        counts = torch.zeros([vocab] * length)
        for request_id in ids[name]:
            counts[tuple(tokens[request_id])] += 1
        exact = _exact_law(model, prompt, length, temperature, top_k, top_p)
        assert chi_square_pvalue(counts.numpy(), exact.numpy()) > 1e-3, name


# ------------------------------------------------------------------------------ bad requests
def test_bad_requests_are_refused_and_queue_nothing(target):
    engine = SpeculativeEngine(target, PromptLookupDrafter())
    with pytest.raises(ConfigError, match="unknown drafter 'nope'.*prompt-lookup"):
        engine.add_request([1, 2, 3], GenerationConfig(drafter="nope"))
    with pytest.raises(ConfigError, match="per-request option"):
        engine.add_request([1, 2, 3], GenerationConfig(drafter_options={"source": [1]}))
    with pytest.raises(ContextLengthError):
        engine.add_request(list(range(3, 60)) * 5, GenerationConfig())
    with pytest.raises(ConfigError, match="empty prompt"):
        engine.add_request([], GenerationConfig())
    assert engine.num_waiting == 0 and not engine.has_unfinished()
    with pytest.raises(ConfigError, match="max_batch_size"):
        SpeculativeEngine(target, max_batch_size=0)


def test_a_stream_left_early_frees_its_row(target):
    from tiny_models import byte_tokenizer

    tokenizer = byte_tokenizer()
    model = HFCausalLM(tiny_llama(0, vocab=len(tokenizer)), tokenizer)
    engine = SpeculativeEngine(model, PromptLookupDrafter())
    chunks = engine.stream("abcabcabc", max_new_tokens=40, eos_token_ids=())
    next(chunks)
    chunks.close()  # the reader stops: the request is cancelled, its row freed at once
    assert model.num_rows == 0 and engine.num_running == 0
    engine.step()  # the cancellation is reported, then nothing is left
    assert not engine.has_unfinished()
