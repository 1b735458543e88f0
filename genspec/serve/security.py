"""What keeps ``genspec serve`` safe to expose: API keys, the limits a public endpoint needs, CORS, and
connections that cannot be held open forever.

- **API keys** (:class:`ServeSecurity` ``api_key_sha256``): every ``/v1/*`` route and ``/metrics`` (unless
  ``metrics_public``) need ``Authorization: Bearer KEY``; a missing or wrong key gets 401 with an OpenAI
  error body (code ``invalid_api_key``) that names no key. ``/health`` and the playground stay open.
  Only the keys' SHA-256 digests are kept (and passed to Ray replicas); a presented key is hashed and
  compared with each digest in constant time (:func:`hmac.compare_digest`), all of them every time.
- **Limits** (:meth:`Gatekeeper.admit`), each answered with an OpenAI error: prompt tokens, ``max_tokens``,
  ``n``, the number and length of stop strings (400); concurrent streams per key and a per-key rate limit
  of requests and tokens per minute (429 with ``Retry-After``). A request's tokens are its prompts' tokens
  plus the most it may generate (``n`` x ``max_tokens``), charged when it is admitted, as OpenAI counts
  them. Token buckets: a key may spend a minute's allowance at once, and it refills evenly over the minute.
  The identity a limit counts by is the key; without keys, the client's address (the 429's message says which).
- **CORS**: off unless ``allowed_origins`` names the origins (``*``: any) allowed to call the API from a
  browser (the playground served from elsewhere).
- **Connections** (:func:`uvicorn_options`): a connection that sends nothing is closed after
  ``keep_alive`` (as between requests); a request's headers and body must arrive within
  ``read_timeout``; at most ``max_connections`` connections and requests at once (uvicorn answers 503
  past it).

With the Ray backend, the engine replicas check keys and limits (the router checks the key of
``/metrics``, which it answers), and count limits each for itself: a key's rate limit and streams are per
replica. Serve's proxy holds the connections: its keep-alive is set from ``keep_alive``, the read
timeout and connection limit are Serve's own.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields

import h11
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from genspec.errors import ConfigError
from genspec.serve.protocol import APIError, ChatCompletionRequest


def hash_key(key: str) -> str:
    """The SHA-256 digest (hex) that stands for an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ServeSecurity:
    """The server's keys and limits (0 turns a limit off). The defaults are the CLI's."""

    #: SHA-256 digests of the accepted API keys (:func:`hash_key`); empty: no key needed
    api_key_sha256: tuple[str, ...] = ()
    metrics_public: bool = False
    #: origins a browser may call the API from (``*``: any); empty: no CORS headers
    allowed_origins: tuple[str, ...] = ()
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096
    max_n: int = 8
    max_stop_strings: int = 4
    max_stop_length: int = 128
    max_streams_per_key: int = 16
    requests_per_minute: int = 600
    tokens_per_minute: int = 200_000
    keep_alive: float = 5.0
    read_timeout: float = 30.0
    max_connections: int = 512

    def __post_init__(self):
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not value >= 0:
                raise ConfigError(f"{item.name} must be >= 0, got {value}")
        if self.keep_alive <= 0 or self.read_timeout <= 0:
            raise ConfigError("keep_alive and read_timeout must be > 0")

    @classmethod
    def with_keys(cls, keys, **settings) -> "ServeSecurity":
        """Settings that accept ``keys`` (the keys themselves; only their digests are kept)."""
        keys = [key for key in keys if key]
        return cls(api_key_sha256=tuple(hash_key(key) for key in keys), **settings)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (every address it names is a loopback one)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


# ------------------------------------------------------------------------------ errors
class RateLimited(APIError):
    """A 429 that tells the client when to retry (``Retry-After``, whole seconds)."""

    def __init__(self, message: str, retry_after_s: float, code: str = "rate_limit_exceeded"):
        super().__init__(message, status=429, kind="rate_limit_error", code=code)
        self.retry_after = max(1, math.ceil(retry_after_s))


def _json_response(error: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# ------------------------------------------------------------------------------ rate limits
class TokenBucket:
    """``capacity`` units, refilled at ``capacity`` per minute."""

    def __init__(self, capacity: float, now: float):
        self.capacity, self.level, self.updated = capacity, capacity, now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0: now); call :meth:`refill` first."""
        return max(0.0, (amount - self.level) * 60.0 / self.capacity)


class Admission:
    """An admitted request: holds its stream slot (if it streams) until its steps end."""

    def __init__(self, release: Callable[[], None] | None = None):
        self._release = release

    async def hold(self, steps: AsyncIterator) -> AsyncIterator:
        """``steps``, releasing the slot when they end, fail or are closed (a client gone)."""
        try:
            async for item in steps:
                yield item
        finally:
            try:
                await steps.aclose()
            finally:
                self.release()

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class Gatekeeper:
    """Enforces a :class:`ServeSecurity` on an app: :meth:`install` adds the key check (and CORS), the
    routes call :meth:`admit` for each generation request. ``on_refusal(reason)`` counts refusals
    (reasons: unauthorized, limit, rate_limited)."""

    def __init__(self, settings: ServeSecurity, on_refusal: Callable[[str], None] = lambda reason: None):
        self.settings = settings
        self.on_refusal = on_refusal
        self._lock = threading.Lock()  # admissions and releases may come from the loop and from worker threads
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self._streams: dict[str, int] = {}

    # ------------------------------------------------------------------ keys
    def install(self, app: FastAPI) -> None:
        app.state.gatekeeper = self

        @app.exception_handler(RateLimited)
        async def rate_limited(request: Request, exc: RateLimited):
            return _json_response(exc, {"Retry-After": str(exc.retry_after)})

        app.add_middleware(_Authentication, gatekeeper=self)
        if self.settings.allowed_origins:  # added last: outermost, so a 401 carries CORS headers too
            from fastapi.middleware.cors import CORSMiddleware

            app.add_middleware(CORSMiddleware, allow_origins=list(self.settings.allowed_origins),
                               allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])

    def protects(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or (path == "/metrics" and not self.settings.metrics_public)

    def identify(self, headers: list[tuple[bytes, bytes]], client) -> str | APIError:
        """The identity limits count by: ``key-N`` for the N-th key, or the client's address when the
        server takes no keys; or the 401 error for a missing or wrong key."""
        if not self.settings.api_key_sha256:
            return f"client-{client[0]}" if client else "client"
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, presented = value.partition(b" ")
        if scheme.lower() != b"bearer" or not presented.strip():
            return APIError("You didn't provide an API key: send it as 'Authorization: Bearer KEY'.", status=401,
                            code="invalid_api_key")
        digest = hashlib.sha256(presented.strip()).hexdigest().encode()
        found = None
        for i, stored in enumerate(self.settings.api_key_sha256):  # every digest, found or not: constant time
            if hmac.compare_digest(digest, stored.encode()) and found is None:
                found = i
        if found is None:
            return APIError("Incorrect API key provided.", status=401, code="invalid_api_key")
        return f"key-{found}"

    # ------------------------------------------------------------------ limits
    def admit(self, request: Request, body, prompts: list[list[int]], configs) -> Admission:
        """Check one generation request (``prompts`` and ``configs``: one per sample) against the limits:
        400 past a size limit, 429 past the identity's streams or rate. Returns its :class:`Admission`."""
        s = self.settings
        who = request.scope.get("state", {}).get("genspec_identity") or "client"
        longest = max(len(p) for p in prompts)
        stops = list(body.stop or ())
        problem = None
        if s.max_prompt_tokens and longest > s.max_prompt_tokens:
            problem = (f"the prompt has {longest} tokens; this server takes at most {s.max_prompt_tokens}",
                       "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        elif s.max_n and body.n > s.max_n:
            problem = f"n is {body.n}; this server takes at most {s.max_n}", "n"
        elif s.max_tokens and max(c.max_new_tokens for c in configs) > s.max_tokens:
            problem = (f"max_tokens is {max(c.max_new_tokens for c in configs)}; this server generates at most "
                       f"{s.max_tokens} tokens per request", "max_tokens")
        elif s.max_stop_strings and len(stops) > s.max_stop_strings:
            problem = f"{len(stops)} stop strings; this server takes at most {s.max_stop_strings}", "stop"
        elif s.max_stop_length and any(len(stop) > s.max_stop_length for stop in stops):
            problem = f"a stop string is longer than this server's limit of {s.max_stop_length} characters", "stop"
        cost = sum(len(p) + c.max_new_tokens for p, c in zip(prompts, configs))
        if problem is None and s.tokens_per_minute and cost > s.tokens_per_minute:
            problem = (f"this request may use {cost} tokens (prompts + n x max_tokens), more than this server's "
                       f"limit of {s.tokens_per_minute} per minute", "max_tokens")
        if problem is not None:
            self.on_refusal("limit")
            raise APIError(problem[0], param=problem[1], code="limit_exceeded")

        with self._lock:
            if body.stream and s.max_streams_per_key and self._streams.get(who, 0) >= s.max_streams_per_key:
                self.on_refusal("rate_limited")
                raise RateLimited(f"too many streams at once: at most {s.max_streams_per_key} {self.counted_by}",
                                  1.0, code="too_many_streams")
            self._take(who, cost)
            if not body.stream:
                return Admission()
            self._streams[who] = self._streams.get(who, 0) + 1

        def release():
            with self._lock:
                left = self._streams[who] - 1
                if left:
                    self._streams[who] = left
                else:
                    del self._streams[who]

        return Admission(release)

    @property
    def counted_by(self) -> str:
        """What the limits count by, as the 429 messages name it (see :meth:`identify`)."""
        return "per API key" if self.settings.api_key_sha256 else "per client address"

    def open_streams(self, identity: str) -> int:
        return self._streams.get(identity, 0)

    def _take(self, who: str, tokens: int) -> None:
        """Takes a request and ``tokens`` from ``who``'s buckets, or raises 429 (under the lock)."""
        s = self.settings
        if not (s.requests_per_minute or s.tokens_per_minute):
            return
        now = time.monotonic()
        if len(self._buckets) > 4096:  # forget identities whose buckets refilled (unused for a minute)
            self._buckets = {k: v for k, v in self._buckets.items() if now - v[0].updated < 60}
        buckets = self._buckets.get(who)
        if buckets is None:
            buckets = self._buckets[who] = (TokenBucket(s.requests_per_minute or math.inf, now),
                                            TokenBucket(s.tokens_per_minute or math.inf, now))
        requests, tokens_bucket = buckets
        requests.refill(now)
        tokens_bucket.refill(now)
        waits = [requests.wait(1) if s.requests_per_minute else 0.0,
                 tokens_bucket.wait(tokens) if s.tokens_per_minute else 0.0]
        if max(waits) > 0:
            self.on_refusal("rate_limited")
            which = (f"{s.requests_per_minute} requests" if waits[0] >= waits[1] else f"{s.tokens_per_minute} tokens")
            raise RateLimited(f"rate limit reached: {which} per minute {self.counted_by}; retry in "
                              f"{max(1, math.ceil(max(waits)))} s", max(waits))
        requests.level -= 1
        tokens_bucket.level -= tokens


class _Authentication:
    """ASGI middleware: the key check on protected paths; records the request's identity in its scope's
    state (``genspec_identity``) for the limits."""

    def __init__(self, app, gatekeeper: Gatekeeper):
        self.app, self.gatekeeper = app, gatekeeper

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            identity = self.gatekeeper.identify(scope.get("headers", []), scope.get("client"))
            if isinstance(identity, APIError):
                if self.gatekeeper.protects(scope["path"]):
                    self.gatekeeper.on_refusal("unauthorized")
                    response = _json_response(identity, {"WWW-Authenticate": "Bearer"})
                    await response(scope, receive, send)
                    return
                identity = None
            scope.setdefault("state", {})["genspec_identity"] = identity
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------ connections
def uvicorn_options(settings: ServeSecurity) -> dict:
    """uvicorn.Config options that bound what idle and slow clients hold (see the module's doc)."""
    return {"timeout_keep_alive": settings.keep_alive, "limit_concurrency": settings.max_connections or None,
            "http": functools.partial(_DeadlineProtocol, read_timeout=settings.read_timeout)}


class _DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline: from a connection's start (or its previous response's
    end) the whole next request, headers and body, must arrive within ``read_timeout``, or the
    connection is closed. A new connection that sends nothing is closed after the keep-alive timeout, as
    an idle one between requests is."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self.read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.DONE:  # the whole request arrived
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # before: completing a response takes in the next request, if one is pipelined
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)
