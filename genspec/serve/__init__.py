"""``genspec serve``: an OpenAI-compatible server where each request chooses its speculation.

:mod:`~genspec.serve.app` (the app; its module docstring says where each part is),
:mod:`~genspec.serve.settings` (the server's settings), :mod:`~genspec.serve.routes` (one module per route
family), :mod:`~genspec.serve.protocol` (request / response shapes), :mod:`~genspec.serve.worker` (the
engine's thread), :mod:`~genspec.serve.metrics` (Prometheus).
"""
