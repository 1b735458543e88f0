"""What the routes share: :class:`Service` holds the engine's worker, the tokenizer, the metrics and the
gatekeeper of one app, and answers a completion or chat request once its route has turned the body into
prompts (:meth:`Service.respond`): one engine request per prompt and sample, then a JSON response or a
stream of Server-Sent Events (``data: [DONE]`` last; an error ends a stream as its last event, with no
``[DONE]`` after it). Stream chunks also carry ``genspec``: the new tokens' text and whether each came
from an accepted draft.

Stop strings follow OpenAI: the text ends before the stop string (the engine's
:func:`~genspec.engine.visible_text`, as ``genspec generate`` prints it).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from genspec.config import GenerationConfig
from genspec.records import IncrementalText, RequestStats, RequestStep, TokenLogprob, visible_text
from genspec.errors import GenspecError
from genspec.serve import requests
from genspec.serve.errors import ended_early
from genspec.serve.metrics import Metrics
from genspec.serve.protocol import (APIError, ChatMessage, chat_logprobs, completion_logprobs, new_id, now,
                                    speculation_metrics, usage)
from genspec.serve.security import Gatekeeper
from genspec.serve.settings import ServerSettings
from genspec.serve.worker import EngineWorker, NeverFits, QueueFull, ShuttingDown


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
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Service:
    """One app's worker (``worker``), metrics (``metrics``) and gatekeeper (``gatekeeper``), and what its
    routes do with them."""

    def __init__(self, worker: EngineWorker, settings: ServerSettings, metrics: Metrics, gatekeeper: Gatekeeper):
        if worker.tokenizer is None:
            raise GenspecError("genspec serve needs a model with a tokenizer")
        self.worker = worker
        self.settings = settings
        self.metrics = metrics
        self.gatekeeper = gatekeeper
        self.tokenizer = worker.tokenizer

    # ------------------------------------------------------------------ requests -> engine
    async def parse(self, request: Request, model: type[BaseModel]):
        """The request's body as a ``model``: read within the size limit, parsed in the thread pool."""
        try:
            raw = await requests.read_body(request, self.settings.max_body_bytes)
            return await run_in_threadpool(requests.parse_body, model, raw)
        except APIError:
            self.metrics.failure.labels(reason="invalid").inc()
            raise

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(f"The model `{name}` does not exist; this server serves `{self.settings.model_name}`",
                           status=404, param="model", code="model_not_found")

    def encode(self, text: str) -> list[int]:
        return requests.encode(self.tokenizer, text)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    async def prompt_ids(self, prompt) -> list[list[int]]:
        """A completion request's prompts as token ids (tokenised in the thread pool)."""
        return await run_in_threadpool(requests.prompt_ids, self.tokenizer, prompt)

    async def chat_prompt(self, messages: list[ChatMessage]) -> tuple[list[int], tuple[str, ...]]:
        """A chat's prompt as token ids and the stop strings its rendering adds (in the thread pool)."""
        return await run_in_threadpool(requests.chat_prompt, self.tokenizer, messages)

    def config(self, body, prompt_tokens: int, max_tokens: int | None, extra_stops: list[str] = ()) -> GenerationConfig:
        return requests.generation_config(body, prompt_tokens, max_tokens, extra_stops, self.worker.max_context,
                                          self.settings.default_max_tokens)

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

    def token_texts(self, tokens: list[int]) -> list[str]:
        """Each token's own text (special tokens included), as log-probabilities name them; a token that is
        part of a character (a byte of a multi-byte one) by its vocabulary entry, which tells it apart."""
        texts = [self.tokenizer.decode([token], skip_special_tokens=False) for token in tokens]
        return [self.tokenizer.convert_ids_to_tokens(token) if "\ufffd" in text else text
                for token, text in zip(tokens, texts)]

    def logprobs_of(self, logprobs: list[TokenLogprob], chat: bool, start: int = 0, upto: int | None = None) -> dict:
        """The ``logprobs`` of a choice's tokens in the route's shape; with ``upto`` (a choice a stop string ended),
        only the tokens whose text starts before that many characters (the text shown ends before the stop string).
        ``start``: where the first token's text starts (OpenAI's ``text_offset``). CPU work: call it in the
        thread pool."""
        tokens = [lp.token for lp in logprobs]
        pieces = IncrementalText(self.decode).extend(tokens)
        offsets, at = [], start
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        if upto is not None:
            keep = sum(1 for offset in offsets if offset < start + upto) or min(1, len(offsets))
            logprobs, tokens, offsets = logprobs[:keep], tokens[:keep], offsets[:keep]
        texts = self.token_texts(tokens)
        alternatives = [list(zip(self.token_texts([t for t, _ in lp.top]), [v for _, v in lp.top])) for lp in logprobs]
        if chat:
            return chat_logprobs(texts, logprobs, alternatives)
        top = [{**dict(alts), text: lp.logprob} for text, lp, alts in zip(texts, logprobs, alternatives)]
        return completion_logprobs(texts, logprobs, top, offsets)

    def apply(self, choice: _Choice, step: RequestStep, started: float) -> None:
        if step.new_tokens and choice.first_token_at is None:
            choice.first_token_at = time.perf_counter()
            self.metrics.time_to_first_token.observe(choice.first_token_at - started)
        choice.tokens += step.new_tokens
        choice.logprobs += step.logprobs or ()
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

    def echoed(self, body, prompts: list[list[int]]) -> list[str]:
        """A completion's prompts as text, for ``echo``: as the request gave them, or decoded from token ids."""
        if isinstance(body.prompt, str):
            return [body.prompt]
        if all(isinstance(p, str) for p in body.prompt):
            return list(body.prompt)
        return [self.decode(p) for p in prompts]

    # ------------------------------------------------------------------ the response
    async def respond(self, body, prompts: list[list[int]], max_tokens: int | None, extra_stops: tuple[str, ...],
                      request: Request, chat: bool):
        """The answer to a completion (``chat`` False) or chat request ``body`` of these prompts: ``n``
        samples of each, as one JSON response or (``stream``) Server-Sent Events."""
        samples, configs, indices, choices = [], [], [], []
        for p, prompt in enumerate(prompts):  # choice p * n + j: prompt p's sample j (the seed's stream j)
            config = self.config(body, len(prompt), max_tokens, list(extra_stops))
            for j in range(body.n):
                samples.append(prompt)
                configs.append(config)
                indices.append(j)
                choices.append(_Choice(p * body.n + j, len(prompt)))
        stops = configs[0].stop_strings
        logprobs_asked = configs[0].logprobs is not None
        echoed = await run_in_threadpool(self.echoed, body, prompts) if not chat and body.echo else None
        created, started = now(), time.perf_counter()
        ident = new_id("chatcmpl" if chat else "cmpl")
        kind = "chat.completion" if chat else "text_completion"
        model_name = self.settings.model_name
        admission = self.gatekeeper.admit(request, body, samples, configs)  # 400 past a limit, 429 past the key's rate
        steps = admission.hold(self.run(samples, configs, indices, request, stream_steps=body.stream))

        if not body.stream:
            async for index, step in steps:
                self.apply(choices[index], step, started)
            for c in choices:
                if (error := ended_early(c.finish_reason, c.error)) is not None:
                    raise error
            texts = await run_in_threadpool(lambda: [self.visible(c, stops) for c in choices])
            logprobs = [None] * len(choices)
            if logprobs_asked:  # a stop string's text is not shown, nor are its tokens' log-probabilities
                logprobs = await run_in_threadpool(lambda: [
                    self.logprobs_of(c.logprobs, chat, upto=len(text) if c.finish_reason == "stop" else None)
                    for c, text in zip(choices, texts)])
            result = []
            for c, text, lp in zip(choices, texts, logprobs):
                entry = {"index": c.index, "finish_reason": _openai_reason(c.finish_reason)}
                entry.update({"message": {"role": "assistant", "content": text}, "logprobs": lp} if chat else
                             {"text": (echoed[c.index // body.n] if echoed else "") + text, "logprobs": lp})
                result.append(entry)
            return {"id": ident, "object": kind, "created": created, "model": model_name, "choices": result,
                    "usage": usage(sum(c.prompt_tokens for c in choices), sum(len(c.tokens) for c in choices)),
                    "metrics": speculation_metrics([c.stats for c in choices])}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        first = await anext(steps, None)  # submission errors (bad drafter, full queue) still answer 4xx

        async def events():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                for c in choices:
                    yield _sse({"id": ident, "object": chunk_kind, "created": created, "model": model_name,
                                "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
            for c in choices if echoed else ():  # the prompt first, as OpenAI echoes it
                yield _sse({"id": ident, "object": chunk_kind, "created": created, "model": model_name,
                            "choices": [{"index": c.index, "text": echoed[c.index // body.n], "logprobs": None,
                                         "finish_reason": None}]})
            pending = [first] if first is not None else []
            texts = [IncrementalText(self.decode) for _ in choices]
            try:
                while True:
                    item = pending.pop() if pending else await anext(steps, None)
                    if item is None:
                        break
                    index, step = item
                    choice = choices[index]
                    before = len(choice.tokens)
                    self.apply(choice, step, started)
                    if (error := ended_early(choice.finish_reason, choice.error)) is not None:
                        yield _sse(error.body())
                        return
                    # a few short windows decoded per new token: cheap enough for the event loop itself
                    streamed = texts[index]
                    pieces = [[piece, j < step.accepted] for j, piece in enumerate(streamed.extend(step.new_tokens))]
                    done = choice.finish_reason is not None
                    text = visible_text(streamed.final() if done else streamed.text, stops, done)
                    logprobs = (await run_in_threadpool(self.logprobs_of, step.logprobs or [], chat,
                                                        len(self.decode(choice.tokens[:before])))
                                if logprobs_asked else None)
                    delta, choice.sent = text[len(choice.sent):], text
                    reason = _openai_reason(choice.finish_reason)
                    body_choice = {"index": index, "finish_reason": reason}
                    body_choice.update({"delta": {"content": delta} if delta or not reason else {},
                                        "logprobs": logprobs} if chat else {"text": delta, "logprobs": logprobs})
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


def service(request: Request) -> Service:
    """The :class:`Service` of the app serving ``request`` (the routes' dependency)."""
    return request.app.state.server


def _openai_reason(reason: str | None) -> str | None:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason, reason)


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"
