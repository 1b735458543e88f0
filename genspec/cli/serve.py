"""``genspec serve``: the OpenAI-compatible server (see :mod:`genspec.serve.app`).

    genspec serve                                       # embedded model, prompt lookup, 127.0.0.1:8000
    genspec serve --model DIR --drafter ngram-cache --extra-drafter prompt-lookup --extra-drafter none
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fib(n):", "max_tokens": 64, "temperature": 0, "speculative": {"num_draft_tokens": 6}}'
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from genspec.api import resolve_backend
from genspec.cli import finite_float
from genspec.cli.options import add_options, parse_option
from genspec.errors import ConfigError, InputFileError


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics, playground)",
        description="Serve a model over HTTP with speculative decoding: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics and a playground at /.",
        epilog="examples:\n" + __doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(serve, "model", "backend", "kernels", backend={
        "flags": ("--model-backend",),
        "help": "what runs the model (genspec generate's --backend): llamacpp, torch, or auto (default: llamacpp for "
                "a .gguf file and for the embedded model when llama-cpp-python is installed); --backend chooses one "
                "process or Ray replicas"})
    serve.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: the "
                                                                    "directory's name, or gemma-3-270m)")
    add_options(serve, "drafter", "drafter_option", drafter={"help": "default drafter of requests (none: no speculation)"},
                drafter_option={"help": "option of the default drafter (repeatable)"})
    serve.add_argument("--extra-drafter", action="append", default=[], metavar="NAME[:KEY=VALUE...]",
                       help="another drafter requests may choose with speculative.drafter (repeatable)")
    add_options(serve, "draft_model")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=8, metavar="B", help="requests decoded together")
    serve.add_argument("--max-queue", type=int, default=64, metavar="Q",
                       help="requests that may wait for a batch slot; more get HTTP 429")
    serve.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                       help="largest request body accepted, in bytes (default 2 MiB); larger ones get HTTP 413")
    serve.add_argument("--grace-period", type=finite_float, default=30.0, metavar="S",
                       help="on SIGTERM, seconds in-flight requests may take to finish before they are cancelled "
                            "(new connections are refused at once)")
    add_options(serve, "dtype", dtype={"choices": ["float32", "bfloat16", "float16"]})
    serve.add_argument("--no-cost-measurement", action="store_true",
                       help="skip measuring verify costs by batch size at start (tens of seconds on the embedded "
                            "model); the draft-length plan then learns them from traffic")
    serve.add_argument("--backend", choices=["local", "ray"], default="local",
                       help="local: one process; ray: replicas behind Ray Serve (needs genspec[ray])")
    serve.add_argument("--replicas", default="1", metavar="N|auto",
                       help="--backend ray: replicas, or auto (autoscale between --min-replicas and --max-replicas)")
    serve.add_argument("--min-replicas", type=int, default=1, metavar="N")
    serve.add_argument("--max-replicas", type=int, default=2, metavar="N")
    serve.add_argument("--address", metavar="HOST:PORT",
                       help="--backend ray: join this Ray cluster (default: start a local one)")
    add_security_arguments(serve)
    serve.set_defaults(func=run_serve)


def add_security_arguments(serve) -> None:
    """Keys, limits, CORS and connection bounds (:mod:`genspec.serve.security`)."""
    from genspec.serve.security import ServeSecurity

    d = ServeSecurity()
    access = serve.add_argument_group("access", "API keys and CORS; needed to bind anything but loopback")
    access.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accept requests with 'Authorization: Bearer KEY' on /v1/* and /metrics (repeatable; "
                             "also $GENSPEC_API_KEY, which keeps the key out of the process list)")
    access.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    access.add_argument("--insecure-no-api-key", action="store_true",
                        help="bind a non-loopback --host without any API key (anyone who reaches it may use it)")
    access.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN...]",
                        help="origins a browser may call the API from (CORS; '*': any). Default: none")
    limits = serve.add_argument_group("limits", "past each, a request gets a 4xx OpenAI error (0: no limit)")
    limits.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, metavar="N",
                        help=f"tokens of a prompt (default {d.max_prompt_tokens})")
    limits.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N",
                        help=f"tokens a request may generate (default {d.max_tokens})")
    limits.add_argument("--max-n", type=int, default=d.max_n, metavar="N", help=f"samples per prompt (default {d.max_n})")
    limits.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, metavar="N",
                        help=f"stop strings of a request (default {d.max_stop_strings})")
    limits.add_argument("--max-stop-length", type=int, default=d.max_stop_length, metavar="CHARS",
                        help=f"characters of a stop string (default {d.max_stop_length})")
    limits.add_argument("--max-streams-per-key", type=int, default=d.max_streams_per_key, metavar="N",
                        help=f"streams open at once per API key (client address without keys; default "
                             f"{d.max_streams_per_key}); more get 429")
    limits.add_argument("--requests-per-minute", type=int, default=d.requests_per_minute, metavar="N",
                        help=f"per API key, or per client address without keys (token bucket; default "
                             f"{d.requests_per_minute}); more get 429 with Retry-After")
    limits.add_argument("--tokens-per-minute", type=int, default=d.tokens_per_minute, metavar="N",
                        help=f"per API key (client address without keys), counting prompt tokens + n x max_tokens "
                             f"(default {d.tokens_per_minute})")
    limits.add_argument("--keep-alive", type=float, default=d.keep_alive, metavar="S",
                        help=f"seconds an idle connection stays open (default {d.keep_alive:g})")
    limits.add_argument("--read-timeout", type=float, default=d.read_timeout, metavar="S",
                        help=f"seconds a request's headers and body may take to arrive (default {d.read_timeout:g})")
    limits.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                        help=f"connections and requests at once; more get 503 (default {d.max_connections})")


def security_settings(args, environ=os.environ):
    """The :class:`~genspec.serve.security.ServeSecurity` of ``genspec serve``'s flags; refuses a non-loopback
    ``--host`` without a key unless ``--insecure-no-api-key`` (then warns)."""
    from genspec.serve.security import ServeSecurity, is_loopback

    keys = [*args.api_key, *([environ["GENSPEC_API_KEY"]] if environ.get("GENSPEC_API_KEY") else [])]
    if any(not key.strip() or any(c.isspace() for c in key) for key in keys):
        raise ConfigError("an API key must be non-empty and contain no spaces")
    if not keys and not is_loopback(args.host):
        if not args.insecure_no_api_key:
            raise ConfigError(f"--host {args.host} serves other machines: give an API key (--api-key KEY or "
                              "$GENSPEC_API_KEY), or pass --insecure-no-api-key to serve anyone who reaches it")
        print(f"genspec: warning: serving {args.host} without an API key: anyone who reaches it may use it",
              file=sys.stderr)
    origins = tuple(o.strip() for spec in args.allowed_origins for o in spec.split(",") if o.strip())
    return ServeSecurity.with_keys(
        keys, metrics_public=args.metrics_public, allowed_origins=origins, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens, max_n=args.max_n, max_stop_strings=args.max_stop_strings,
        max_stop_length=args.max_stop_length, max_streams_per_key=args.max_streams_per_key,
        requests_per_minute=args.requests_per_minute, tokens_per_minute=args.tokens_per_minute,
        keep_alive=args.keep_alive, read_timeout=args.read_timeout, max_connections=args.max_connections)


def extra_drafters(specs: list[str]) -> dict[str, dict]:
    """``NAME[:KEY=VALUE...]`` -> {name: options}."""
    out = {}
    for spec in specs:
        name, *options = spec.split(":")
        if not name:
            raise ConfigError(f"--extra-drafter needs a drafter name, got {spec!r}")
        out[name.strip()] = dict(parse_option(o) for o in options)
    return out


def server_settings(args):
    """The :class:`~genspec.serve.settings.ServerSettings` of ``genspec serve``'s flags."""
    from genspec.serve.settings import ServerSettings

    security = security_settings(args)
    model_backend = resolve_backend(args.model, args.model_backend, args.dtype).value  # a bad pair fails early
    return ServerSettings(
        model=args.model, model_backend=model_backend, kernels=args.kernels, drafter=args.drafter,
        draft_model=args.draft_model, dtype=args.dtype, extra_drafters=extra_drafters(args.extra_drafter),
        drafter_options=dict(parse_option(o) for o in args.drafter_option), max_batch_size=args.max_batch_size,
        measure_costs=not args.no_cost_measurement, served_model_name=args.served_model_name,
        max_queue=args.max_queue, grace_s=args.grace_period,
        **({} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}), security=security)


def run_serve(args) -> int:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    settings = server_settings(args)
    if args.backend == "ray":
        return _run_ray(args, settings)

    from genspec.serve.app import create_app, run_server
    from genspec.serve.worker import load_engine

    with Console(stderr=True).status("loading the model") as status:
        engine = load_engine(settings, progress=lambda text: status.update(text))
    run_server(create_app(engine, settings, engine_thread=False), args.host, args.port)
    return 0


def _run_ray(args, settings) -> int:
    from genspec.serve.ray_backend import require_ray, run_ray

    if args.replicas == "auto":
        replicas = None
        if not 1 <= args.min_replicas <= args.max_replicas:
            raise ConfigError("--min-replicas and --max-replicas need 1 <= min <= max")
    else:
        try:
            replicas = int(args.replicas)
        except ValueError:
            raise ConfigError(f"--replicas takes a number or auto, got {args.replicas!r}") from None
        if replicas < 1:
            raise ConfigError("--replicas must be >= 1")
    if args.model and settings.model_backend == "torch" and not (Path(args.model) / "config.json").is_file():
        raise InputFileError(f"no model at {args.model}: expected a directory with config.json and weights")
    if args.model and settings.model_backend == "llamacpp" and not Path(args.model).is_file():
        raise InputFileError(f"no GGUF model at {args.model}")
    require_ray()
    run_ray(settings, args.host, args.port, replicas, args.min_replicas, args.max_replicas, args.address)
    return 0
