"""``genspec serve``: an OpenAI-compatible HTTP server over a speculative engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as Server-Sent Events,
``data: [DONE]`` last), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /``
(a playground page). Each request may carry ``speculative``: ``{"drafter", "num_draft_tokens",
"draft_length", "enabled"}``; responses carry ``usage`` and ``metrics.speculative_decoding``. Stream
chunks also carry ``genspec``: the new tokens' text and whether each came from an accepted draft.

Stop strings follow OpenAI: the text ends before the stop string (the engine's
:func:`~genspec.engine.visible_text`, as ``genspec generate`` prints it). For a model without a chat
template, messages are rendered as plain text (:func:`plain_chat_prompt`). Seeds take OpenAI's range,
any 64-bit signed integer (:mod:`genspec.serve.protocol` says how negative ones map).

No request holds up the others: a request body larger than ``max_body_bytes`` is refused with 413
before it is read (from its Content-Length) or as soon as the bytes received pass it
(:func:`read_body`); parsing, tokenising, chat templates and decoding run in a thread pool, not on the
event loop that serves every request; the engine runs in a thread of its own (:mod:`~genspec.serve.worker`).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, whatever failed: the
body (not UTF-8, not JSON, nested too deep, too large), a field (``param`` names it), the route (404,
405), a request larger than the batch and the queue together (400: it would never fit; a full queue
is 429). At shutdown, requests still running when the grace period ends are stopped with an error,
never a normal ending: 503 with ``code: "shutting_down"``, or on a stream that error as its last
event, ``data: {"error": {...}}``, with no ``[DONE]`` after it (as any error ends a stream).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from genspec.engine import NO_DRAFTER, GenerationConfig, RequestStats, RequestStep, SpeculativeEngine, visible_text
from genspec.errors import GenspecError
from genspec.serve.metrics import Metrics
from genspec.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    new_id,
    now,
    speculation_metrics,
    usage,
)
from genspec.serve.security import Gatekeeper, ServeSecurity, uvicorn_options
from genspec.serve.worker import EngineWorker, NeverFits, QueueFull, ShuttingDown

#: request bodies larger than this are refused (413) unless the server is told otherwise: 2 MiB holds a
#: prompt of about 500,000 tokens as text or 300,000 as token ids, more than the contexts of the models
#: served here, and bounds what parsing one body costs (0.07 s for 3.4 MB of token ids, protocol.py)
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024

#: the text format for models without a chat template
PLAIN_CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, refused with 413 when it is larger than ``max_bytes``: before any of it is
    read if its Content-Length says so, else as soon as the bytes received pass it (a chunked body
    announces no length)."""
    try:
        announced = int(request.headers.get("content-length", "0"))
    except ValueError:
        announced = 0
    if announced > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # gone (or closed for reading too slowly) before its body arrived: not a server error
        raise APIError("the connection closed before the request body arrived", code="client_disconnected") from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(f"the request body is larger than this server accepts ({max_bytes} bytes)", status=413,
                    code="request_too_large")


def invalid_request(errors: list[dict]) -> APIError:
    """The 400 of a request pydantic refused, about the field of its first error: ``param`` names it (none
    for a body that is not JSON: no field is to blame). A field of several types (``prompt``, ``stop``)
    has an error per type, each at the field's location followed by the type's name: the field is their
    common part, and the message that of the type that got furthest."""
    if not errors:
        return APIError("invalid request")
    if errors[0].get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {errors[0]['msg'].removeprefix('Invalid JSON: ')}")
    locs = [[part for part in error.get("loc", ()) if part != "body"] for error in errors]
    field = [(loc, error) for loc, error in zip(locs, errors) if loc[:1] == locs[0][:1]]
    where = ".".join(str(part) for part in os.path.commonprefix([loc for loc, _ in field]))
    message = max(field, key=lambda pair: len(pair[0]))[1].get("msg", "invalid")
    return APIError(f"{where}: {message}" if where else message, param=where or None)


def parse_body(model: type[BaseModel], raw: bytes):
    """A request of type ``model`` from its body (the JSON parser limits nesting depth)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not UTF-8 text (byte {exc.start} is not)") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None


def plain_chat_prompt(messages: list[tuple[str, str]]) -> tuple[str, list[str]]:
    """``Role: text`` paragraphs and a final ``Assistant:``, and the stop string that ends the reply
    (the model starting the user's next turn)."""
    lines = [f"{PLAIN_CHAT_ROLES[role]}: {text}" for role, text in messages]
    return "\n\n".join(lines + ["Assistant:"]), ["\n\nUser:"]


@dataclass
class _Choice:
    """One sample being generated for a request."""

    index: int
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    sent: str = ""
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    first_token_at: float | None = None


class _Server:
    """What the routes share: the engine's worker, the tokenizer, the metrics."""

    def __init__(self, engine: SpeculativeEngine, model_name: str, max_queue: int, grace_s: float,
                 chat_max_tokens: int, max_body_bytes: int):
        if engine.tokenizer is None:
            raise GenspecError("genspec serve needs a model with a tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.grace_s = grace_s
        self.chat_max_tokens = chat_max_tokens
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, max_queue, on_record=self._on_record)

    def _on_record(self, record, worker) -> None:
        self.metrics.observe_step(record, worker.num_waiting, worker.num_running)

    # ------------------------------------------------------------------ requests -> engine
    async def parse(self, request: Request, model: type[BaseModel]):
        """The request's body as a ``model``: read within the size limit, parsed in the thread pool."""
        try:
            return await run_in_threadpool(parse_body, model, await read_body(request, self.max_body_bytes))
        except APIError:
            self.metrics.failure.labels(reason="invalid").inc()
            raise

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           status=404, param="model", code="model_not_found")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def prompt_ids(self, prompt: str | list[int] | list[list[int]] | list[str]) -> list[list[int]]:
        """A completion request's prompts as token ids (CPU work: call it in the thread pool)."""
        if isinstance(prompt, str):
            prompts = [self.encode(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [self.encode(p) for p in prompt]
        elif all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if any(not p for p in prompts):
            raise APIError("prompt is empty", param="prompt")
        return prompts

    def chat_prompt(self, messages: list[ChatMessage]) -> tuple[list[int], tuple[str, ...]]:
        """A chat's prompt as token ids, and the stop strings its rendering adds (CPU work: call it in
        the thread pool)."""
        turns = [(m.role, m.text()) for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in turns],
                                                      tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), ()
        text, stops = plain_chat_prompt(turns)
        return self.encode(text), tuple(stops)

    def config(self, body, prompt_tokens: int, max_tokens: int | None, extra_stops: list[str] = ()) -> GenerationConfig:
        context = self.engine.target.max_context
        if context is not None and prompt_tokens >= context:
            raise APIError(f"This model's maximum context length is {context} tokens, but the prompt has "
                           f"{prompt_tokens} tokens", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.chat_max_tokens if context is None else min(self.chat_max_tokens, context - prompt_tokens)
        if context is not None and prompt_tokens + max_tokens > context:
            raise APIError(f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for "
                           f"the completion)", param="max_tokens", code="context_length_exceeded")
        speculative = body.speculative
        options = {}
        if speculative is not None:
            if not speculative.enabled:
                options["drafter"] = NO_DRAFTER
            elif speculative.drafter is not None:
                options["drafter"] = speculative.drafter
            if speculative.num_draft_tokens is not None:
                options["num_draft_tokens"] = speculative.num_draft_tokens
            if speculative.draft_length is not None:
                options["draft_length"] = speculative.draft_length
            options.update(speculative.model_dump(include={"rule", "epsilon", "delta", "residual"}, exclude_none=True))
        try:
            return GenerationConfig(
                max_new_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                repetition_penalty=body.repetition_penalty or 1.0, seed=body.seed,
                stop_strings=tuple(body.stop or ()) + tuple(extra_stops), **options)
        except GenspecError as exc:
            raise APIError(str(exc)) from exc

    async def run(self, prompts: list[list[int]], configs: list[GenerationConfig], sample_indices: list[int],
                  request: Request, stream_steps: bool):
        """Submit one request per sample; yields ``(choice index, step)`` as steps arrive. Cancels what is
        left if the caller stops reading (a client that went away)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def listener(request_id: int, step: RequestStep) -> None:  # the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (request_id, step))
            except RuntimeError:  # the loop is closed (an embedding app stopped it): nobody is listening
                pass

        try:
            future = self.worker.submit(prompts, configs, sample_indices, listener)
        except NeverFits as exc:
            self.metrics.failure.labels(reason="invalid").inc()
            raise APIError(str(exc), param="n" if any(sample_indices) else "prompt") from exc
        except QueueFull as exc:
            self.metrics.failure.labels(reason="queue_full").inc()
            raise APIError(str(exc), status=429, kind="rate_limit_error", code="queue_full") from exc
        except ShuttingDown as exc:
            raise APIError(str(exc), status=503, kind="server_error", code="shutting_down") from exc
        try:
            ids = await asyncio.wrap_future(future)
        except GenspecError as exc:
            self.metrics.failure.labels(reason="invalid").inc()
            raise APIError(str(exc), param="speculative" if "drafter" in str(exc) else None) from exc
        index_of = {request_id: i for i, request_id in enumerate(ids)}
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        unfinished = set(ids)
        try:
            while unfinished:
                try:
                    request_id, step = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if not stream_steps and await request.is_disconnected():
                        return
                    continue
                if step.finish_reason is not None:
                    unfinished.discard(request_id)
                yield index_of[request_id], step
        finally:
            if unfinished:  # the client went away (or the stream was closed): free the rows now
                self.worker.cancel(sorted(unfinished))
                self.metrics.failure.labels(reason="cancelled").inc(len(unfinished))

    # ------------------------------------------------------------------ steps -> text
    def visible(self, choice: _Choice, stops: tuple[str, ...]) -> str:
        """The choice's text so far as a client may see it (CPU work: call it in the thread pool)."""
        return visible_text(self.decode(choice.tokens), stops, choice.finish_reason is not None)

    def pieces(self, before: list[int], new: list[int], accepted: int) -> list[list]:
        """``[text, drafted]`` per new token (the playground colours accepted draft tokens)."""
        out, previous = [], self.decode(before)
        for j, token in enumerate(new):
            text = self.decode(before + new[:j + 1])
            out.append([text[len(previous):], j < accepted])
            previous = text
        return out

    def apply(self, choice: _Choice, step: RequestStep, started: float) -> None:
        if step.new_tokens and choice.first_token_at is None:
            choice.first_token_at = time.perf_counter()
            self.metrics.time_to_first_token.observe(choice.first_token_at - started)
        choice.tokens += step.new_tokens
        choice.stats = step.stats
        if step.finish_reason is not None:
            choice.finish_reason, choice.error = step.finish_reason, step.error
            end = time.perf_counter()
            if step.finish_reason in ("eos", "stop", "length"):
                self.metrics.success.labels(finished_reason=_openai_reason(step.finish_reason)).inc()
                if step.stats.acceptance is not None and not step.stats.acceptance["lossless"]:
                    self.metrics.lossy.labels(rule=step.stats.acceptance["rule"],
                                              residual=step.stats.acceptance["residual"]).inc()
                self.metrics.e2e_latency.observe(end - started)
                if len(choice.tokens) > 1 and choice.first_token_at is not None:
                    self.metrics.time_per_output_token.observe((end - choice.first_token_at) / (len(choice.tokens) - 1))
            elif step.finish_reason == "error":
                self.metrics.failure.labels(reason="error").inc()
            elif step.finish_reason == "cancelled":  # a drain's grace period ran out
                self.metrics.failure.labels(reason="cancelled").inc()


def _ended_early(choice: _Choice) -> APIError | None:
    """The error a choice that did not finish normally ends its response with: its own failure, or the
    server's shutdown (a request still running when a drain's grace period ran out is cancelled: no
    OpenAI client knows a finish reason "cancelled")."""
    if choice.finish_reason == "error":
        return APIError(f"generation failed: {choice.error}", status=500, kind="server_error")
    if choice.finish_reason == "cancelled":
        return APIError("the server shut down before this request finished (its grace period for requests in "
                        "flight ran out); send it again", status=503, kind="server_error", code="shutting_down")
    return None


def _openai_reason(reason: str | None) -> str | None:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason)


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


def load_engine(settings: dict, progress: Callable[[str], None] | None = None) -> SpeculativeEngine:
    """The engine a server runs, from its settings (model, drafter, drafter_options, extra_drafters,
    draft_model, dtype, max_batch_size, measure_costs, model_backend: auto, torch or llamacpp): loaded, and with ``measure_costs`` its verify
    costs measured for batch sizes up to ``max_batch_size`` (``progress`` sees what is being measured)."""
    import genspec
    from genspec.calibration import measure_verify_costs

    engine = genspec.load(settings["model"], drafter=settings["drafter"], draft_model=settings["draft_model"],
                          dtype=settings["dtype"], extra_drafters=settings["extra_drafters"],
                          max_batch_size=settings["max_batch_size"], backend=settings.get("model_backend", "auto"),
                          **settings["drafter_options"])
    if settings["measure_costs"]:
        most = settings["max_batch_size"]
        batches = sorted({1, 2, 4, 8, 16, most} & set(range(1, most + 1)))
        measure_verify_costs(engine.target, engine.costs, batches=batches, progress=progress)
    return engine


def _documented_body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses ``model`` itself (FastAPI then does not declare it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


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


def create_app(engine: SpeculativeEngine, model_name: str, max_queue: int = 64, grace_s: float = 30.0,
               chat_max_tokens: int = 1024, engine_thread: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, security: ServeSecurity | None = None) -> FastAPI:
    """The server's FastAPI app over ``engine``. ``engine_thread``: the app steps the engine in a thread
    it starts (to embed the app in your own ASGI server); False: the caller steps it, as
    :func:`run_server` does in the thread that loaded the model (faster: see there). Measure the
    engine's verify costs first (:func:`genspec.calibration.measure_verify_costs`) to start from this
    machine's costs of batched blocks rather than learn them from traffic. ``max_body_bytes``: larger
    request bodies get 413. ``security``: API keys, limits, CORS (:class:`~genspec.serve.security.ServeSecurity`;
    default: no keys, the default limits)."""
    security = security or ServeSecurity()
    server = _Server(engine, model_name, max_queue, grace_s, min(chat_max_tokens, security.max_tokens or chat_max_tokens),
                     max_body_bytes)
    gate = Gatekeeper(security, on_refusal=lambda reason: server.metrics.failure.labels(reason=reason).inc())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            server.worker.start()
        yield
        if engine_thread:
            await asyncio.to_thread(server.worker.drain, server.grace_s)

    app = FastAPI(title="genspec", lifespan=lifespan)
    app.state.server = server
    gate.install(app)
    app.openapi = lambda: _openapi(app)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a bug: the client gets an error body, not a trace
        logging.getLogger("genspec.serve").exception("request failed")
        return JSONResponse(APIError(f"internal error: {type(exc).__name__}", status=500, kind="server_error").body(),
                            status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        server.metrics.failure.labels(reason="invalid").inc()
        return JSONResponse(invalid_request(list(exc.errors())).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # routing's own: 404, 405
        route = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({route})", 405: f"Method not allowed ({route})"}.get(exc.status_code,
                                                                                         f"{exc.detail} ({route})")
        return JSONResponse(APIError(message, status=exc.status_code).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.get("/health")
    async def health():
        if not server.worker.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": now(), "owned_by": "genspec",
            "max_model_len": engine.target.max_context, "default_drafter": engine.default_drafter,
            "drafters": [NO_DRAFTER, *engine.drafters]}]}

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return resources.files("genspec.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    # The request bodies are parsed by server.parse, not by FastAPI, which would parse them on the event
    # loop, read them whole whatever their size, and answer some faults in its own shape.
    @app.post("/v1/completions", openapi_extra=_documented_body(CompletionRequest))
    async def completions(request: Request):
        body = await server.parse(request, CompletionRequest)
        server.check_model(body.model)
        prompts = await run_in_threadpool(server.prompt_ids, body.prompt)
        return await respond(body, prompts, body.max_tokens if body.max_tokens is not None else 16, (), request,
                             chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_documented_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await server.parse(request, ChatCompletionRequest)
        server.check_model(body.model)
        ids, extra_stops = await run_in_threadpool(server.chat_prompt, body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(body, [ids], max_tokens, extra_stops, request, chat=True)

    async def respond(body, prompts: list[list[int]], max_tokens: int | None, extra_stops: tuple[str, ...],
                      request: Request, chat: bool):
        samples, configs, indices, choices = [], [], [], []
        for p, prompt in enumerate(prompts):  # choice p * n + j: prompt p's sample j (the seed's stream j)
            config = server.config(body, len(prompt), max_tokens, list(extra_stops))
            for j in range(body.n):
                samples.append(prompt)
                configs.append(config)
                indices.append(j)
                choices.append(_Choice(p * body.n + j, len(prompt)))
        stops = configs[0].stop_strings
        created, started = now(), time.perf_counter()
        ident = new_id("chatcmpl" if chat else "cmpl")
        kind = "chat.completion" if chat else "text_completion"
        admission = gate.admit(request, body, samples, configs)  # 400 past a limit, 429 past the key's rate
        steps = admission.hold(server.run(samples, configs, indices, request, stream_steps=body.stream))

        if not body.stream:
            async for index, step in steps:
                server.apply(choices[index], step, started)
            for c in choices:
                if (error := _ended_early(c)) is not None:
                    raise error
            texts = await run_in_threadpool(lambda: [server.visible(c, stops) for c in choices])
            result = []
            for c, text in zip(choices, texts):
                entry = {"index": c.index, "finish_reason": _openai_reason(c.finish_reason)}
                entry.update({"message": {"role": "assistant", "content": text}} if chat else
                             {"text": text, "logprobs": None})
                result.append(entry)
            return {"id": ident, "object": kind, "created": created, "model": model_name, "choices": result,
                    "usage": usage(sum(c.prompt_tokens for c in choices), sum(len(c.tokens) for c in choices)),
                    "metrics": speculation_metrics([c.stats for c in choices])}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        first = await _first(steps)  # submission errors (bad drafter, full queue) still answer 4xx

        async def events():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                for c in choices:
                    yield _sse({"id": ident, "object": chunk_kind, "created": created, "model": model_name,
                                "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
            pending = [first] if first is not None else []
            try:
                while True:
                    item = pending.pop() if pending else await anext(steps, None)
                    if item is None:
                        break
                    index, step = item
                    choice = choices[index]
                    before = list(choice.tokens)
                    server.apply(choice, step, started)
                    if (error := _ended_early(choice)) is not None:
                        yield _sse(error.body())
                        return
                    text, pieces = await run_in_threadpool(
                        lambda: (server.visible(choice, stops), server.pieces(before, step.new_tokens, step.accepted)))
                    delta, choice.sent = text[len(choice.sent):], text
                    reason = _openai_reason(choice.finish_reason)
                    body_choice = {"index": index, "finish_reason": reason}
                    body_choice.update({"delta": {"content": delta} if delta or not reason else {}} if chat else
                                       {"text": delta, "logprobs": None})
                    yield _sse({"id": ident, "object": chunk_kind, "created": created, "model": model_name,
                                "choices": [body_choice],
                                "genspec": {"tokens": pieces,
                                            "drafted": step.drafted, "accepted": step.accepted}})
                if include_usage:
                    yield _sse({"id": ident, "object": chunk_kind, "created": created, "model": model_name,
                                "choices": [], "usage": usage(sum(c.prompt_tokens for c in choices),
                                                              sum(len(c.tokens) for c in choices)),
                                "metrics": speculation_metrics([c.stats for c in choices])})
                yield _sse("[DONE]")
            finally:
                await steps.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _first(steps):
    """The first item of an async generator (None if it ends at once); raising what it raises."""
    return await anext(steps, None)


def run_server(app: FastAPI, host: str, port: int, grace_s: float, log_level: str = "warning") -> None:
    """Serve ``app`` (made with ``engine_thread=False``) on ``host:port`` until SIGTERM or SIGINT, stepping
    its engine in the calling thread and running HTTP in another.

    Why this way round: PyTorch's CPU kernels run on OpenMP, whose thread team belongs to the thread that
    starts it; a second thread doing torch work gets a second team, and with more OpenMP threads than
    cores libgomp stops spin-waiting between a step's thousands of short parallel regions. The embedded
    model's forward over 4 rows took 68 ms in the thread that loaded it and 90 ms in another
    (``python benchmarks/costs/thread_forward.py``, 2-core EPYC), which cost the server 30% of its throughput.

    On a signal: no new connections; requests in flight run up to ``grace_s`` seconds more, then are
    cancelled; then the process returns."""
    import signal
    import threading

    import uvicorn

    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=max(1, int(grace_s) + 5),
                                         **uvicorn_options(app.state.gatekeeper.settings)))
    worker = app.state.server.worker

    def on_signal(signum, frame):  # only sets flags: it runs inside the engine loop, in this thread
        http.should_exit = True
        worker.begin_drain(grace_s)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)

