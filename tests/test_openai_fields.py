"""OpenAI's sampling and output fields, from the sampling functions to ``genspec serve`` through the ``openai``
client: ``logit_bias``, ``presence_penalty`` / ``frequency_penalty`` (applied identically to draft and target, so
speculation stays lossless), ``logprobs`` / ``top_logprobs`` (the target's), ``echo``; fields the server does not
honour are refused with a 400 naming them, request types are strict, and the stop-string limit is the server's.

The lossless test builds its expected law by hand (the penalties written out below, not through
:class:`~genspec.sampling.TokenHistory`), so a wrong history or a wrong formula in the engine fails it.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from stats_helpers import chi_square_pvalue
from test_serve import PROMPT, Served
from tiny_models import peaked, tiny_llama

from genspec.drafters.draft_model import DraftModelDrafter
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig, TokenHistory, adjust_logits, process_logits

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, logit_bias={2: 1.5, 4: -100.0})


# ------------------------------------------------------------------------------ the processing
def _by_hand(logits: torch.Tensor, output: list[int], presence: float, frequency: float, bias: dict) -> torch.Tensor:
    """OpenAI's formula, one row: bias added, then ``presence * (c > 0) + frequency * c`` taken off."""
    out = logits.clone()
    for token, amount in bias.items():
        out[token] += amount
    for token in set(output):
        count = output.count(token)
        out[token] -= presence * (count > 0) + frequency * count
    return out


def test_bias_and_penalties_follow_openais_formula_and_leave_other_rows_alone():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 11, generator=generator, dtype=torch.float64)
    prompts, outputs = [[1, 2], [5], [7, 7]], [[2, 2, 3], [], [9, 1, 9, 9]]
    rows = [SamplingConfig(temperature=1.0, **PENALTIES), SamplingConfig(temperature=1.0),
            SamplingConfig(temperature=0.5, frequency_penalty=-1.0)]
    history = TokenHistory.of([p + o for p, o in zip(prompts, outputs)], [len(p) for p in prompts], rows, 11)
    adjusted = adjust_logits(logits, rows, history)
    assert torch.allclose(adjusted[0], _by_hand(logits[0], outputs[0], 0.8, 0.6, PENALTIES["logit_bias"]))
    assert torch.equal(adjusted[1], logits[1])  # nothing set: bit for bit
    assert torch.allclose(adjusted[2], _by_hand(logits[2], outputs[2], 0.0, -1.0, {}))
    assert not torch.allclose(adjusted[0], logits[0])  # not vacuous: the first row really moved
    # the prompt is not the output: row 0's prompt holds token 1, which keeps its logit
    assert adjusted[0, 1] == logits[0, 1]


def test_a_blocks_history_at_each_position_is_the_sequence_up_to_it():
    """``TokenHistory.along``: position i of a chain block counts block tokens 1..i, as if each were generated."""
    rows = [SamplingConfig(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)] * 2
    sequences, prompt_lengths = [[4, 4, 6, 2], [1, 3]], [2, 1]
    block = torch.tensor([[2, 6, 6, 5], [3, 3, 0, 1]])  # token 0 is each sequence's last
    along = TokenHistory.of(sequences, prompt_lengths, rows, 9).along(block)
    for r, sequence in enumerate(sequences):
        for i in range(block.shape[1]):
            own = TokenHistory.of([sequence + block[r, 1:i + 1].tolist()], [prompt_lengths[r]], rows[:1], 9)
            assert torch.equal(along.seen[r, i], own.seen[0]) and torch.equal(along.counts[r, i], own.counts[0])


@pytest.mark.parametrize("settings, fragment", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={3: 101}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(top_p=-0.1), "top_p"),
])
def test_out_of_range_settings_are_refused(settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        SamplingConfig(temperature=1.0, **settings)


def test_top_p_zero_keeps_the_most_likely_token_only():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    assert SamplingConfig(temperature=0.9, top_p=0.0).greedy
    law = process_logits(logits, SamplingConfig(temperature=0.9, top_p=0.0))
    assert torch.equal(law.argmax(-1), logits.argmax(-1)) and torch.equal(law.sum(-1), torch.ones(4))


# ------------------------------------------------------------------------------ the engine
def _exact_penalised_joint(model, prompt: list[int], length: int, sampling: SamplingConfig) -> torch.Tensor:
    """The exact law of the next ``length`` tokens with the penalties and bias applied by hand at each prefix."""
    vocab = model.config.vocab_size
    plain = SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    joint = torch.zeros([vocab] * length, dtype=torch.float64)

    def walk(prefix: list[int], mass: float):
        if len(prefix) == length:
            joint[tuple(prefix)] = mass
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1].double()
        adjusted = _by_hand(logits, prefix, sampling.presence_penalty, sampling.frequency_penalty,
                            dict(sampling.logit_bias))
        law = process_logits(adjusted.unsqueeze(0), plain)[0]
        for token in range(vocab):
            if law[token] > 0:
                walk(prefix + [token], mass * float(law[token]))

    walk([], 1.0)
    return joint


def test_sampling_with_bias_and_penalties_is_lossless():
    """Chi-square of the joint law of 3 generated tokens against the exact penalised target law (temperature 0.8,
    top-k 8, presence 0.8, frequency 0.6, token 2 +1.5, token 4 banned), drafted by an unlike draft model with the
    same processing. N = 20,000 samples, cells with expected count < 5 pooled; fail if p < 1e-3."""
    sampling = SamplingConfig(temperature=0.8, top_k=8, **PENALTIES)
    reference = peaked(tiny_llama(0, vocab=12))
    target = HFCausalLM(peaked(tiny_llama(0, vocab=12)))
    draft = HFCausalLM(peaked(tiny_llama(1, vocab=12, layers=1)))
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    prompt = [3, 5, 7]
    results = engine.generate_ids([prompt] * 20_000, max_new_tokens=3, num_draft_tokens=2, temperature=0.8, top_k=8,
                                  seed=17, eos_token_ids=(), draft_length="fixed", rule="overaccept", **PENALTIES)
    counts = torch.zeros([12] * 3)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    exact = _exact_penalised_joint(reference, prompt, 3, sampling)
    unpenalised = _exact_penalised_joint(reference, prompt, 3, SamplingConfig(temperature=0.8, top_k=8))
    assert 0.5 * float((exact - unpenalised).abs().sum()) > 0.05  # the settings really change the law
    assert counts[:, :, 4].sum() == counts[:, 4].sum() == counts[4].sum() == 0  # the banned token never comes
    acceptance = sum(r.stats.accepted_tokens for r in results) / sum(r.stats.drafted_tokens for r in results)
    assert 0.05 < acceptance < 0.95  # rejections really happen
    assert chi_square_pvalue(counts.numpy(), exact.numpy()) > 1e-3


@pytest.mark.parametrize("make_drafter", [lambda: PromptLookupDrafter(max_ngram=2),
                                          lambda: DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1)))],
                         ids=["prompt-lookup", "draft-model"])
def test_greedy_with_bias_and_penalties_equals_plain_decoding(make_drafter):
    target = HFCausalLM(tiny_llama(0))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9], [1, 2, 3, 4, 1, 2]]
    settings = dict(max_new_tokens=24, eos_token_ids=(), presence_penalty=0.4, frequency_penalty=0.7,
                    repetition_penalty=1.1, logit_bias={5: 2.0, 6: -100.0})
    plain = SpeculativeEngine(target).generate_ids(prompts, **settings)
    unpenalised = SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())
    engine = SpeculativeEngine(target, make_drafter())
    speculative = engine.generate_ids(prompts, num_draft_tokens=4, **settings)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert all(6 not in r.token_ids for r in plain)
    assert [r.token_ids for r in plain] != [r.token_ids for r in unpenalised]  # the settings change the text
    alone = [engine.generate_ids([p], num_draft_tokens=4, **settings)[0].token_ids for p in prompts]
    assert alone == [r.token_ids for r in plain]  # batched or alone


def test_a_logit_bias_outside_the_vocabulary_is_refused():
    engine = SpeculativeEngine(HFCausalLM(tiny_llama(0)))
    with pytest.raises(ConfigError, match="vocabulary"):
        engine.generate_ids([[1, 2]], max_new_tokens=2, logit_bias={10_000: 1.0})


def test_logprobs_are_the_targets_and_the_same_with_speculation():
    """Each kept token's log-probability is the log-softmax of the target's logits after its prefix (recomputed
    here with the model itself), drafted or not, with the top alternatives sorted and the argmax first."""
    model = tiny_llama(0)
    target = HFCausalLM(model)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    plain = SpeculativeEngine(target).generate_ids([prompt], max_new_tokens=12, eos_token_ids=(), logprobs=3)[0]
    speculative = SpeculativeEngine(target, PromptLookupDrafter(max_ngram=2)).generate_ids(
        [prompt], max_new_tokens=12, eos_token_ids=(), logprobs=3, num_draft_tokens=4)[0]
    assert speculative.stats.accepted_tokens > 0  # some tokens came from accepted drafts
    assert speculative.token_ids == plain.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + plain.token_ids])).logits[0, len(prompt) - 1:-1].double()
    expected = logits.log_softmax(-1)
    for j, (token, ours, theirs) in enumerate(zip(plain.token_ids, plain.logprobs, speculative.logprobs)):
        assert ours.token == theirs.token == token
        assert ours.logprob == pytest.approx(float(expected[j, token]), abs=1e-6)
        assert theirs.logprob == pytest.approx(ours.logprob, abs=1e-6)
        assert [t for t, _ in ours.top] == expected[j].topk(3).indices.tolist() and ours.top[0][0] == token
    none = SpeculativeEngine(target).generate_ids([prompt], max_new_tokens=3)[0]
    assert none.logprobs is None
    alone = SpeculativeEngine(target).generate_ids([prompt], max_new_tokens=3, logprobs=0)[0]
    assert [lp.top for lp in alone.logprobs] == [(), (), ()]


# ------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def served(tiny_model_dir):
    server = Served(tiny_model_dir)
    yield server
    server.stop()


OFF = {"speculative": {"enabled": False}}


def _both(call):
    """A call's response with speculation on (the server's default drafter) and off."""
    return call({}), call(OFF)


def test_logprobs_through_the_openai_client(served):
    on, off = _both(lambda extra: served.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, extra_body=extra))
    for response in (on, off):
        logprobs = response.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 12
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
        assert logprobs.text_offset[-1] < len(response.choices[0].text)
        for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert value <= 0 and token in top and len(top) >= 2 and max(top.values()) == pytest.approx(value)
    assert on.choices[0].text == off.choices[0].text
    assert on.choices[0].logprobs.token_logprobs == pytest.approx(off.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert on.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0
    zero = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    assert len(zero.choices[0].logprobs.token_logprobs) == 3  # logprobs 0: the tokens' own, no alternatives
    assert all(len(top) == 1 for top in zero.choices[0].logprobs.top_logprobs)


def test_chat_logprobs_and_top_logprobs(served):
    on, off = _both(lambda extra: served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "abc abc"}], max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3, extra_body=extra))
    for response in (on, off):
        content = response.choices[0].logprobs.content
        assert len(content) == 8
        for c in content:
            assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
            assert bytes(c.bytes).decode("utf-8") == c.token
    assert on.choices[0].message.content == off.choices[0].message.content
    streamed = served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc abc"}],
                                                     max_tokens=8, temperature=0, logprobs=True, stream=True)
    tokens = [c.token for chunk in streamed for choice in chunk.choices if choice.logprobs
              for c in choice.logprobs.content]
    assert tokens == [c.token for c in on.choices[0].logprobs.content]


def test_echo_returns_the_prompt_before_the_completion(served):
    on, off = _both(lambda extra: served.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, extra_body=extra))
    plain = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert on.choices[0].text == off.choices[0].text == PROMPT + plain.choices[0].text
    streamed = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                                echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == on.choices[0].text


def test_logit_bias_and_penalties_through_the_openai_client(served):
    plain = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    first = served.engine.tokenizer(plain.choices[0].text, add_special_tokens=False)["input_ids"][0]
    banned, banned_off = _both(lambda extra: served.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logit_bias={str(first): -100}, extra_body=extra))
    assert banned.choices[0].text == banned_off.choices[0].text != plain.choices[0].text
    assert first not in served.engine.tokenizer(banned.choices[0].text, add_special_tokens=False)["input_ids"]
    penalised, penalised_off = _both(lambda extra: served.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, presence_penalty=1.5, frequency_penalty=1.0,
        extra_body=extra))
    assert penalised.choices[0].text == penalised_off.choices[0].text != plain.choices[0].text
    chat, chat_off = _both(lambda extra: served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
        frequency_penalty=2.0, logit_bias={str(first): 5}, extra_body=extra))
    assert chat.choices[0].message.content == chat_off.choices[0].message.content


def _post(served, route: str, body: dict) -> httpx.Response:
    base = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(served.url + route, json={**base, "max_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"min_p": 0.1}, "min_p"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 150}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"999999": 1}}, None),  # outside the vocabulary: the engine says so
])
def test_fields_that_are_not_honoured_are_refused_naming_them(served, route, body, param):
    response = _post(served, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    if param is None:
        assert "vocabulary" in error["message"]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"best_of": 1, "user": "me", "suffix": None}),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                              "parallel_tool_calls": True, "store": False, "metadata": {"a": "b"}}),
])
def test_neutral_values_of_those_fields_are_accepted(served, route, body):
    assert _post(served, route, body).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"prompt": [True, False]}, "prompt"), ({"max_tokens": "8"}, "max_tokens"), ({"max_tokens": 8.0}, "max_tokens"),
    ({"speculative": {"enabled": "no"}}, "speculative.enabled"), ({"prompt": [2, 818.0]}, "prompt"),
    ({"stream": 1}, "stream"), ({"n": True}, "n"), ({"seed": "5"}, "seed"),
])
def test_request_types_are_strict(served, body, param):
    response = httpx.post(served.url + "/v1/completions", content=json.dumps({"prompt": PROMPT, **body}),
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_top_p_zero_is_greedy(served):
    greedy = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    nucleus = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, top_p=0)
    assert nucleus.choices[0].text == greedy.choices[0].text


def test_the_stop_string_limit_is_the_servers(tiny_model_dir):
    """The default limit (4) answers ``limit_exceeded``; ``max_stop_strings`` 10 takes 5 stop strings."""
    from genspec.serve.security import ServeSecurity
    from test_serve_security import Served as Limited

    stops = ["zq1", "zq2", "zq3", "zq4", "zq5"]
    default = Limited(tiny_model_dir, ServeSecurity())
    try:
        response = httpx.post(default.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stop": stops})
        assert response.status_code == 400 and response.json()["error"]["code"] == "limit_exceeded"
        assert response.json()["error"]["param"] == "stop"
    finally:
        default.stop()
    wider = Limited(tiny_model_dir, ServeSecurity(max_stop_strings=10))
    try:
        client = openai.OpenAI(base_url=wider.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stop=stops).choices[0].text is not None
    finally:
        wider.stop()
