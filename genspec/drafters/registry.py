"""The drafter registry: every drafter by name (``--drafter NAME``), its options checked, built for a target."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from genspec.drafters.base import Drafter, Option
from genspec.drafters.cross_tokenizer import MIN_SHARED, MIN_SHARED_OPTION, CrossTokenizerDrafter, same_tokenizer
from genspec.drafters.distilled import DistilledDrafter
from genspec.drafters.draft_model import DRAFT_MODEL, DraftModelDrafter
from genspec.drafters.edit import EditDrafter
from genspec.drafters.head import HeadDrafter
from genspec.drafters.hierarchical import DEFAULT_LEVELS, HierarchicalDrafter, cannot_verify
from genspec.drafters.hybrid import HybridDrafter
from genspec.drafters.lookahead import LookaheadDrafter
from genspec.drafters.medusa import MedusaDrafter
from genspec.drafters.ngram_cache import NGramCacheDrafter
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.drafters.retrieval import RetrievalDrafter
from genspec.drafters.self_speculation import EarlyExitDrafter, LayerSkipDrafter, PrunedDrafter, QuantizedDrafter
from genspec.drafters.suffix import SuffixDrafter
from genspec.errors import ConfigError, InputFileError
from genspec.models import gguf_file
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM
from genspec.speculators.store import HEAD_CONFIG


class AnyDraftModel(DraftModelDrafter):
    """``draft-model``: the drafter of the model at ``draft_model``, picked by what it is (this class is never built
    itself): :class:`DistilledDrafter` for a directory ``genspec train draft`` wrote, else with the target's
    tokenizer :meth:`DraftModelDrafter.for_target`, with another one a :class:`CrossTokenizerDrafter`
    (``min_shared``: its least shared vocabulary; one chain, no confidence threshold)."""

    options = (*DraftModelDrafter.options, MIN_SHARED_OPTION)

    @classmethod
    def for_target(cls, target: CausalLM, draft_model: str | CausalLM | None = None, num_drafts: int = 1,
                   confidence_threshold: float = 0.0, min_shared: float = MIN_SHARED) -> Drafter:
        if isinstance(draft_model, (str, os.PathLike)) and (Path(draft_model) / HEAD_CONFIG).is_file():
            return DistilledDrafter.for_target(target, str(draft_model), num_drafts, confidence_threshold)
        DRAFT_MODEL.check(draft_model, f"drafter {cls.name!r}")
        if not isinstance(draft_model, CausalLM):
            draft_model = load_draft_model(draft_model, target)
        if same_tokenizer(target, draft_model):
            return DraftModelDrafter.for_target(target, draft_model, num_drafts, confidence_threshold)
        for option, value, default in (("num_drafts", num_drafts, 1), ("confidence_threshold", confidence_threshold, 0.0)):
            if value != default:
                raise ConfigError(f"drafter 'draft-model' option {option}={value!r} needs a draft model with the "
                                  "target's tokenizer; this one has another")
        return CrossTokenizerDrafter.for_target(target, draft_model, min_shared)


class HierarchicalStack(Drafter):
    """``hierarchical``: the drafters named by ``levels`` (a list, or names separated by commas) built by name and
    stacked by :meth:`HierarchicalDrafter.stack` (this class is never built itself: the stack's top level is the
    drafter); ``draft_model`` is the ``draft-model`` level's model."""

    name = HierarchicalDrafter.name
    options = (Option("levels", (str, list), item=str),
               replace(DRAFT_MODEL, kinds=(*DRAFT_MODEL.kinds, None), needed=None))

    @staticmethod
    def named_levels(options: Mapping[str, object]) -> list[tuple[str, dict]]:
        """The levels ``options`` name, each with the options it is built with."""
        levels = options.get("levels", DEFAULT_LEVELS)
        names = levels.split(",") if isinstance(levels, str) else list(levels)
        draft_model = options.get("draft_model")
        return [(name, {"draft_model": draft_model} if name == "draft-model" else {}) for name in names]

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        """Its options, and every level's name, place and own options (a level's drafts are checked when it is
        built: a level below another must draft chains)."""
        super().check_options(options, owner)
        levels = cls.named_levels(options)
        if len(levels) < 2:
            raise ConfigError("hierarchical drafting needs at least two levels, e.g. prompt-lookup,quantized")
        for depth, (name, level_options) in enumerate(levels):
            if name in (cls.name, "none") or name not in DRAFTERS:
                raise ConfigError(f"unknown or unstackable level {name!r} in hierarchical levels")
            if depth > 0 and not issubclass(DRAFTERS[name], DraftModelDrafter):
                raise ConfigError(cannot_verify(name))
            check_drafter(name, level_options)

    @classmethod
    def for_target(cls, target: CausalLM, levels: list[str] | str = DEFAULT_LEVELS,
                   draft_model: str | None = None) -> Drafter:
        stack = []
        named = cls.named_levels({"levels": levels, "draft_model": draft_model})
        for depth, (name, options) in enumerate(named):
            level = build_drafter(name, target, **options)
            if depth < len(named) - 1 and level.capabilities.max_candidates > 1:
                raise ConfigError(f"level {name!r} drafts trees ({level.capabilities.max_candidates} candidates); a "
                                  "level below another must draft chains")
            stack.append((name, level))
        return HierarchicalDrafter.stack(stack)


#: drafter name -> its class (``None``: plain decoding). The registry builds one with :meth:`Drafter.for_target`
#: and checks its options, before anything loads, with :meth:`Drafter.check_options` (from :attr:`Drafter.options`);
#: ``draft-model`` and ``hierarchical`` are classes of this module whose factory picks or stacks others.
DRAFTERS: dict[str, type[Drafter] | None] = {
    "none": None,
    "prompt-lookup": PromptLookupDrafter,
    "draft-model": AnyDraftModel,
    "early-exit": EarlyExitDrafter,
    "layer-skip": LayerSkipDrafter,
    "quantized": QuantizedDrafter,
    "pruned": PrunedDrafter,
    "hierarchical": HierarchicalStack,
    "ngram-cache": NGramCacheDrafter,
    "suffix": SuffixDrafter,
    "retrieval": RetrievalDrafter,
    "edit": EditDrafter,
    "lookahead": LookaheadDrafter,
    "head": HeadDrafter,
    "hybrid": HybridDrafter,
    "medusa": MedusaDrafter,
    "draft": DistilledDrafter,
}


def check_draft_model(path: str | os.PathLike | None) -> None:
    """Refuse, before anything loads, a draft model path that is a file but not a GGUF model (by its magic bytes
    or extension, :func:`genspec.models.gguf_file.is_gguf`): a draft model is a model directory or a GGUF file."""
    if isinstance(path, (str, os.PathLike)) and Path(path).is_file() and not gguf_file.is_gguf(path):
        raise InputFileError(f"the draft model {path} is neither a GGUF file nor a model directory (config.json "
                             "and weights)")


#: rows a GGUF draft model holds when its target does not bound them (a torch target)
DRAFT_ROWS = 16


def load_draft_model(path: str | os.PathLike, target: CausalLM) -> CausalLM:
    """The draft model at ``path``: a GGUF file on llama.cpp (fast kernels: a draft's rounding changes what is
    drafted, never what is kept; as many rows as the target holds), else a model directory on transformers."""
    check_draft_model(path)
    if gguf_file.is_gguf(path):
        from genspec.models.llamacpp import Kernels, LlamaCppLM

        return LlamaCppLM.from_gguf(path, max_rows=target.max_rows or DRAFT_ROWS, kernels=Kernels.FAST)
    return HFCausalLM.from_pretrained(path)


def check_drafter(name: str, options: Mapping[str, object] | None = None) -> None:
    """Refuse, before anything loads (no target needed), an unknown drafter name and options its class does not
    take (:meth:`Drafter.check_options`: an unknown name, a value of the wrong type or out of its declared range, a
    needed one missing: the draft-model drafter's model, the pruned one's plan), and a GGUF file for a draft model.
    ``none`` (plain decoding) takes no options."""
    options = {} if options is None else options
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose from: {', '.join(DRAFTERS)}")
    drafter = DRAFTERS[name]
    if drafter is None:
        if options:
            raise ConfigError(f"drafter {name!r} is plain decoding and takes no options, got {', '.join(options)}")
        return
    drafter.check_options(options)
    check_draft_model(options.get("draft_model"))


def options_table() -> str:
    """Every drafter's options and the values each takes, as the manual's Markdown table (docs/drafters/options.md
    holds it, and a test keeps the two equal): the declarations (:attr:`Drafter.options`) are its one source."""
    rows = ["| drafter | option | takes |", "|---|---|---|"]
    for name, drafter in DRAFTERS.items():
        for option in () if drafter is None else drafter.options:
            needed = " (needed)" if option.needed is not None else ""
            rows.append(f"| `{name}` | `{option.name}`{needed} | {option.describe()} |")
    return "\n".join(rows) + "\n"


def build_drafter(name: str, target: CausalLM, **options) -> Drafter | None:
    """The drafter called ``name`` for ``target`` (None for ``"none"``), its options checked first."""
    check_drafter(name, options)
    drafter = DRAFTERS[name]
    return None if drafter is None else drafter.for_target(target, **options)
