"""High-level entry points: load a target (the embedded default or a local path) and a drafter by name.

    >>> import genspec
    >>> engine = genspec.load(drafter="prompt-lookup")          # embedded Gemma 3 270M
    >>> engine.generate("The capital of France is", max_new_tokens=20)[0].text
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from genspec.drafters import DraftModelDrafter, Drafter, PromptLookupDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models import variants
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu") -> HFCausalLM:
    """A target model from a local directory, or the embedded default (Gemma 3 270M) if ``path`` is None."""
    if path is None:
        from genspec.models.default import default_model_dir

        path = default_model_dir()
    return HFCausalLM.from_pretrained(path, dtype=dtype, device=device)


def _draft_model(target: CausalLM, draft_model: str | CausalLM | None = None, num_drafts: int = 1,
                 confidence_threshold: float = 0.0):
    if draft_model is None:
        raise ConfigError("drafter 'draft-model' needs a draft model (--draft-model PATH)")
    model = draft_model if isinstance(draft_model, CausalLM) else HFCausalLM.from_pretrained(draft_model)
    if model.vocab_size != target.vocab_size:
        raise ConfigError(f"draft and target vocabularies differ ({model.vocab_size} vs {target.vocab_size}); "
                          "they must share the tokenizer")
    return DraftModelDrafter(model, num_drafts=num_drafts, confidence_threshold=confidence_threshold)


def _prompt_lookup(target: CausalLM, **options):
    return PromptLookupDrafter.for_target(target, **options)


def _model_free(module: str, class_name: str):
    """Factory of a model-free drafter, imported on first use: ``Class.for_target(target, **options)``."""

    def factory(target: CausalLM, **options):
        import importlib

        return getattr(importlib.import_module(module), class_name).for_target(target, **options)

    return factory


def _read_vocab_file(path: str | None):
    """Token ids (a JSON list, or {"token_ids": [...]}) for a truncated-vocabulary draft head."""
    if path is None:
        return None
    import json

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise InputFileError(f"draft vocabulary file not found: {path}") from exc
    except (OSError, ValueError) as exc:
        raise InputFileError(f"cannot read draft vocabulary file {path}: {exc}") from exc
    ids = data.get("token_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise InputFileError(f"{path}: expected a non-empty JSON list of token ids")
    return ids


def _self_draft(make_model):
    """Factory for a drafter that drafts with a variant of the target itself."""

    def factory(target: CausalLM, draft_vocab_file: str | None = None, confidence_threshold: float = 0.0,
                num_drafts: int = 1, **variant_options):
        if not isinstance(target, HFCausalLM):
            raise ConfigError("self-speculation needs a Hugging Face target model")
        model = make_model(target, vocab_subset=_read_vocab_file(draft_vocab_file), **variant_options)
        return DraftModelDrafter(model, num_drafts=num_drafts, confidence_threshold=confidence_threshold)

    return factory


def _early_exit_model(target, vocab_subset=None, exit_layer: int | str | None = None):
    if isinstance(exit_layer, str):  # a file written by ``genspec calibrate early-exit``
        exit_layer = _read_calibration(exit_layer, "exit_layer", int)
    return variants.early_exit(target, exit_layer or max(1, variants.num_layers(target) // 4), vocab_subset)


def _layer_skip_model(target, vocab_subset=None, skip: list[int] | str | None = None):
    if skip is None:
        total = variants.num_layers(target)
        skip = list(range(1, total - 1, 2))  # every other middle layer, until calibrated
    elif isinstance(skip, str):  # a calibration file
        skip = load_layer_skip(skip)
    return variants.layer_skip(target, list(skip), vocab_subset)


def load_layer_skip(path: str) -> list[int]:
    """The layer set saved by ``genspec calibrate layer-skip`` (JSON ``{"skip": [...]}``)."""
    skip = _read_calibration(path, "skip", list)
    if not all(isinstance(i, int) for i in skip):
        raise InputFileError(f'{path}: "skip" must be a list of layer indices')
    return skip


def _read_calibration(path: str, key: str, kind: type):
    """``data[key]`` of a calibration JSON file, checked to be of type ``kind``."""
    import json

    try:
        value = json.loads(Path(path).read_text())[key]
    except FileNotFoundError as exc:
        raise InputFileError(f"calibration file not found: {path}") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputFileError(f'{path}: not a calibration file with a "{key}" entry') from exc
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputFileError(f'{path}: "{key}" must be a {kind.__name__}')
    return value


def _hierarchical(target: CausalLM, levels: list[str] | str = ("prompt-lookup", "quantized"),
                  draft_model: str | None = None):
    """Stack drafters: ``levels[0]`` drafts for ``levels[1]``, ..., the last level drafts for the target.
    Every level but the first must be model-based."""
    names = levels.split(",") if isinstance(levels, str) else list(levels)
    if len(names) < 2:
        raise ConfigError("hierarchical drafting needs at least two levels, e.g. prompt-lookup,quantized")
    drafter = None
    for depth, name in enumerate(names):
        if name in ("hierarchical", "none") or name not in DRAFTERS:
            raise ConfigError(f"unknown or unstackable level {name!r} in hierarchical levels")
        options = {"draft_model": draft_model} if name == "draft-model" else {}
        level = build_drafter(name, target, **options)
        if depth > 0:
            if not isinstance(level, DraftModelDrafter):
                raise ConfigError(f"level {name!r} cannot verify another drafter: only model-based levels "
                                  "(draft-model, early-exit, layer-skip, quantized) can")
            level.inner = drafter
        drafter = level
    return drafter


#: drafter name -> factory(target, **options). ``none`` means plain decoding.
DRAFTERS: dict[str, Callable[..., Drafter] | None] = {
    "none": None,
    "prompt-lookup": _prompt_lookup,
    "draft-model": _draft_model,
    "early-exit": _self_draft(_early_exit_model),
    "layer-skip": _self_draft(_layer_skip_model),
    "quantized": _self_draft(variants.quantized),
    "hierarchical": _hierarchical,
    "ngram-cache": _model_free("genspec.drafters.ngram_cache", "NGramCacheDrafter"),
    "retrieval": _model_free("genspec.drafters.retrieval", "RetrievalDrafter"),
    "edit": _model_free("genspec.drafters.edit", "EditDrafter"),
    "lookahead": _model_free("genspec.drafters.lookahead", "LookaheadDrafter"),
}


def build_drafter(name: str, target: CausalLM, **options) -> Drafter | None:
    """The drafter called ``name`` for ``target`` (None for ``"none"``)."""
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose from: {', '.join(DRAFTERS)}")
    factory = DRAFTERS[name]
    if factory is None:
        return None
    try:
        return factory(target, **options)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise ConfigError(f"drafter {name!r} does not take option {str(exc).split('argument')[-1].strip()}") from exc
        raise


def load(model: str | None = None, drafter: str = "prompt-lookup", draft_model: str | None = None,
         dtype: str = "float32", device: str = "cpu", **drafter_options) -> SpeculativeEngine:
    """A ready :class:`SpeculativeEngine`: target from ``model`` (default: embedded), drafter by name."""
    if drafter not in DRAFTERS:  # fail before loading anything
        raise ConfigError(f"unknown drafter {drafter!r}; choose from: {', '.join(DRAFTERS)}")
    if drafter == "draft-model" and draft_model is None:
        raise ConfigError("drafter 'draft-model' needs a draft model (--draft-model PATH)")
    target = load_model(model, dtype=dtype, device=device)
    if draft_model is not None:
        drafter_options["draft_model"] = draft_model
    return SpeculativeEngine(target, build_drafter(drafter, target, **drafter_options))
