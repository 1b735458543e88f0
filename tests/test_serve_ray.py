"""``genspec serve --backend ray``: the OpenAI app behind Ray Serve, on a local Ray instance the test
starts (loopback, 2 replicas of a tiny model, stopped at the end). Skipped without the ``ray`` extra."""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import httpx
import pytest

from genspec.cli import main
from genspec.serve.ray_backend import ENGINE_DEPLOYMENT, REPLICA_HEADER, threads_per_replica
from genspec.serve.security import ServeSecurity, hash_key
from genspec.serve.settings import ServerSettings
from tiny_models import save_tiny_model

#: the ray_service's API key
KEY = "sk-ray-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_threads_per_replica_share_the_cores():
    assert threads_per_replica(2, 2) == 1
    assert threads_per_replica(8, 3) == 2
    assert threads_per_replica(2, 4) == 1  # never 0
    assert threads_per_replica(16, 1) == 16


def test_without_ray_the_flag_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["serve", "--backend", "ray", "--replicas", "2"]) == 2
    assert "pip install 'genspec[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, fragment", [(["--replicas", "0"], "--replicas must be >= 1"),
                                            (["--replicas", "two"], "number or auto"),
                                            (["--replicas", "auto", "--min-replicas", "3", "--max-replicas", "2"],
                                             "min <= max")])
def test_bad_replica_settings(flags, fragment, capsys):
    assert main(["serve", "--backend", "ray", *flags]) == 2
    assert fragment in capsys.readouterr().err


def test_a_missing_model_is_a_one_line_error_before_ray_starts(tmp_path, capsys):
    assert main(["serve", "--backend", "ray", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no model at" in err and "Traceback" not in err


def _run(coroutine):
    return asyncio.run(coroutine)


def test_asgi_exchange_runs_a_request_through_the_app_and_a_close_cancels_it(tiny_model_dir):
    """What an engine replica does with a request the router passes on: the real app, in process."""
    import genspec
    from genspec.serve.app import create_app
    from genspec.serve.ray_backend import asgi_exchange
    from genspec.serve.settings import ServerSettings

    engine = genspec.load(str(tiny_model_dir), drafter="prompt-lookup")
    app = create_app(engine, ServerSettings(served_model_name="tiny"), engine_thread=True)
    app.state.server.worker.start()  # what the app's lifespan does; the exchange runs no lifespan
    expected = genspec.load(str(tiny_model_dir), drafter="none").generate("abc abd", max_new_tokens=12)[0].text

    def request(body: dict) -> dict:
        return {"method": "POST", "path": "/v1/completions", "query_string": b"",
                "headers": [(b"content-type", b"application/json")], "body": json.dumps(body).encode()}

    async def whole(body):
        messages = [m async for m in asgi_exchange(app, request(body), [(b"x-extra", b"1")])]
        return messages[0], b"".join(m.get("body", b"") for m in messages[1:])

    async def exchanges():  # one event loop for all, as in a replica
        start, content = await whole({"prompt": "abc abd", "max_tokens": 12, "temperature": 0})
        assert start["status"] == 200 and (b"x-extra", b"1") in start["headers"]
        assert json.loads(content)["choices"][0]["text"] == expected
        start, content = await whole({"prompt": "abc", "max_tokens": 0})
        assert start["status"] == 400 and "max_tokens" in json.loads(content)["error"]["message"]

        # read two chunks of a long stream, then go away: its row is freed
        exchange = asgi_exchange(app, request({"prompt": "abc", "max_tokens": 200, "stream": True}))
        assert (await anext(exchange))["status"] == 200
        await anext(exchange)
        assert engine.num_running == 1
        await exchange.aclose()
        deadline = time.time() + 10
        while engine.num_running or app.state.server.worker.num_waiting:
            assert time.time() < deadline, "the abandoned stream still runs"
            await asyncio.sleep(0.05)

    _run(exchanges())
    app.state.server.worker.drain(1.0)


class _FakeStream:
    """What ``handle.options(stream=True).http.remote(...)`` returns: messages, then maybe a failure."""

    def __init__(self, messages, failure=None):
        self.messages, self.failure, self.cancelled = list(messages), failure, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.messages:
            return self.messages.pop(0)
        if self.failure is not None:
            raise self.failure
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class _FakeEngines:
    def __init__(self, stream, metrics=b"# TYPE genspec:x counter\ngenspec:x_total 1.0\n"):
        self.stream, self.http, self.metrics = stream, self, metrics

    def broadcast(self, method):
        assert method == "replica_metrics"
        return self

    async def results_async(self):
        return [self.metrics, self.metrics]

    def options(self, stream):
        return self

    def remote(self, request):
        self.request = request
        return self.stream


def _route(stream, path="/v1/completions", read=None, engines=None, **options):
    """Call the router over a fake engine deployment; returns (status, headers, body chunks read)."""
    pytest.importorskip("ray")
    from starlette.requests import Request

    from genspec.serve.ray_backend import router_class

    router = router_class()(engines or _FakeEngines(stream), **options)
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": [], "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def call():
        response = await router(Request(scope, receive))
        chunks = []
        if hasattr(response, "body_iterator"):
            async for chunk in response.body_iterator:
                chunks.append(chunk if isinstance(chunk, bytes) else chunk.encode())
                if read is not None and len(chunks) == read:
                    await response.body_iterator.aclose()
                    break
        else:
            chunks.append(response.body)
        return response.status_code, response.raw_headers, chunks

    return _run(call())


def test_the_router_passes_responses_through_unchanged():
    start = {"type": "http.response.start", "status": 201,
             "headers": [(b"content-type", b"application/json"), (b"x-genspec-replica", b"abc")]}
    stream = _FakeStream([start, {"type": "http.response.body", "body": b'{"a":', "more_body": True},
                          {"type": "http.response.body", "body": b"1}"}])
    status, headers, chunks = _route(stream)
    assert status == 201 and headers == start["headers"] and b"".join(chunks) == b'{"a":1}'
    assert not stream.cancelled


def test_the_router_turns_a_replica_failure_into_an_openai_error():
    import ray.exceptions

    # before anything was sent: 503 and an error body
    status, _, chunks = _route(_FakeStream([], ray.exceptions.ActorDiedError()))
    error = json.loads(b"".join(chunks))["error"]
    assert status == 503 and error["code"] == "replica_failed" and "ActorDiedError" in error["message"]
    # in the middle of a stream: an error event ends it
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    status, _, chunks = _route(_FakeStream([start, chunk], ray.exceptions.ActorUnavailableError("gone", None)))
    assert status == 200 and chunks[0] == b"data: {}\n\n"
    assert chunks[-1].startswith(b"data: ") and json.loads(chunks[-1][6:])["error"]["code"] == "replica_failed"


def test_the_router_refuses_a_body_over_the_limit_without_passing_it_on():
    engines = _FakeEngines(_FakeStream([]))
    status, _, chunks = _route(None, engines=engines, settings=ServerSettings(max_body_bytes=1))  # the body is b"{}"
    assert status == 413 and json.loads(b"".join(chunks))["error"]["code"] == "request_too_large"
    assert not hasattr(engines, "request")


def test_the_router_asks_for_the_key_before_passing_a_request_on():
    """The router answers /metrics (every replica's, summed) and passes /v1/* on: with keys, both need
    one, and a request without it never reaches a replica. The replicas get the same settings (the
    ray_service test shows the service refusing)."""
    pytest.importorskip("ray")
    from starlette.requests import Request

    from genspec.serve.ray_backend import router_class

    def scrape(security, headers, path="/metrics"):
        router = router_class()(_FakeEngines(_FakeStream([])), ServerSettings(security=security or ServeSecurity()))
        scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 5000)}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        response = _run(router(Request(scope, receive)))
        return response.status_code, response.body

    keyed = ServeSecurity.with_keys([KEY])
    for headers in ([], [(b"authorization", b"Bearer wrong")]):
        status, body = scrape(keyed, headers)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, body = scrape(keyed, [(b"authorization", f"Bearer {KEY}".encode())])
    assert status == 200 and b"genspec:x_total 2.0" in body
    assert scrape(ServeSecurity.with_keys([KEY], metrics_public=True), [])[0] == 200
    assert scrape(None, [])[0] == 200
    status, body = scrape(keyed, [], path="/v1/models")  # the fake replica would fail the test if asked
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_the_cli_passes_the_key_and_limits_to_the_ray_deployment(monkeypatch):
    """`genspec serve --backend ray --api-key K --max-n 2`: the settings every replica is built with (and the
    router) carry the key's digest and the limits; Ray itself is not started."""
    pytest.importorskip("ray")
    import genspec.serve.ray_backend as ray_backend

    seen = {}
    monkeypatch.setattr(ray_backend, "run_ray", lambda settings, *rest: seen.update(settings=settings))
    assert main(["serve", "--backend", "ray", "--api-key", KEY, "--max-n", "2", "--metrics-public"]) == 0
    security = seen["settings"].security
    assert security.api_key_sha256 == (hash_key(KEY),) and security.max_n == 2 and security.metrics_public


def test_a_client_leaving_the_router_cancels_the_request_on_its_replica():
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    chunks = [{"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}] * 5
    stream = _FakeStream([start, *chunks])
    _route(stream, read=2)
    assert stream.cancelled


@pytest.fixture(scope="module")
def ray_service(tmp_path_factory):
    """Two engine replicas of a tiny model (context 8192, so that a request can run for seconds) behind
    the router, on a local Ray instance on loopback; shut down after the module. Yields the base URL."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from genspec.serve.ray_backend import deployment

    model = save_tiny_model(tmp_path_factory.mktemp("ray") / "tiny", context=8192)
    port = _free_port()
    settings = ServerSettings(model=str(model), max_batch_size=4, max_queue=8, grace_s=5.0, max_body_bytes=1 << 20,
                              served_model_name="tiny", measure_costs=False, security=ServeSecurity.with_keys([KEY]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(settings, replicas=2, cores=2), name="genspec", route_prefix="/")
        yield f"http://127.0.0.1:{port}", model
    finally:
        serve.shutdown()
        ray.shutdown()


def _engine_replicas() -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::genspec#{ENGINE_DEPLOYMENT}#")}


def _kill(replica_id: str) -> None:
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::genspec#{ENGINE_DEPLOYMENT}#{replica_id}", namespace="serve"),
             no_restart=True)


def test_two_replicas_serve_completions_and_streams(ray_service):
    """Smoke test: two replicas behind Ray Serve on loopback answer completions and streams through the
    openai client, greedy output equal to the engine's own, errors as JSON, /metrics summed over both."""
    import openai

    import genspec

    url, model = ray_service
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompt = "abc abc abc abd abc"
    expected = genspec.load(str(model), drafter="none").generate(prompt, max_new_tokens=24)[0].text

    def counters():
        text = httpx.get(f"{url}/metrics", timeout=30, headers=AUTH).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}

    before = counters()
    served_by = set()
    for _ in range(4):  # several requests, whichever replica takes each
        response = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=24,
                                                               temperature=0)
        served_by.add(response.headers[REPLICA_HEADER])
        assert response.parse().choices[0].text == expected
    assert served_by <= {name.rsplit("#", 1)[1] for name in _engine_replicas()}
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    with pytest.raises(openai.BadRequestError, match="no-such-drafter"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                  extra_body={"speculative": {"drafter": "no-such-drafter"}})
    assert httpx.get(f"{url}/v1/models", timeout=30, headers=AUTH).json()["data"][0]["id"] == "tiny"
    # every replica and the router ask for the key
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt=prompt, max_tokens=2)

    # /metrics (one scrape) counts the whole service: 5 requests x 24 tokens, whichever replica ran them
    after = counters()
    key = "genspec:generation_tokens_total"
    assert after[key] - before.get(key, 0) == 5 * 24
    key = 'genspec:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 5


def test_a_dying_replica_fails_only_its_requests_with_a_clear_error(ray_service):
    """Two long streams on different replicas; one replica's process is killed: its stream ends with an
    OpenAI error event (code replica_failed), the other stream finishes, new requests are answered, and
    Serve starts a replacement replica."""
    url, _ = ray_service
    body = {"prompt": "abc", "max_tokens": 3000, "temperature": 0, "stream": True,
            "speculative": {"enabled": False}}  # about 4 s of decoding on one thread

    def open_stream():
        stream = httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120, headers=AUTH)
        response = stream.__enter__()
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        return stream, response, lines

    first = open_stream()
    victim = first[1].headers[REPLICA_HEADER]
    others = []
    for _ in range(4):  # Serve sends a request to the less busy of the two replicas: the other one
        others.append(open_stream())
        if others[-1][1].headers[REPLICA_HEADER] != victim:
            break
    survivor = others[-1]
    assert survivor[1].headers[REPLICA_HEADER] != victim
    before = _engine_replicas()
    _kill(victim)

    def rest(lines) -> list[dict]:
        return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]

    failed = rest(first[2])
    assert failed[-1]["error"]["code"] == "replica_failed"
    assert "replica serving this request stopped" in failed[-1]["error"]["message"]
    finished = rest(survivor[2])
    assert finished[-1]["choices"][0]["finish_reason"] == "length"
    for stream, *_ in [first, *others]:
        stream.__exit__(None, None, None)

    # the service keeps answering (on the surviving replica, then the replacement too)
    for _ in range(4):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0},
                              timeout=60, headers=AUTH)
        assert response.status_code == 200 and response.headers[REPLICA_HEADER] != victim
    deadline = time.time() + 60
    while not (len(_engine_replicas()) == 2 and f"SERVE_REPLICA::genspec#{ENGINE_DEPLOYMENT}#{victim}"
               not in _engine_replicas()):
        assert time.time() < deadline, f"no replacement replica (before: {before}, now: {_engine_replicas()})"
        time.sleep(0.5)
