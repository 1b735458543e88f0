"""High-level entry points: load a target (the embedded default or a local path) and a drafter by name.

    >>> import genspec
    >>> engine = genspec.load(drafter="prompt-lookup")          # embedded Gemma 3 270M
    >>> engine.generate("The capital of France is", max_new_tokens=20)[0].text
"""
from __future__ import annotations

import enum
import importlib.util
import os
from collections.abc import Mapping

from genspec.calibration import calibrate_engine
from genspec.checks import integer
from genspec.drafters.registry import DRAFTERS, build_drafter, check_drafter  # noqa: F401 (genspec.api.DRAFTERS)
from genspec.embedded import default_gguf_path, default_model_dir
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models import gguf_file
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM, parse_device, parse_dtype
from genspec.models.llamacpp import DEFAULT_CONTEXT, Kernels, LlamaCppLM, gguf_context


#: dtypes the embedded model cannot run in, and why. float16: Gemma 3's residual stream outgrows float16's
#: largest value (65,504): after layer 6 its largest activation is 54,688, layer 7's is inf, and every
#: logit is NaN from then on, on any prompt (also in transformers' own forward; float16 is not a CPU
#: limitation, bfloat16 has float32's range; the manual's Getting started page names the script that shows it).
EMBEDDED_MODEL_FAILS_IN = {"float16": "its activations exceed float16's largest value (65,504) from layer 7 on, "
                                      "so every logit is NaN"}


def check_dtype(path: str | None, dtype: str) -> None:
    """Refuse a dtype no model loads in, or one the model cannot run in (known for the embedded one:
    ``path`` None), before loading."""
    parse_dtype(dtype)
    if path is None and dtype in EMBEDDED_MODEL_FAILS_IN:
        raise ConfigError(f"dtype {dtype} cannot work with the embedded Gemma 3 270M: "
                          f"{EMBEDDED_MODEL_FAILS_IN[dtype]}; use float32 (the default) or bfloat16")


class Backend(str, enum.Enum):
    """What runs the target model: ``torch`` (Hugging Face transformers: any local model directory, every
    drafter, GPUs), ``llamacpp`` (llama.cpp on a GGUF file: the fastest on a CPU; drafters that read the
    target's hidden states or reuse its weights need torch), or ``auto``: llamacpp for a GGUF file (by its
    magic bytes, or a ``.gguf`` extension in any case: :func:`genspec.models.gguf_file.is_gguf`) and
    for the embedded model when llama-cpp-python is installed, torch otherwise."""

    AUTO = "auto"
    TORCH = "torch"
    LLAMACPP = "llamacpp"

    @classmethod
    def parse(cls, value: "str | Backend") -> "Backend":
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown backend {value!r}; choose from: {', '.join(b.value for b in cls)}") from None


def resolve_backend(path: str | None, backend: "str | Backend" = Backend.AUTO, dtype: str = "float32") -> Backend:
    """The backend that will run the model at ``path`` (None: the embedded one), ``auto`` resolved (a dtype
    other than float32 is the torch backend's: a GGUF file keeps its own quantisation)."""
    backend = Backend.parse(backend)
    is_gguf = gguf_file.is_gguf(path)  # by its magic bytes, or by its extension in any case
    if backend is Backend.AUTO:
        if is_gguf:
            return Backend.LLAMACPP
        if path is None and dtype == "float32" and importlib.util.find_spec("llama_cpp") is not None:
            return Backend.LLAMACPP
        return Backend.TORCH
    if backend is Backend.TORCH and is_gguf:
        raise ConfigError(f"{path} is a GGUF file: it runs on the llamacpp backend (--backend llamacpp)")
    if backend is Backend.LLAMACPP and path is not None and not is_gguf:
        raise ConfigError(f"the llamacpp backend runs a .gguf file; {path} is not one (use --backend torch for a "
                          "Hugging Face model directory)")
    return backend


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu",
               backend: "str | Backend" = Backend.AUTO, max_rows: int | None = None,
               kernels: str | Kernels = Kernels.AUTO) -> CausalLM:
    """A target model from a local directory or GGUF file, or the embedded default (Gemma 3 270M) if ``path``
    is None, on ``backend`` (see :class:`Backend`). A dtype or device that cannot work is refused before anything
    loads; ``max_rows`` sizes a llamacpp model's sequences (default 8); ``kernels`` picks the model's
    (:class:`~genspec.models.llamacpp.Kernels`: exact or exact-tiled, whose logits do not depend on the batch, fast,
    or auto, the backend's default: exact on llamacpp, fast on torch)."""
    backend = resolve_backend(path, backend, dtype)
    parse_device(device)
    kernels = Kernels.parse(kernels)
    if backend is Backend.LLAMACPP:
        if dtype != "float32":
            raise ConfigError(f"dtype {dtype} applies to the torch backend; a GGUF model keeps its own quantisation")
        if path is None:
            gguf = default_gguf_path()
            from transformers import AutoTokenizer  # here: seconds that `import genspec` does not spend otherwise

            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, local_files_only=True)
            return LlamaCppLM(gguf, tokenizer, max_rows=max_rows or 8, device=device, kernels=kernels)
        return LlamaCppLM.from_gguf(path, max_rows=max_rows or 8, device=device, kernels=kernels)
    check_dtype(path, dtype)
    exact = kernels.on_torch()
    if path is None:
        path = default_model_dir()  # verified against its checksums, rebuilt if damaged
        try:
            return HFCausalLM.from_pretrained(path, dtype=dtype, device=device, exact=exact)
        except InputFileError as exc:
            raise InputFileError(f"{exc} (the default model's cache: delete {path} to rebuild it, or set "
                                 f"$GENSPEC_CACHE to use another directory)") from exc
    return HFCausalLM.from_pretrained(path, dtype=dtype, device=device, exact=exact)


def model_context(path: str | None = None, backend: "str | Backend" = Backend.AUTO) -> int | None:
    """The context length (tokens) of the model at ``path`` (None: the embedded one) on ``backend``, read
    without loading weights; None if it says none or cannot be read (loading then reports why)."""
    if resolve_backend(path, backend) is Backend.LLAMACPP:
        return DEFAULT_CONTEXT if path is None else gguf_context(path)
    if path is None:
        path = default_model_dir()
    return HFCausalLM.context_of(path)


def check_drafters(drafter: str, draft_model: str | None = None, drafter_options: Mapping | None = None,
                   extra_drafters: Mapping[str, Mapping] | None = None) -> tuple[dict, dict[str, dict]]:
    """The options an engine's drafters are built with, checked without loading anything (:func:`check_drafter`):
    those of the default ``drafter`` and of each of ``extra_drafters`` (name -> options), ``draft_model`` given to
    the default drafter (but ``none``) and to an extra ``draft-model`` or ``hierarchical``. What :func:`load`
    builds; a server checks its settings with it before it starts."""
    extra_drafters = {} if extra_drafters is None else extra_drafters
    if not (isinstance(extra_drafters, Mapping) and all(isinstance(o, Mapping) for o in extra_drafters.values())):
        raise ConfigError(f"extra_drafters must map drafter names to option mappings, got {extra_drafters!r}")
    default = dict(drafter_options or {})
    extra = {name: dict(options) for name, options in extra_drafters.items()}
    if draft_model is not None:
        if drafter != "none":
            default["draft_model"] = draft_model
        for name, options in extra.items():
            if name in ("draft-model", "hierarchical"):
                options.setdefault("draft_model", draft_model)
    for name, options in [(drafter, default), *extra.items()]:
        check_drafter(name, options)
    return default, extra


def load(model: str | None = None, drafter: str = "prompt-lookup", draft_model: str | None = None,
         dtype: str = "float32", device: str = "cpu", extra_drafters: Mapping[str, Mapping] | None = None,
         max_batch_size: int | None = None, backend: "str | Backend" = Backend.AUTO,
         measure_costs: bool | None = None, kernels: str | Kernels = Kernels.AUTO,
         **drafter_options) -> SpeculativeEngine:
    """A ready :class:`SpeculativeEngine`: target from ``model`` (default: embedded) on ``backend``, drafter
    by name.

    ``extra_drafters`` (name -> options) adds drafters a request may pick instead of the default with
    ``GenerationConfig(drafter=NAME)``; ``max_batch_size`` caps the running batch; ``kernels`` the
    target's (:func:`load_model`). ``measure_costs``: time
    one row's verify blocks before returning (:func:`genspec.calibration.calibrate_engine`; about a second
    on llama.cpp); None (default) does so where the target's cost is uneven in the block width (llama.cpp),
    elsewhere the engine measures its costs as it runs.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a model directory's path (or None: the embedded model), got {model!r}")
    if max_batch_size is not None:
        integer("max_batch_size", max_batch_size, minimum=1)
    drafter_options, extra = check_drafters(drafter, draft_model, drafter_options, extra_drafters)  # before loading
    target = load_model(model, dtype=dtype, device=device, backend=backend, max_rows=max_batch_size,
                        kernels=kernels)
    default = build_drafter(drafter, target, **drafter_options)
    others = {name: build_drafter(name, target, **options) for name, options in extra.items() if name != "none"}
    engine = SpeculativeEngine(target, default, drafters=others, max_batch_size=max_batch_size)
    if measure_costs or (measure_costs is None and target.uneven_verify_cost):
        calibrate_engine(engine)
    return engine
