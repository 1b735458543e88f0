"""``genspec serve``: an OpenAI-compatible server where each request chooses its speculation.

:mod:`~genspec.serve.app` (routes), :mod:`~genspec.serve.protocol` (request / response shapes),
:mod:`~genspec.serve.worker` (the engine's thread), :mod:`~genspec.serve.metrics` (Prometheus).
"""
