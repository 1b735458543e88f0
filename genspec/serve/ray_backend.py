"""``genspec serve --backend ray``: the same OpenAI app as a Ray Serve deployment.

Each replica is a Ray actor holding one genspec engine with its own continuous batch and the app of
:func:`genspec.serve.app.create_app` (built in the replica, after the engine, through Ray Serve's
deferred ingress); Serve's proxy routes requests between replicas. ``--address`` joins a running Ray
cluster (``ray start --head`` on one machine, ``ray start --address HEAD:6379`` on the others);
without it a local Ray instance is started and stopped with the server.

Threads: each replica asks Ray for ``threads`` CPUs and sets PyTorch to that many threads, so that Ray
never places more replicas on a node than its cores allow and replicas do not fight for cores
(:func:`threads_per_replica`: the node's cores divided by the most replicas it may hold, at least 1).
"""
from __future__ import annotations

import os
import signal
import threading

from genspec.errors import ConfigError, GenspecError


#: the name of the Ray Serve application and of its one deployment
DEPLOYMENT = "genspec"


def require_ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--backend ray needs Ray Serve: pip install 'genspec[ray]'") from exc


def threads_per_replica(cores: int, replicas: int) -> int:
    """PyTorch threads (and Ray CPUs) per replica when up to ``replicas`` share ``cores`` cores."""
    return max(1, cores // max(1, replicas))


def replica_class():
    """The Ray Serve deployment class (defined on demand: Ray is an optional extra)."""
    from ray import serve

    @serve.ingress()
    class GenspecReplica:
        """One engine and its OpenAI app, in one Ray actor."""

        def __init__(self, settings: dict):
            import torch

            from genspec.serve.app import load_engine

            torch.set_num_threads(settings["threads"])
            self.settings = settings
            self.engine = load_engine(settings)

        def __serve_build_asgi_app__(self):
            from genspec.serve.app import create_app

            self.http_app = create_app(self.engine, self.settings["name"], max_queue=self.settings["max_queue"],
                                       grace_s=self.settings["grace_s"], engine_thread=True,
                                       metrics_body=self.service_metrics)
            return self.http_app

        def replica_metrics(self) -> bytes:
            """This replica's own ``/metrics`` body (called on every replica by :meth:`service_metrics`)."""
            return self.http_app.state.server.metrics.exposition()

        async def service_metrics(self) -> bytes:
            """``/metrics`` of the whole service: every live replica's, summed (a scrape lands on one
            replica, which asks all of them)."""
            from genspec.serve.metrics import merge_expositions

            handle = serve.get_deployment_handle(DEPLOYMENT, app_name=DEPLOYMENT)
            return merge_expositions(await handle.broadcast("replica_metrics").results_async())

    return GenspecReplica


def deployment(settings: dict, replicas: int | None, min_replicas: int = 1, max_replicas: int = 2,
               cores: int | None = None):
    """The bound Ray Serve application: ``replicas`` fixed replicas, or (``replicas=None``) autoscaling
    between ``min_replicas`` and ``max_replicas`` on ongoing requests per replica."""
    from ray import serve

    cores = cores or os.cpu_count() or 1
    most = replicas if replicas is not None else max_replicas
    threads = threads_per_replica(cores, most)
    options = {"ray_actor_options": {"num_cpus": threads},
               "max_ongoing_requests": settings["max_batch_size"] + settings["max_queue"]}
    if replicas is not None:
        options["num_replicas"] = replicas
    else:
        options["autoscaling_config"] = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": settings["max_batch_size"]}
    return serve.deployment(replica_class(), name=DEPLOYMENT, **options).bind({**settings, "threads": threads})


def app_builder(args: dict):
    """The Ray Serve application for a config file's ``import_path: genspec.serve.ray_backend:app_builder``
    (``serve run``, ``serve deploy``, KubeRay's ``serveConfigV2``; see ``deploy/rayservice.yaml``). ``args``
    (strings, as config files give them): model, drafter, replicas (a number or auto), min_replicas,
    max_replicas, max_batch_size, max_queue, grace_period, served_model_name, cores (CPUs per worker
    machine, for threads per replica), measure_costs (true / false)."""
    args = {key: str(value) for key, value in (args or {}).items()}
    known = {"model", "drafter", "replicas", "min_replicas", "max_replicas", "max_batch_size", "max_queue",
             "grace_period", "served_model_name", "cores", "measure_costs"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"unknown genspec application args {unknown}; known: {sorted(known)}")
    replicas = None if args.get("replicas", "1") == "auto" else int(args.get("replicas", "1"))
    settings = {"model": args.get("model"), "drafter": args.get("drafter", "prompt-lookup"), "draft_model": None,
                "dtype": "float32", "extra_drafters": {}, "drafter_options": {},
                "max_batch_size": int(args.get("max_batch_size", "8")), "max_queue": int(args.get("max_queue", "64")),
                "grace_s": float(args.get("grace_period", "30")),
                "name": args.get("served_model_name", "gemma-3-270m"),
                "measure_costs": args.get("measure_costs", "true").lower() == "true"}
    return deployment(settings, replicas, int(args.get("min_replicas", "1")), int(args.get("max_replicas", "2")),
                      cores=int(args["cores"]) if "cores" in args else None)


def run_ray(settings: dict, host: str, port: int, replicas: int | None, min_replicas: int, max_replicas: int,
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
        serve.start(http_options={"host": host, "port": port})
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
