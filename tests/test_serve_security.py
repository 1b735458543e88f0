"""genspec serve in the open: API keys, limits, rate limits, CORS, slow clients, the non-loopback refusal.

A tiny random-weight model with a byte tokenizer is served by uvicorn (with genspec's connection options,
:func:`genspec.serve.security.uvicorn_options`) in a thread of this process on 127.0.0.1; the tests talk
HTTP to it, with httpx and the real ``openai`` client.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

import genspec
from genspec.cli import main
from genspec.cli.serve import security_settings

from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.serve.app import create_app
from genspec.serve.settings import ServerSettings
from genspec.serve.security import ServeSecurity, TokenBucket, hash_key, is_loopback, uvicorn_options

from test_serve import _free_port, _Gate  # noqa: E402 - the server tests' loopback port and gate drafter

KEY, OTHER_KEY = "sk-test-0123456789", "sk-second-key"
PROMPT = "abcabcabc def def abc"

class Served:
    """A server with ``security`` in a thread on loopback: ``url``, ``app``, ``gate``, ``client(key)``."""

    def __init__(self, model_dir, security: ServeSecurity):
        target = genspec.load_model(str(model_dir))
        self.gate = _Gate()
        engine = SpeculativeEngine(target, PromptLookupDrafter(), max_batch_size=4, drafters={"gate": self.gate})
        self.app = create_app(engine, ServerSettings(served_model_name="tiny", max_queue=8, grace_s=5, security=security))
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error",
                                                   **uvicorn_options(security)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self):
        self.gate.release.set()
        self.server.should_exit = True
        self.thread.join(timeout=30)

@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    server = Served(tiny_model_dir, ServeSecurity.with_keys([KEY, OTHER_KEY], max_prompt_tokens=40, max_tokens=64,
                                                            max_n=3, max_stop_strings=2, max_stop_length=8,
                                                            max_streams_per_key=1, tokens_per_minute=100_000,
                                                            requests_per_minute=1000))
    yield server
    server.stop()

def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}

# ------------------------------------------------------------------------------ keys
def test_a_missing_or_wrong_key_is_401_on_every_v1_route_and_on_metrics(keyed):
    # every route the API documents (app.routes is no list of routes since FastAPI 0.137: an included router
    # is one node of it)
    routes = sorted({(method.upper(), path) for path, operations in keyed.app.openapi()["paths"].items()
                     if path.startswith("/v1") for method in operations})
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")} <= set(routes)
    body = json.dumps({"prompt": PROMPT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for method, path in [*routes, ("GET", "/metrics"), ("GET", "/v1/no-such-route"), ("DELETE", "/v1/models")]:
        for headers in ({}, _auth("sk-wrong"), _auth(KEY + "x"), {"Authorization": KEY},
                        {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer"}):
            response = httpx.request(method, keyed.url + path, content=body,
                                     headers={"Content-Type": "application/json", **headers})
            assert response.status_code == 401, (method, path, headers)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] and set(error) == {"message", "type", "param",
                                                                                          "code"}
            assert KEY not in response.text and OTHER_KEY not in response.text
            assert response.headers["www-authenticate"] == "Bearer"
    # open without a key: the health check and the playground page
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}
    assert httpx.get(keyed.url + "/").status_code == 200

def test_the_right_key_works_with_the_openai_client(keyed):
    for key in (KEY, OTHER_KEY):
        client = keyed.client(key)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        assert response.usage.completion_tokens == 6
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == response.choices[0].text
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        keyed.client("sk-wrong").models.list()
    metrics = httpx.get(keyed.url + "/metrics", headers=_auth(KEY))
    assert metrics.status_code == 200 and "genspec:request_failure_total" in metrics.text
    assert 'reason="unauthorized"' in metrics.text

def test_metrics_public_opens_metrics_only(tiny_model_dir):
    server = Served(tiny_model_dir, ServeSecurity.with_keys([KEY], metrics_public=True))
    try:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 401
    finally:
        server.stop()

def test_only_digests_of_the_keys_are_kept():
    settings = ServeSecurity.with_keys([KEY])
    assert settings.api_key_sha256 == (hash_key(KEY),) and KEY not in repr(settings)

# ------------------------------------------------------------------------------ limits
@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/completions", {"prompt": "x" * 41}, "prompt", "at most 40"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 41}]}, "messages", "at most 40"),
    ("/v1/completions", {"prompt": PROMPT, "n": 4}, "n", "at most 3"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 65}, "max_tokens", "at most 64"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 65},
     "max_tokens", "at most 64"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a", "b", "c"]}, "stop", "at most 2"),
    ("/v1/completions", {"prompt": PROMPT, "stop": "x" * 9}, "stop", "8 characters"),
])
def test_each_limit_answers_400_with_an_openai_error(keyed, path, body, param, fragment):
    response = httpx.post(keyed.url + path, json={"max_tokens": 4, **body}, headers=_auth(KEY))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "limit_exceeded" and fragment in error["message"]
    # just inside each limit is served
    inside = {"/v1/completions": {"prompt": "x" * 40, "n": 3, "max_tokens": 8, "stop": ["a", "b" * 8]},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8}}
    assert httpx.post(keyed.url + path, json=inside[path], headers=_auth(KEY)).status_code == 200

def test_a_chat_without_max_tokens_defaults_within_the_limit(keyed):
    response = keyed.client(KEY).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                                         temperature=0)
    assert response.usage.completion_tokens <= 64

def test_streams_per_key_past_the_limit_get_429_and_a_finished_or_abandoned_stream_frees_its_slot(keyed):
    """One stream per key: the first (held still by the gate drafter) takes the slot; a second stream with
    the same key gets 429 at once; a request that does not stream, and a stream with another key, are
    served; when the first ends, and when a client abandons a stream, the slot is free again."""
    gatekeeper = keyed.app.state.gatekeeper
    stream_body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    keyed.gate.entered.clear()
    keyed.gate.release.clear()
    first = []
    thread = threading.Thread(target=lambda: first.append(httpx.post(
        keyed.url + "/v1/completions", json={**stream_body, "speculative": {"drafter": "gate"}}, headers=_auth(KEY),
        timeout=60)))
    thread.start()
    try:
        assert keyed.gate.entered.wait(30)
        refused = httpx.post(keyed.url + "/v1/completions", json=stream_body, headers=_auth(KEY))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_streams"
        assert int(refused.headers["retry-after"]) >= 1
        others = [threading.Thread(target=lambda: first.append(httpx.post(
            keyed.url + "/v1/completions", json=stream_body, headers=_auth(OTHER_KEY), timeout=60))),
                  threading.Thread(target=lambda: first.append(httpx.post(
            keyed.url + "/v1/completions", json={**stream_body, "stream": False}, headers=_auth(KEY), timeout=60)))]
        for other in others:
            other.start()
        worker = keyed.app.state.server.worker
        deadline = time.time() + 30
        while worker.num_waiting < 2:  # both admitted and submitted, the engine still held by the gate
            assert time.time() < deadline and not first, [r.text for r in first]
            time.sleep(0.02)
        assert gatekeeper.open_streams("key-0") == gatekeeper.open_streams("key-1") == 1
    finally:
        keyed.gate.release.set()
    for other in [thread, *others]:
        other.join(60)
    assert [r.status_code for r in first] == [200] * 3
    assert sum(r.text.endswith("data: [DONE]\n\n") for r in first) == 2
    assert gatekeeper.open_streams("key-0") == gatekeeper.open_streams("key-1") == 0
    # a client that hangs up after the first chunk of a long stream: its slot is freed
    with httpx.stream("POST", keyed.url + "/v1/completions", headers=_auth(KEY),
                      json={**stream_body, "max_tokens": 64, "speculative": {"enabled": False}}) as raw:
        assert raw.status_code == 200
        next(line for line in raw.iter_lines() if line.startswith("data: "))
    deadline = time.time() + 10
    while gatekeeper.open_streams("key-0"):
        assert time.time() < deadline, "the abandoned stream kept its slot"
        time.sleep(0.05)
    assert httpx.post(keyed.url + "/v1/completions", json=stream_body, headers=_auth(KEY)).status_code == 200

def test_the_rate_limit_answers_429_with_retry_after_per_key(tiny_model_dir):
    """3 requests per minute: a key's first three are served, its fourth gets 429 with Retry-After (the
    bucket refills one request per 20 s, so about 20 s); another key is not affected."""
    server = Served(tiny_model_dir, ServeSecurity.with_keys([KEY, OTHER_KEY], requests_per_minute=3))
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    try:
        statuses = [httpx.post(server.url + "/v1/completions", json=body, headers=_auth(KEY)) for _ in range(4)]
        assert [r.status_code for r in statuses] == [200, 200, 200, 429]
        error = statuses[-1].json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "3 requests per minute per API key" in error["message"]
        assert 15 <= int(statuses[-1].headers["retry-after"]) <= 20
        with pytest.raises(openai.RateLimitError):
            server.client(KEY).completions.create(model="tiny", **body)
        assert httpx.post(server.url + "/v1/completions", json=body, headers=_auth(OTHER_KEY)).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers=_auth(KEY)).status_code == 200  # not rate limited
    finally:
        server.stop()

def test_the_token_rate_limit_counts_prompt_and_max_tokens(tiny_model_dir):
    """100 tokens per minute; each request may use 21 prompt + 30 completion tokens = 51 (charged when it is
    admitted): the first is served, the second gets 429 with Retry-After; one that could never fit is a
    400, not a 429 (retrying would not help)."""
    server = Served(tiny_model_dir, ServeSecurity.with_keys([KEY], tokens_per_minute=100))
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    try:
        assert len(server.app.state.server.encode(PROMPT)) == 21
        first = httpx.post(server.url + "/v1/completions", json=body, headers=_auth(KEY))
        second = httpx.post(server.url + "/v1/completions", json=body, headers=_auth(KEY))
        assert first.status_code == 200 and second.status_code == 429
        assert "100 tokens per minute" in second.json()["error"]["message"]
        assert 1 <= int(second.headers["retry-after"]) <= 60
        never = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 90}, headers=_auth(KEY))
        assert never.status_code == 400 and "per minute" in never.json()["error"]["message"]
    finally:
        server.stop()

def test_a_token_bucket_refills_evenly_over_a_minute():
    bucket = TokenBucket(60, now=0.0)
    assert bucket.wait(60) == 0
    bucket.level -= 60
    bucket.refill(now=10.0)
    assert bucket.level == pytest.approx(10) and bucket.wait(15) == pytest.approx(5.0)
    bucket.refill(now=1000.0)
    assert bucket.level == 60  # never above its capacity

def test_without_keys_limits_count_by_client_address(tiny_model_dir):
    """Without keys the limits count by the client's address, and their 429s say so (not "per API key")."""
    server = Served(tiny_model_dir, ServeSecurity(requests_per_minute=1, max_streams_per_key=1))
    try:
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
        refused = httpx.post(server.url + "/v1/completions", json=body)
        assert refused.status_code == 429
        message = refused.json()["error"]["message"]
        assert "1 requests per minute per client address" in message and "API key" not in message
    finally:
        server.stop()
    server = Served(tiny_model_dir, ServeSecurity(max_streams_per_key=1))
    stream_body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
                   "speculative": {"drafter": "gate"}}
    held = []
    thread = threading.Thread(target=lambda: held.append(httpx.post(server.url + "/v1/completions", json=stream_body,
                                                                     timeout=60)))
    try:
        server.gate.entered.clear()
        server.gate.release.clear()
        thread.start()
        assert server.gate.entered.wait(30)
        refused = httpx.post(server.url + "/v1/completions", json=stream_body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_streams"
        message = refused.json()["error"]["message"]
        assert "at most 1 per client address" in message and "API key" not in message
    finally:
        server.gate.release.set()
        thread.join(60)
        server.stop()
    assert [r.status_code for r in held] == [200]

# ------------------------------------------------------------------------------ CORS
def test_cors_is_off_by_default_and_allows_only_the_named_origins(keyed, tiny_model_dir):
    preflight = {"Origin": "https://play.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    response = httpx.options(keyed.url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers
    assert "access-control-allow-origin" not in httpx.get(keyed.url + "/v1/models", headers={
        "Origin": "https://play.example", **_auth(KEY)}).headers
    server = Served(tiny_model_dir, ServeSecurity.with_keys([KEY], allowed_origins=("https://play.example",)))
    try:
        response = httpx.options(server.url + "/v1/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://play.example"
        assert "authorization" in response.headers["access-control-allow-headers"].lower()
        other = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # a refused key still carries the header, so that the page can show the error
        refused = httpx.get(server.url + "/v1/models", headers={"Origin": "https://play.example"})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "https://play.example"
    finally:
        server.stop()

# ------------------------------------------------------------------------------ binding and the CLI
def _args(*argv) -> argparse.Namespace:
    from genspec.cli import build_parser

    return build_parser().parse_args(["serve", *argv])

def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.1"))

def test_a_non_loopback_bind_without_a_key_refuses_before_loading_anything(capsys, tmp_path):
    assert main(["serve", "--host", "0.0.0.0", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--insecure-no-api-key" in err and "Traceback" not in err
    assert main(["serve", "--backend", "ray", "--host", "0.0.0.0"]) == 2
    assert "API key" in capsys.readouterr().err

def test_a_non_loopback_bind_with_a_key_or_the_insecure_flag(capsys):
    settings = security_settings(_args("--host", "0.0.0.0", "--api-key", KEY), environ={})
    assert settings.api_key_sha256 == (hash_key(KEY),) and capsys.readouterr().err == ""
    settings = security_settings(_args("--host", "0.0.0.0"), environ={"GENSPEC_API_KEY": OTHER_KEY})
    assert settings.api_key_sha256 == (hash_key(OTHER_KEY),)
    settings = security_settings(_args("--host", "0.0.0.0", "--insecure-no-api-key"), environ={})
    assert settings.api_key_sha256 == ()
    err = capsys.readouterr().err
    assert err.startswith("genspec: warning:") and "without an API key" in err and err.count("\n") == 1
    assert security_settings(_args(), environ={}).api_key_sha256 == ()  # loopback: no key needed
    with pytest.raises(ConfigError, match="no spaces"):
        security_settings(_args("--api-key", "two words"), environ={})
    with pytest.raises(ConfigError, match="max_n must be >= 0"):
        security_settings(_args("--max-n", "-1"), environ={})

def test_the_cli_serves_with_a_key_and_bounds_slow_clients(tiny_model_dir):
    """`genspec serve` as a process, its key from $GENSPEC_API_KEY: 401 without it, 200 with it. A connection
    that never sends, and one that sends half a body, are closed by the server (keep-alive 1 s, read timeout
    2 s) while a normal request is served meanwhile."""
    import os

    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "genspec", "serve", "--model", str(tiny_model_dir), "--port",
                                str(port), "--no-cost-measurement", "--keep-alive", "1", "--read-timeout", "2"],
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "GENSPEC_API_KEY": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.time() < deadline
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        idle = socket.create_connection(("127.0.0.1", port))
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        opened = time.monotonic()
        response = httpx.post(url + "/v1/completions", headers=_auth(KEY), timeout=60,
                              json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        for connection in (idle, half):
            connection.settimeout(30)
            assert connection.recv(1024) == b""  # closed by the server (recv would block while it is open)
            connection.close()
        assert time.monotonic() - opened < 15
    finally:
        process.terminate()
        process.wait(timeout=60)

def test_past_max_connections_uvicorn_answers_503(tiny_model_dir):
    server = Served(tiny_model_dir, ServeSecurity(max_connections=2))
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    try:
        time.sleep(0.2)  # the server has accepted them
        assert httpx.get(server.url + "/health").status_code == 503
        for connection in idle:
            connection.close()
        deadline = time.time() + 10
        while httpx.get(server.url + "/health").status_code != 200:
            assert time.time() < deadline, "the closed connections still count"
            time.sleep(0.1)
    finally:
        server.stop()
