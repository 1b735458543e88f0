"""``genspec serve``: an OpenAI-compatible HTTP server over a speculative engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as Server-Sent Events,
``data: [DONE]`` last), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /``
(a playground page). Each request may carry ``speculative``: ``{"drafter", "num_draft_tokens",
"draft_length", "enabled"}``; responses carry ``usage`` and ``metrics.speculative_decoding``. Stream
chunks also carry ``genspec``: the new tokens' text and whether each came from an accepted draft.

Where things are: :mod:`~genspec.serve.settings` (the server's settings, checked once),
:mod:`~genspec.serve.routes` (one module per route family), :mod:`~genspec.serve.requests` (a request's
body, prompts and generation settings), :mod:`~genspec.serve.service` (what the routes share: running a
request and shaping its response or stream), :mod:`~genspec.serve.errors` (error bodies),
:mod:`~genspec.serve.worker` (the engine's thread: the one place that talks to the engine),
:mod:`~genspec.serve.security` (keys, limits, CORS). This module assembles the app and runs it.

Stop strings follow OpenAI: the text ends before the stop string (the engine's
:func:`~genspec.engine.visible_text`, as ``genspec generate`` prints it). For a model without a chat
template, messages are rendered as plain text (:func:`~genspec.serve.requests.plain_chat_prompt`). Seeds
take OpenAI's range, any 64-bit signed integer (:mod:`genspec.serve.protocol` says how negative ones map).

No request holds up the others: a request body larger than ``max_body_bytes`` is refused with 413
before it is read (from its Content-Length) or as soon as the bytes received pass it
(:func:`~genspec.serve.requests.read_body`); parsing, tokenising, chat templates and decoding run in a
thread pool, not on the event loop that serves every request; the engine runs in a thread of its own.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, whatever failed: the
body (not UTF-8, not JSON, nested too deep, too large), a field (``param`` names it), the route (404,
405), a request larger than the batch and the queue together (400: it would never fit; a full queue
is 429). At shutdown, requests still running when the grace period ends are stopped with an error,
never a normal ending: 503 with ``code: "shutting_down"``, or on a stream that error as its last
event, ``data: {"error": {...}}``, with no ``[DONE]`` after it (as any error ends a stream).
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from genspec.engine import SpeculativeEngine
from genspec.errors import GenspecError
from genspec.serve.errors import install_error_handlers
from genspec.serve.metrics import Metrics
from genspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from genspec.serve.routes import chat, completions, info
from genspec.serve.security import Gatekeeper, uvicorn_options
from genspec.serve.service import Service
from genspec.serve.settings import ServerSettings
from genspec.serve.worker import EngineWorker


def create_app(engine: SpeculativeEngine, settings: ServerSettings | None = None, engine_thread: bool = True) -> FastAPI:
    """The server's FastAPI app over ``engine``, with ``settings``' model name, queue, grace period, body
    limit and security (default: :class:`~genspec.serve.settings.ServerSettings`' defaults; its model,
    drafter and batch fields are for :func:`~genspec.serve.worker.load_engine`, which loads an engine).
    ``engine_thread``: the app steps the engine in a thread it starts (to embed the app in your own
    ASGI server); False: the caller steps it, as :func:`run_server` does in the thread that loaded the
    model (faster: see there). Measure the engine's verify costs first
    (:func:`genspec.calibration.measure_verify_costs`) to start from this machine's costs of batched
    blocks rather than learn them from traffic."""
    settings = settings or ServerSettings()
    metrics = Metrics()
    worker = EngineWorker(engine, settings.max_queue,
                          on_record=lambda record, w: metrics.observe_step(record, w.num_waiting, w.num_running))
    gate = Gatekeeper(settings.security, on_refusal=lambda reason: metrics.failure.labels(reason=reason).inc())
    server = Service(worker, settings, metrics, gate)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            worker.start()
        yield
        if engine_thread:
            await asyncio.to_thread(worker.drain, settings.grace_s)

    app = FastAPI(title="genspec", lifespan=lifespan)
    app.state.server = server
    gate.install(app)
    app.openapi = lambda: _openapi(app)
    install_error_handlers(app, on_invalid=lambda: metrics.failure.labels(reason="invalid").inc())
    for family in (info, completions, chat):
        app.include_router(family.router)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of ``app`` with the request models the routes parse themselves (clients and
    Schemathesis read the bodies from it)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, definitions = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
                                            ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


def run_server(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """Serve ``app`` (made with ``engine_thread=False``) on ``host:port`` until SIGTERM or SIGINT, stepping
    its engine in the calling thread and running HTTP in another.

    Why this way round: PyTorch's CPU kernels run on OpenMP, whose thread team belongs to the thread that
    starts it; a second thread doing torch work gets a second team, and with more OpenMP threads than
    cores libgomp stops spin-waiting between a step's thousands of short parallel regions, so a forward in
    another thread than the one that loaded the model is markedly slower (the manual's page The OpenAI API
    has the measurement).

    On a signal: the listening socket closes first, so a new connection is refused at once; requests in flight
    run up to the settings' ``grace_s`` seconds more, then are cancelled; then the process returns. The HTTP
    thread hears the signal itself (:class:`_SignalledServer`): Python runs a signal handler in the main thread
    only, between two bytecodes, and the main thread may be inside one long call into the model (a prefill, a
    wide verify block) that would hold the handler, and the listener with it, until it returns."""
    import signal
    import socket
    import threading

    server: Service = app.state.server
    grace_s = server.settings.grace_s
    worker = server.worker
    wakeup, woken = socket.socketpair()
    for end in (wakeup, woken):
        end.setblocking(False)

    def stop() -> None:  # only sets flags (and closes the listener): safe in a signal handler and on the loop
        http.stop_listening()
        worker.begin_drain(grace_s)

    http = _SignalledServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=max(1, int(grace_s) + 5),
                                           **uvicorn_options(server.settings.security)), woken, stop)

    def on_signal(signum, frame):  # runs inside the engine loop, in this thread, once the current call returns
        stop()

    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, on_signal) for sig in stops}
    previous_wakeup = signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
    thread = threading.Thread(target=http.run, name="genspec-http", daemon=True)
    try:
        thread.start()
        while not http.started:
            if not thread.is_alive():
                raise GenspecError(f"cannot serve on {host}:{port} (is the port in use?)")
            time.sleep(0.05)
        worker.run(keep_running=thread.is_alive)
    finally:
        http.should_exit = True
        thread.join(timeout=grace_s + 30)
        signal.set_wakeup_fd(previous_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        wakeup.close()
        woken.close()


class _SignalledServer(uvicorn.Server):
    """uvicorn's server that stops at a signal by itself: the C-level signal handler writes the signal's number
    to the wakeup socket (:func:`signal.set_wakeup_fd`) whatever the main thread is doing, and this server's
    event loop, which watches the other end, calls ``on_stop`` at once. :meth:`stop_listening` closes the
    listening sockets before anything else (uvicorn's own shutdown, which closes them too, waits for its next
    tick of the loop)."""

    def __init__(self, config: uvicorn.Config, woken, on_stop):
        super().__init__(config)
        self._woken, self._on_stop = woken, on_stop

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        asyncio.get_running_loop().add_reader(self._woken.fileno(), self._read_wakeup)

    def _read_wakeup(self) -> None:
        import signal

        try:
            data = self._woken.recv(512)
        except (BlockingIOError, InterruptedError):
            return
        if {signal.SIGTERM, signal.SIGINT} & set(data):
            self._on_stop()

    def stop_listening(self) -> None:
        """Refuse new connections from now on (idempotent, and safe from any thread); requests in flight go on."""
        for listener in self.servers:
            try:
                listener.get_loop().call_soon_threadsafe(listener.close)
            except RuntimeError:  # its loop has ended: nothing listens any more
                pass
        self.should_exit = True
