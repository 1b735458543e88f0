"""High-level entry points: load a target (the embedded default or a local path) and a drafter by name.

    >>> import genspec
    >>> engine = genspec.load(drafter="prompt-lookup")          # embedded Gemma 3 270M
    >>> engine.generate("The capital of France is", max_new_tokens=20)[0].text
"""
from __future__ import annotations

from collections.abc import Callable

from genspec.drafters import DraftModelDrafter, Drafter, PromptLookupDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu") -> HFCausalLM:
    """A target model from a local directory, or the embedded default (Gemma 3 270M) if ``path`` is None."""
    if path is None:
        from genspec.models.default import default_model_dir

        path = default_model_dir()
    return HFCausalLM.from_pretrained(path, dtype=dtype, device=device)


def _draft_model(target: CausalLM, draft_model: str | CausalLM | None = None, num_drafts: int = 1, **_):
    if draft_model is None:
        raise ConfigError("drafter 'draft-model' needs a draft model (--draft-model PATH)")
    model = draft_model if isinstance(draft_model, CausalLM) else HFCausalLM.from_pretrained(draft_model)
    if model.vocab_size != target.vocab_size:
        raise ConfigError(f"draft and target vocabularies differ ({model.vocab_size} vs {target.vocab_size}); "
                          "they must share the tokenizer")
    return DraftModelDrafter(model, num_drafts=num_drafts)


def _prompt_lookup(target: CausalLM, max_ngram: int = 3, min_ngram: int = 1, **_):
    return PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


#: drafter name -> factory(target, **options). ``none`` means plain decoding.
DRAFTERS: dict[str, Callable[..., Drafter] | None] = {
    "none": None,
    "prompt-lookup": _prompt_lookup,
    "draft-model": _draft_model,
}


def build_drafter(name: str, target: CausalLM, **options) -> Drafter | None:
    """The drafter called ``name`` for ``target`` (None for ``"none"``)."""
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose from: {', '.join(DRAFTERS)}")
    factory = DRAFTERS[name]
    return None if factory is None else factory(target, **options)


def load(model: str | None = None, drafter: str = "prompt-lookup", draft_model: str | None = None,
         dtype: str = "float32", device: str = "cpu", **drafter_options) -> SpeculativeEngine:
    """A ready :class:`SpeculativeEngine`: target from ``model`` (default: embedded), drafter by name."""
    if drafter not in DRAFTERS:  # fail before loading anything
        raise ConfigError(f"unknown drafter {drafter!r}; choose from: {', '.join(DRAFTERS)}")
    if drafter == "draft-model" and draft_model is None:
        raise ConfigError("drafter 'draft-model' needs a draft model (--draft-model PATH)")
    target = load_model(model, dtype=dtype, device=device)
    return SpeculativeEngine(target, build_drafter(drafter, target, draft_model=draft_model, **drafter_options))
