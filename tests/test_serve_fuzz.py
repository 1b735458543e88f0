"""Schemathesis against genspec serve's own OpenAPI schema, over loopback: requests generated from the schema
(valid ones, and invalid ones: wrong types, missing fields, bodies that are not JSON) to
``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``. No answer may be a 5xx; every error body
is OpenAI-shaped; afterwards the server still answers a normal request and holds no engine rows.

The default run is bounded (20 cases per operation and mode, derandomized: the same cases every run, about
25 s on a 2-core CPU); ``-m slow`` runs 300 random ones per operation and mode.
"""
from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from test_serve_security import PROMPT, Served

from genspec.serve.security import ServeSecurity

OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET")]


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir):
    # no rate limits (the fuzzer sends hundreds of requests a minute); at most 16 generated tokens a request,
    # so that valid cases stay quick on the tiny model
    server = Served(tiny_model_dir, ServeSecurity(max_tokens=16, requests_per_minute=0, tokens_per_minute=0))
    yield server
    server.stop()


def _fuzz(server, examples: int, derandomize: bool) -> collections.Counter:
    """Runs the cases; returns their count by (path, mode, status). Fails on a 5xx or a malformed error."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    counts: collections.Counter = collections.Counter()
    for path, method in OPERATIONS:
        operation = schema[path][method]
        if method == "POST":  # what the fuzzer can generate is what the schema declares
            assert operation.body, f"the OpenAPI schema does not declare the request body of {method} {path}"
        # GET /v1/models takes no input: nothing invalid can be made of it
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if method == "POST" else [])
        for mode in modes:
            @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=server.url, timeout=60)
                counts[(path, mode.value, response.status_code)] += 1
                where = f"{method} {path} with {case.body!r:.300}: {response.status_code} {response.text[:300]}"
                assert response.status_code < 500, where
                if response.status_code >= 400:
                    try:
                        error = response.json()["error"]
                    except (ValueError, KeyError, TypeError):
                        pytest.fail(f"not an OpenAI error body: {where}")
                    assert set(error) == {"message", "type", "param", "code"}, where
                    assert isinstance(error["message"], str) and error["message"], where

            run()
    return counts


def _still_serves(server) -> None:
    response = server.client("none").completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert response.usage.completion_tokens == 4
    worker = server.app.state.server.worker
    assert worker.num_running == 0 and worker.num_waiting == 0


def _check(counts: collections.Counter, examples: int, generated: int) -> None:
    """No 5xx; the invalid cases were sent; at least ``generated`` valid ones generated text (the schema
    admits more than the server serves, e.g. ``logprobs``, so most valid-by-schema cases get a 400)."""
    total = sum(counts.values())
    print(f"schemathesis: {total} cases, by (path, mode, status): {dict(sorted(counts.items()))}")
    assert not any(status >= 500 for _, _, status in counts)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert sum(n for (p, mode, status), n in counts.items() if p == path and mode == "negative") >= examples // 2
    assert sum(n for (p, mode, status), n in counts.items() if p != "/v1/models" and status == 200) >= generated
    assert total >= 2 * examples


def test_fuzzing_the_api_finds_no_server_error(fuzzed):
    _check(_fuzz(fuzzed, examples=20, derandomize=True), examples=20, generated=1)
    _still_serves(fuzzed)


@pytest.mark.slow
def test_fuzzing_the_api_longer(fuzzed):
    _check(_fuzz(fuzzed, examples=300, derandomize=False), examples=300, generated=10)
    _still_serves(fuzzed)
