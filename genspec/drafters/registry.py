"""The drafter registry: every drafter by name (``--drafter NAME``), its options checked, built for a target."""
from __future__ import annotations

import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path

from genspec.drafters.base import Drafter
from genspec.drafters.cross_tokenizer import MIN_SHARED, CrossTokenizerDrafter, same_tokenizer
from genspec.drafters.distilled import DistilledDrafter
from genspec.drafters.draft_model import DraftModelDrafter
from genspec.drafters.edit import EditDrafter
from genspec.drafters.head import HeadDrafter
from genspec.drafters.hierarchical import DEFAULT_LEVELS, HierarchicalDrafter
from genspec.drafters.hybrid import HybridDrafter
from genspec.drafters.lookahead import LookaheadDrafter
from genspec.drafters.medusa import MedusaDrafter
from genspec.drafters.ngram_cache import NGramCacheDrafter
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.drafters.retrieval import RetrievalDrafter
from genspec.drafters.self_speculation import (PLAN_NEEDED, EarlyExitDrafter, LayerSkipDrafter, PrunedDrafter,
                                               QuantizedDrafter)
from genspec.drafters.suffix import SuffixDrafter
from genspec.errors import ConfigError
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM
from genspec.speculators.store import HEAD_CONFIG


def draft_model_drafter(target: CausalLM, draft_model: str | CausalLM | None = None, num_drafts: int = 1,
                        confidence_threshold: float = 0.0, min_shared: float = MIN_SHARED) -> Drafter:
    """``draft-model``: :class:`DistilledDrafter` for a directory ``genspec train draft`` wrote, else the model
    at ``draft_model``: with the target's tokenizer :meth:`DraftModelDrafter.for_target`, with another one a
    :class:`CrossTokenizerDrafter` (``min_shared``: its least shared vocabulary; one chain, no confidence
    threshold)."""
    if isinstance(draft_model, (str, os.PathLike)) and (Path(draft_model) / HEAD_CONFIG).is_file():
        return DistilledDrafter.for_target(target, str(draft_model), num_drafts, confidence_threshold)
    if draft_model is None:
        raise ConfigError("drafter 'draft-model' needs a draft model (--draft-model PATH)")
    if not isinstance(draft_model, CausalLM):
        draft_model = HFCausalLM.from_pretrained(draft_model)
    if same_tokenizer(target, draft_model):
        return DraftModelDrafter.for_target(target, draft_model, num_drafts, confidence_threshold)
    for option, value, default in (("num_drafts", num_drafts, 1), ("confidence_threshold", confidence_threshold, 0.0)):
        if value != default:
            raise ConfigError(f"drafter 'draft-model' option {option}={value!r} needs a draft model with the "
                              "target's tokenizer; this one has another")
    return CrossTokenizerDrafter.for_target(target, draft_model, min_shared)


def hierarchical_drafter(target: CausalLM, levels: list[str] | str = DEFAULT_LEVELS,
                         draft_model: str | None = None) -> Drafter:
    """``hierarchical``: the drafters named by ``levels`` (a list, or names separated by commas) built and
    stacked by :meth:`HierarchicalDrafter.stack`; ``draft_model`` is the ``draft-model`` level's model."""
    names = levels.split(",") if isinstance(levels, str) else list(levels)
    if len(names) < 2:
        raise ConfigError("hierarchical drafting needs at least two levels, e.g. prompt-lookup,quantized")
    stack = []
    for depth, name in enumerate(names):
        if name in (HierarchicalDrafter.name, "none") or name not in DRAFTERS:
            raise ConfigError(f"unknown or unstackable level {name!r} in hierarchical levels")
        options = {"draft_model": draft_model} if name == "draft-model" else {}
        level = build_drafter(name, target, **options)
        if depth < len(names) - 1 and level.capabilities.max_candidates > 1:
            raise ConfigError(f"level {name!r} drafts trees ({level.capabilities.max_candidates} candidates); a level "
                              "below another must draft chains")
        stack.append((name, level))
    return HierarchicalDrafter.stack(stack)


#: drafter name -> its factory ``(target, **options) -> Drafter`` (a class's ``for_target``, or one of the functions
#: above where the name picks or stacks classes); ``none`` means plain decoding
DRAFTERS: dict[str, Callable[..., Drafter] | None] = {
    "none": None,
    "prompt-lookup": PromptLookupDrafter.for_target,
    "draft-model": draft_model_drafter,
    "early-exit": EarlyExitDrafter.for_target,
    "layer-skip": LayerSkipDrafter.for_target,
    "quantized": QuantizedDrafter.for_target,
    "pruned": PrunedDrafter.for_target,
    "hierarchical": hierarchical_drafter,
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
    """Refuse, before anything loads, an unknown drafter name, the draft-model drafter without a draft model
    and the pruned one without a plan."""
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose from: {', '.join(DRAFTERS)}")
    if name == "draft-model" and (options or {}).get("draft_model") is None:
        raise ConfigError("drafter 'draft-model' needs a draft model (--draft-model PATH)")
    if name == PrunedDrafter.name and (options or {}).get("path") is None:
        raise ConfigError(PLAN_NEEDED)


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
