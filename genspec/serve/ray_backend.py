"""``genspec serve --backend ray``: the same OpenAI app, its engines as Ray Serve replicas.

Two deployments in one Serve application:

- ``genspec-engine`` replicas: each a Ray actor with one genspec engine (its own continuous batch) and
  the app of :func:`genspec.serve.app.create_app`. One thread of the replica loads the model and then
  steps the engine, so that one thread does all the torch work (why: :func:`genspec.serve.app.run_server`).
- ``genspec``, the ingress: a thin router that passes each HTTP request as it came to an engine replica
  (chosen by Serve: the less busy of two) and streams the replica's response back as it comes. It is what
  makes a replica's death a clear error: Serve's own proxy cuts a stream off mid-body when the replica
  behind it dies (the client sees an incomplete chunked read), while the router ends it with an OpenAI
  error event (``code: replica_failed``, as the app ends a stream whose generation failed), or answers
  503 with that error body if nothing was sent yet. Only the dead replica's
  requests fail; Serve starts a replacement. It also answers ``/metrics`` with every live replica's
  metrics summed. It holds no model, and asks Ray for no CPU.

``--address`` joins a running Ray cluster (``ray start --head`` on one machine, ``ray start --address
HEAD:6379`` on the others); without it a local Ray instance is started and stopped with the server.

Threads: each engine replica asks Ray for ``threads`` CPUs and sets PyTorch to that many threads, so that
Ray never places more replicas on a node than its cores allow and replicas do not fight for cores
(:func:`threads_per_replica`: the node's cores divided by the most replicas it may hold, at least 1).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

from genspec.errors import ConfigError, GenspecError
from genspec.serve.settings import EMBEDDED_MODEL_NAME, ServerSettings

#: the name of the Ray Serve application and of its ingress deployment (the router)
DEPLOYMENT = "genspec"
#: the name of the engine replicas' deployment
ENGINE_DEPLOYMENT = "genspec-engine"
#: the response header naming the engine replica that served a request (Serve's replica id)
REPLICA_HEADER = "x-genspec-replica"


def require_ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--backend ray needs Ray Serve: pip install 'genspec[ray]'") from exc


def threads_per_replica(cores: int, replicas: int) -> int:
    """PyTorch threads (and Ray CPUs) per replica when up to ``replicas`` share ``cores`` cores."""
    return max(1, cores // max(1, replicas))


async def asgi_exchange(app, request: dict, extra_headers: list[tuple[bytes, bytes]] = ()):
    """Run one HTTP request through the ASGI ``app`` in this process; yields the app's
    ``http.response.start`` and ``http.response.body`` messages as it sends them. ``request``: method,
    path, query_string, headers (raw pairs), body, and optionally client (host, port). Closing the generator early is a client disconnect:
    the app sees ``http.disconnect`` and its handler is cancelled (a stream frees its engine rows)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request["method"], "scheme": "http", "path": request["path"],
             "raw_path": request["path"].encode(), "query_string": request["query_string"], "root_path": "",
             "headers": list(request["headers"]), "client": request.get("client"), "server": None}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body = [request["body"]]

    async def receive():
        if body:
            return {"type": "http.request", "body": body.pop(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra_headers]}
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task  # the app's own exception, if it raised one
    finally:
        gone.set()
        if not task.done():
            task.cancel()


def engine_class():
    """The engine replicas' class (defined on demand: Ray is an optional extra)."""
    from ray import serve

    class GenspecEngine:
        """One engine and its OpenAI app, in one Ray actor."""

        def __init__(self, settings: ServerSettings, threads: int):
            self.settings, self.threads = settings, threads
            self.replica = serve.get_replica_context().replica_id.unique_id
            loaded, failure = threading.Event(), []
            threading.Thread(target=self._load_and_step, args=(loaded, failure), name="genspec-engine",
                             daemon=True).start()
            loaded.wait()
            if failure:
                raise failure[0]

        def _load_and_step(self, loaded: threading.Event, failure: list) -> None:
            import torch

            from genspec.serve.app import create_app
            from genspec.serve.worker import load_engine

            try:
                torch.set_num_threads(self.threads)
                self.app = create_app(load_engine(self.settings), self.settings, engine_thread=False)
            except BaseException as exc:  # noqa: BLE001 - raised again by __init__, in the actor
                failure.append(exc)
                return
            finally:
                loaded.set()
            self.app.state.server.worker.run()

        async def http(self, request: dict):
            """One HTTP request through this replica's app (see :func:`asgi_exchange`)."""
            async for message in asgi_exchange(self.app, request, [(REPLICA_HEADER.encode(), self.replica.encode())]):
                yield message

        def replica_metrics(self) -> bytes:
            """This replica's own ``/metrics`` body."""
            return self.app.state.server.metrics.exposition()

        def __del__(self):  # Serve calls it at shutdown, after the replica's requests finished or timed out
            app = getattr(self, "app", None)  # absent if loading failed
            if app is not None:
                app.state.server.worker.begin_drain(0.0)

    return GenspecEngine


def router_class():
    """The ingress deployment's class: passes requests to engine replicas, turns a replica's death into an
    OpenAI error, answers ``/metrics`` for the whole service."""
    import ray.exceptions
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse

    from genspec.serve.metrics import merge_expositions
    from genspec.serve.protocol import APIError
    from genspec.serve.requests import read_body
    from genspec.serve.security import Gatekeeper

    replica_failures = ray.exceptions.RayActorError  # ActorDiedError, ActorUnavailableError

    def replica_failed(exc: Exception) -> dict:
        return APIError(f"the genspec replica serving this request stopped ({type(exc).__name__}); the requests it "
                        "was running are lost, others are not: retry", status=503, kind="server_error",
                        code="replica_failed").body()

    class GenspecRouter:
        """``settings``: the engine replicas' :class:`~genspec.serve.settings.ServerSettings`. The router
        checks their key before it reads a body or bothers a replica (and answers ``/metrics`` itself); the
        replicas check it too, and the limits. Bodies over ``max_body_bytes`` are refused before they are read."""

        def __init__(self, engines, settings: ServerSettings | None = None):
            self.engines = engines
            settings = settings or ServerSettings()
            self.max_body_bytes = settings.max_body_bytes
            self.gatekeeper = Gatekeeper(settings.security)

        async def __call__(self, request: Request) -> Response:
            client = (request.client.host, request.client.port) if request.client else None
            who = self.gatekeeper.identify(request.headers.raw, client)
            if isinstance(who, APIError) and self.gatekeeper.protects(request.url.path):
                return JSONResponse(who.body(), status_code=who.status, headers={"WWW-Authenticate": "Bearer"})
            if request.method == "GET" and request.url.path == "/metrics":
                bodies = await self.engines.broadcast("replica_metrics").results_async()
                return Response(merge_expositions(bodies), media_type="text/plain; version=0.0.4; charset=utf-8")
            try:
                body = await read_body(request, self.max_body_bytes)  # the replica's app would refuse it too, later
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
            exchange = {"method": request.method, "path": request.url.path, "query_string": request.url.query.encode(),
                        "headers": request.headers.raw, "body": body, "client": client}
            stream = self.engines.options(stream=True).http.remote(exchange)
            try:
                start = await anext(stream)
            except replica_failures as exc:
                return JSONResponse(replica_failed(exc), status_code=503)
            events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start["headers"])

            async def body():
                done = False
                try:
                    async for message in stream:
                        yield message.get("body", b"")
                    done = True
                except replica_failures as exc:
                    done = True
                    if events:  # the stream's end, in the form the app itself ends a failed stream
                        yield f"data: {json.dumps(replica_failed(exc))}\n\n".encode()
                finally:
                    if not done:  # the client went away: so does the request, on its replica
                        stream.cancel()

            response = StreamingResponse(body(), status_code=start["status"])
            response.raw_headers = list(start["headers"])
            return response

    return GenspecRouter


def deployment(settings: ServerSettings, replicas: int | None, min_replicas: int = 1, max_replicas: int = 2,
               cores: int | None = None):
    """The bound Ray Serve application: ``replicas`` fixed replicas, or (``replicas=None``) autoscaling
    between ``min_replicas`` and ``max_replicas`` on ongoing requests per replica."""
    from ray import serve

    cores = cores or os.cpu_count() or 1
    most = replicas if replicas is not None else max_replicas
    threads = threads_per_replica(cores, most)
    per_replica = settings.max_batch_size + settings.max_queue  # beyond it, the app answers 429
    options = {"ray_actor_options": {"num_cpus": threads}, "max_ongoing_requests": per_replica,
               "graceful_shutdown_timeout_s": settings.grace_s}
    if replicas is not None:
        options["num_replicas"] = replicas
    else:
        options["autoscaling_config"] = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": settings.max_batch_size}
    engines = serve.deployment(engine_class(), name=ENGINE_DEPLOYMENT, **options).bind(settings, threads)
    router = serve.deployment(router_class(), name=DEPLOYMENT, ray_actor_options={"num_cpus": 0},
                              max_ongoing_requests=most * per_replica,
                              graceful_shutdown_timeout_s=settings.grace_s + 5)
    return router.bind(engines, settings)


def app_builder(args: dict):
    """The Ray Serve application for a config file's ``import_path: genspec.serve.ray_backend:app_builder``
    (``serve run``, ``serve deploy``, KubeRay's ``serveConfigV2``; see ``deploy/rayservice.yaml``). ``args``
    (strings, as config files give them): model, drafter, replicas (a number or auto), min_replicas,
    max_replicas, max_batch_size, max_queue, grace_period, served_model_name, cores (CPUs per worker
    machine, for threads per replica), measure_costs (true / false), max_body_bytes; and access: metrics_public
    and insecure_no_api_key (true / false), allowed_origins (comma-separated), and the limits of
    :class:`~genspec.serve.security.ServeSecurity` by their names (max_tokens, requests_per_minute, ...).
    The API key comes from ``$GENSPEC_API_KEY`` (a Kubernetes Secret, never the config file); without
    one the builder refuses, unless insecure_no_api_key is true: a Serve application is reached from
    other machines."""
    from genspec.serve.security import ServeSecurity

    args = {key: str(value) for key, value in (args or {}).items()}
    limits = {"max_prompt_tokens", "max_tokens", "max_n", "max_stop_strings", "max_stop_length",
              "max_streams_per_key", "requests_per_minute", "tokens_per_minute"}
    known = {"model", "kernels", "drafter", "replicas", "min_replicas", "max_replicas", "max_batch_size", "max_queue",
             "grace_period", "served_model_name", "cores", "measure_costs", "max_body_bytes", "metrics_public",
             "allowed_origins", "insecure_no_api_key", *limits}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"unknown genspec application args {unknown}; known: {sorted(known)}")
    key = os.environ.get("GENSPEC_API_KEY", "")
    if not key and args.get("insecure_no_api_key", "false").lower() != "true":
        raise ConfigError("the genspec application needs an API key in $GENSPEC_API_KEY (or insecure_no_api_key: "
                          "\"true\" to serve anyone who reaches it)")
    security = ServeSecurity.with_keys(
        [key], metrics_public=args.get("metrics_public", "false").lower() == "true",
        allowed_origins=tuple(o.strip() for o in args.get("allowed_origins", "").split(",") if o.strip()),
        **{name: int(args[name]) for name in limits if name in args})
    replicas = None if args.get("replicas", "1") == "auto" else int(args.get("replicas", "1"))
    kinds = {"model": str, "kernels": str, "drafter": str, "max_batch_size": int, "max_queue": int, "max_body_bytes": int,
             "grace_period": float}
    given = {("grace_s" if name == "grace_period" else name): kind(args[name]) for name, kind in kinds.items()
             if name in args}
    settings = ServerSettings(**given, served_model_name=args.get("served_model_name", EMBEDDED_MODEL_NAME),
                              measure_costs=args.get("measure_costs", "true").lower() == "true", security=security)
    return deployment(settings, replicas, int(args.get("min_replicas", "1")), int(args.get("max_replicas", "2")),
                      cores=int(args["cores"]) if "cores" in args else None)


def run_ray(settings: ServerSettings, host: str, port: int, replicas: int | None, min_replicas: int, max_replicas: int,
            address: str | None) -> None:
    """Start (or join) Ray, deploy, and serve until SIGTERM / SIGINT; then shut the deployment down
    (and the local Ray instance, if this started it)."""
    require_ray()
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             **({} if address else {"num_cpus": os.cpu_count()}))
    stop = threading.Event()
    previous = {}
    try:
        serve.start(http_options={"host": host, "port": port,
                                  "keep_alive_timeout_s": max(1, round(settings.security.keep_alive))})
        try:
            serve.run(deployment(settings, replicas, min_replicas, max_replicas), name=DEPLOYMENT, route_prefix="/")
        except RuntimeError as exc:  # a replica failed to start: Serve has its traceback in the logs
            raise GenspecError(f"the Ray Serve deployment failed ({str(exc).splitlines()[0]}); the replicas' "
                               "errors are in the Ray session's logs/serve/ directory") from exc
        # installed after Ray's own start-up, which sets handlers that exit with the signal's number
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        while not stop.wait(1.0):  # a timed wait, so the handler always gets to run
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
