"""``genspec serve``: the OpenAI-compatible server (see :mod:`genspec.serve.app`).

    genspec serve                                       # embedded model, prompt lookup, 127.0.0.1:8000
    genspec serve --model DIR --drafter ngram-cache --extra-drafter prompt-lookup --extra-drafter none
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fib(n):", "max_tokens": 64, "temperature": 0, "speculative": {"num_draft_tokens": 6}}'
"""
from __future__ import annotations

import argparse
from pathlib import Path

from genspec.cli import finite_float
from genspec.cli.generate import parse_option
from genspec.errors import ConfigError, InputFileError


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics, playground)",
        description="Serve a model over HTTP with speculative decoding: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics and a playground at /.",
        epilog="examples:\n" + __doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--model", metavar="PATH", help="local model directory (default: embedded Gemma 3 270M)")
    serve.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: the "
                                                                    "directory's name, or gemma-3-270m)")
    serve.add_argument("--drafter", default="prompt-lookup", help="default drafter of requests (none: no speculation)")
    serve.add_argument("-O", "--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                       help="option of the default drafter (repeatable)")
    serve.add_argument("--extra-drafter", action="append", default=[], metavar="NAME[:KEY=VALUE...]",
                       help="another drafter requests may choose with speculative.drafter (repeatable)")
    serve.add_argument("--draft-model", metavar="PATH", help="draft model directory (drafter draft-model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=8, metavar="B", help="requests decoded together")
    serve.add_argument("--max-queue", type=int, default=64, metavar="Q",
                       help="requests that may wait for a batch slot; more get HTTP 429")
    serve.add_argument("--grace-period", type=finite_float, default=30.0, metavar="S",
                       help="on SIGTERM, seconds in-flight requests may take to finish before they are cancelled")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
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
    serve.set_defaults(func=run_serve)


def extra_drafters(specs: list[str]) -> dict[str, dict]:
    """``NAME[:KEY=VALUE...]`` -> {name: options}."""
    out = {}
    for spec in specs:
        name, *options = spec.split(":")
        if not name:
            raise ConfigError(f"--extra-drafter needs a drafter name, got {spec!r}")
        out[name.strip()] = dict(parse_option(o) for o in options)
    return out


def run_serve(args) -> int:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch_size < 1 or args.max_queue < 0 or args.grace_period < 0:
        raise ConfigError("--max-batch-size must be >= 1, --max-queue and --grace-period >= 0")
    settings = {"model": args.model, "drafter": args.drafter, "draft_model": args.draft_model, "dtype": args.dtype,
                "extra_drafters": extra_drafters(args.extra_drafter),
                "drafter_options": dict(parse_option(o) for o in args.drafter_option),
                "max_batch_size": args.max_batch_size, "max_queue": args.max_queue, "grace_s": args.grace_period,
                "name": args.served_model_name or (Path(args.model).name if args.model else "gemma-3-270m"),
                "measure_costs": not args.no_cost_measurement}
    if args.backend == "ray":
        return _run_ray(args, settings)
    from rich.console import Console

    from genspec.serve.app import create_app, load_engine, run_server

    with Console(stderr=True).status("loading the model") as status:
        engine = load_engine(settings, progress=lambda text: status.update(text))
    app = create_app(engine, settings["name"], max_queue=args.max_queue, grace_s=args.grace_period,
                     engine_thread=False)
    run_server(app, args.host, args.port, args.grace_period)
    return 0


def _run_ray(args, settings: dict) -> int:
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
    if args.model and not (Path(args.model) / "config.json").is_file():  # before any replica tries it
        raise InputFileError(f"no model at {args.model}: expected a directory with config.json and weights")
    require_ray()
    run_ray(settings, args.host, args.port, replicas, args.min_replicas, args.max_replicas, args.address)
    return 0
