"""The server's routes, one module per family: :mod:`.completions` (``POST /v1/completions``),
:mod:`.chat` (``POST /v1/chat/completions``) and :mod:`.info` (``GET /v1/models``, ``/health``,
``/metrics`` and the playground page at ``/``). Each holds a FastAPI ``router``; what they share is
:class:`~genspec.serve.service.Service`.
"""
