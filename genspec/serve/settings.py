"""What a genspec server runs and how: one frozen :class:`ServerSettings`, checked once when it is made.

``genspec serve``'s options build it (:func:`genspec.cli.serve.server_settings`), and so does a Ray Serve
config file (:func:`genspec.serve.ray_backend.app_builder`); :func:`~genspec.serve.worker.load_engine`
loads its model and drafters, :func:`~genspec.serve.app.create_app` serves them with its limits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from genspec.api import check_drafters
from genspec.errors import ConfigError
from genspec.models.llamacpp import Kernels
from genspec.serve.security import ServeSecurity

#: request bodies larger than this are refused (413) unless the server is told otherwise: 2 MiB holds a
#: prompt of about 500,000 tokens as text or 300,000 as token ids, more than the contexts of the models
#: served here, and bounds what parsing one body costs (0.07 s for 3.4 MB of token ids, protocol.py)
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024

#: the API's name of the embedded model
EMBEDDED_MODEL_NAME = "gemma-3-270m"


@dataclass(frozen=True)
class ServerSettings:
    """A server's settings; the defaults are ``genspec serve``'s, and an error names its option.

    The engine: ``model`` (a directory or .gguf file; None: the embedded model) run by ``model_backend``
    (auto, torch or llamacpp) with ``kernels`` (:class:`~genspec.models.llamacpp.Kernels`), its
    default ``drafter`` with ``drafter_options``, ``extra_drafters`` a
    request may choose ({name: options}), ``draft_model``, ``dtype``, ``max_batch_size`` requests decoded
    together, and ``measure_costs``: measure the verify costs by batch size at start.

    The app: ``served_model_name`` (default: the model's file or directory name), ``max_queue`` requests
    that may wait for a batch slot (more get 429), ``grace_s`` seconds requests in flight may take at
    shutdown, ``max_body_bytes`` (larger bodies get 413), ``chat_max_tokens`` a chat without
    ``max_tokens`` may generate (at most the key's ``security.max_tokens``), and ``security``: keys,
    limits, CORS."""

    model: str | None = None
    model_backend: str = "auto"
    kernels: Kernels = Kernels.AUTO
    drafter: str = "prompt-lookup"
    drafter_options: dict = field(default_factory=dict)
    extra_drafters: dict[str, dict] = field(default_factory=dict)
    draft_model: str | None = None
    dtype: str = "float32"
    max_batch_size: int = 8
    measure_costs: bool = True
    served_model_name: str | None = None
    max_queue: int = 64
    grace_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_max_tokens: int = 1024
    security: ServeSecurity = field(default_factory=ServeSecurity)

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_queue < 0 or not self.grace_s >= 0:
            raise ConfigError("--max-batch-size must be >= 1, --max-queue and --grace-period >= 0")
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        object.__setattr__(self, "kernels", Kernels.parse(self.kernels))  # a config file's string
        if self.chat_max_tokens < 1:
            raise ConfigError(f"chat_max_tokens must be >= 1, got {self.chat_max_tokens}")
        # the drafters and their options as genspec.load will build them: refused here, before a replica starts
        check_drafters(self.drafter, self.draft_model, self.drafter_options, self.extra_drafters)

    @property
    def model_name(self) -> str:
        """The model's name in the API."""
        return self.served_model_name or (Path(self.model).name if self.model else EMBEDDED_MODEL_NAME)

    @property
    def default_max_tokens(self) -> int:
        """Tokens a chat request that gives no ``max_tokens`` may generate."""
        return min(self.chat_max_tokens, self.security.max_tokens or self.chat_max_tokens)
