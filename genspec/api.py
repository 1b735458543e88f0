"""High-level entry points: load a target (the embedded default or a local path) and a drafter by name.

    >>> import genspec
    >>> engine = genspec.load(drafter="prompt-lookup")          # embedded Gemma 3 270M
    >>> engine.generate("The capital of France is", max_new_tokens=20)[0].text
"""
from __future__ import annotations

import enum
import importlib.util
import os
import types
import typing
from collections.abc import Callable, Mapping

from genspec.drafters import DraftModelDrafter, Drafter, PromptLookupDrafter
from genspec.drafters.edit import EditDrafter
from genspec.drafters.head import HeadDrafter
from genspec.drafters.distilled import DistilledDrafter
from genspec.drafters.hybrid import HybridDrafter
from genspec.drafters.medusa import MedusaDrafter
from genspec.drafters.hierarchical import HierarchicalDrafter
from genspec.drafters.lookahead import LookaheadDrafter
from genspec.drafters.ngram_cache import NGramCacheDrafter
from genspec.drafters.retrieval import RetrievalDrafter
from genspec.drafters.self_speculation import EarlyExitDrafter, LayerSkipDrafter, QuantizedDrafter
from genspec.drafters.suffix import SuffixDrafter
from genspec.checks import integer
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM, parse_device, parse_dtype


#: dtypes the embedded model cannot run in, and why. float16: Gemma 3's residual stream outgrows float16's
#: largest value (65,504): after layer 6 its largest activation is 54,688, layer 7's is inf, and every
#: logit is NaN from then on, on any prompt (also in transformers' own forward; float16 is not a CPU
#: limitation, bfloat16 has float32's range). Measured with ``python benchmarks/costs/nan_check_cost.py --dtypes``.
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
    target's hidden states or reuse its weights need torch), or ``auto``: llamacpp for a ``.gguf`` path and
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
    is_gguf = path is not None and str(path).endswith(".gguf")
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
               backend: "str | Backend" = Backend.AUTO, max_rows: int | None = None) -> CausalLM:
    """A target model from a local directory or GGUF file, or the embedded default (Gemma 3 270M) if ``path``
    is None, on ``backend`` (see :class:`Backend`). A dtype or device that cannot work is refused before anything
    loads; ``max_rows`` sizes a llamacpp model's sequences (default 8)."""
    backend = resolve_backend(path, backend, dtype)
    parse_device(device)
    if backend is Backend.LLAMACPP:
        if dtype != "float32":
            raise ConfigError(f"dtype {dtype} applies to the torch backend; a GGUF model keeps its own quantisation")
        from genspec.models.llamacpp import LlamaCppLM

        if path is None:
            from genspec.models.default import default_gguf_path

            gguf = default_gguf_path()
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, local_files_only=True)
            return LlamaCppLM(gguf, tokenizer, max_rows=max_rows or 8, device=device)
        return LlamaCppLM.from_gguf(path, max_rows=max_rows or 8, device=device)
    check_dtype(path, dtype)
    if path is None:
        from genspec.models.default import default_model_dir

        path = default_model_dir()  # verified against its checksums, rebuilt if damaged
        try:
            return HFCausalLM.from_pretrained(path, dtype=dtype, device=device)
        except InputFileError as exc:
            raise InputFileError(f"{exc} (the default model's cache: delete {path} to rebuild it, or set "
                                 f"$GENSPEC_CACHE to use another directory)") from exc
    return HFCausalLM.from_pretrained(path, dtype=dtype, device=device)


def model_context(path: str | None = None, backend: "str | Backend" = Backend.AUTO) -> int | None:
    """The context length (tokens) of the model at ``path`` (None: the embedded one) on ``backend``, read
    without loading weights; None if it says none or cannot be read (loading then reports why)."""
    if resolve_backend(path, backend) is Backend.LLAMACPP:
        from genspec.models.llamacpp import DEFAULT_CONTEXT, gguf_context

        return DEFAULT_CONTEXT if path is None else gguf_context(path)
    if path is None:
        from genspec.models.default import default_model_dir

        path = default_model_dir()
    return HFCausalLM.context_of(path)


#: drafter name -> its factory ``for_target(target, **options)``; ``none`` means plain decoding
DRAFTERS: dict[str, Callable[..., Drafter] | None] = {
    "none": None,
    "prompt-lookup": PromptLookupDrafter.for_target,
    "draft-model": DraftModelDrafter.for_target,
    "early-exit": EarlyExitDrafter.for_target,
    "layer-skip": LayerSkipDrafter.for_target,
    "quantized": QuantizedDrafter.for_target,
    "hierarchical": HierarchicalDrafter.for_target,
    "ngram-cache": NGramCacheDrafter.for_target,
    "suffix": SuffixDrafter.for_target,
    "retrieval": RetrievalDrafter.for_target,
    "edit": EditDrafter.for_target,
    "lookahead": LookaheadDrafter.for_target,
    "head": HeadDrafter.for_target,
    "hybrid": HybridDrafter.for_target,
    "medusa": MedusaDrafter.for_target,
    "draft": DistilledDrafter.for_target,
}


def _check_option_types(name: str, factory: Callable, options: Mapping[str, object]) -> None:
    """A clear error for an option of the wrong type (``-O first_threshold=abc``), judged by the factory's
    annotations where they name plain types; an int passes for a float."""
    try:
        hints = typing.get_type_hints(factory)
    except (NameError, TypeError):  # annotations that do not resolve: left to the factory
        return
    for key, value in options.items():
        want = hints.get(key)
        allowed = typing.get_args(want) if isinstance(want, types.UnionType) else (want,)
        if not all(isinstance(t, type) for t in allowed):
            continue  # a generic such as list[str]: left to the factory
        accepted = allowed + ((int,) if float in allowed else ())
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in allowed):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(f"drafter {name!r} option {key}={value!r}: expected {names}")


def check_drafter(name: str, options: Mapping[str, object] | None = None) -> None:
    """Refuse, before anything loads, an unknown drafter name and the draft-model drafter without a draft model."""
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose from: {', '.join(DRAFTERS)}")
    if name == "draft-model" and (options or {}).get("draft_model") is None:
        raise ConfigError("drafter 'draft-model' needs a draft model (--draft-model PATH)")


def build_drafter(name: str, target: CausalLM, **options) -> Drafter | None:
    """The drafter called ``name`` for ``target`` (None for ``"none"``)."""
    check_drafter(name, options)
    factory = DRAFTERS[name]
    if factory is None:
        return None
    _check_option_types(name, factory, options)
    try:
        return factory(target, **options)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise ConfigError(f"drafter {name!r} does not take option {str(exc).split('argument')[-1].strip()}") from exc
        raise


def load(model: str | None = None, drafter: str = "prompt-lookup", draft_model: str | None = None,
         dtype: str = "float32", device: str = "cpu", extra_drafters: Mapping[str, Mapping] | None = None,
         max_batch_size: int | None = None, backend: "str | Backend" = Backend.AUTO,
         **drafter_options) -> SpeculativeEngine:
    """A ready :class:`SpeculativeEngine`: target from ``model`` (default: embedded) on ``backend``, drafter
    by name.

    ``extra_drafters`` (name -> options) adds drafters a request may pick instead of the default with
    ``GenerationConfig(drafter=NAME)``; ``max_batch_size`` caps the running batch.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a model directory's path (or None: the embedded model), got {model!r}")
    extra_drafters = {} if extra_drafters is None else extra_drafters
    if not (isinstance(extra_drafters, Mapping) and all(isinstance(o, Mapping) for o in extra_drafters.values())):
        raise ConfigError(f"extra_drafters must map drafter names to option mappings, got {extra_drafters!r}")
    if max_batch_size is not None:
        integer("max_batch_size", max_batch_size, minimum=1)
    extra = {name: dict(options) for name, options in extra_drafters.items()}
    for name in [drafter, *extra]:  # fail before loading anything
        check_drafter(name, {"draft_model": draft_model, **extra.get(name, {})})
    target = load_model(model, dtype=dtype, device=device, backend=backend, max_rows=max_batch_size)
    if draft_model is not None:
        drafter_options["draft_model"] = draft_model
        for name, options in extra.items():
            if name in ("draft-model", "hierarchical"):
                options.setdefault("draft_model", draft_model)
    default = build_drafter(drafter, target, **drafter_options)
    others = {name: build_drafter(name, target, **options) for name, options in extra.items() if name != "none"}
    return SpeculativeEngine(target, default, drafters=others, max_batch_size=max_batch_size)
