"""Self-speculation: the target itself, made cheaper, drafts for itself.

- ``early-exit``: the target's first L layers + its final norm and head (weights shared); its verify
  pass reuses the layers the draft computed (LayerSkip-style KV reuse, see :mod:`genspec.models.variants`).
- ``layer-skip``: the target with some layers skipped (weights shared; on llama.cpp a GGUF copy without them).
- ``quantized``: an int8 (dynamic quantisation) copy of the target (on llama.cpp a GGUF copy in fewer bits).
- ``pruned``: the target structurally pruned by a plan of ``genspec calibrate prune`` (fewer heads, MLP
  channels and/or layers; what it keeps whole is shared; on llama.cpp a GGUF copy cut by the plan).

Each is a :class:`~genspec.drafters.draft_model.DraftModelDrafter` over a variant model; they differ only
in how that model is made from the target. Every one also takes ``draft_vocab_file`` (a
truncated-vocabulary draft head, FR-Spec style), ``confidence_threshold`` and ``num_drafts``.
"""
from __future__ import annotations

import json
from pathlib import Path

from genspec.drafters.base import PATH, Option
from genspec.drafters.draft_model import CONFIDENCE_THRESHOLD, NUM_DRAFTS, DraftModelDrafter
from genspec.errors import ConfigError, InputFileError
from genspec.models import variants
from genspec.models.hf import HFCausalLM
from genspec.models.llamacpp import GGUFType, Kernels, LlamaCppLM, derived_gguf
from genspec.models.pruned_gguf import pruned_gguf
from genspec.speculators.store import target_fingerprint


def read_vocab_file(path: str | None, vocab_size: int | None = None) -> list[int] | None:
    """Token ids (a JSON list, or {"token_ids": [...]}) for a truncated-vocabulary draft head; with
    ``vocab_size``, each must be a token of that vocabulary."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise InputFileError(f"draft vocabulary file not found: {path}") from exc
    except (OSError, ValueError) as exc:
        raise InputFileError(f"cannot read draft vocabulary file {path}: {exc}") from exc
    ids = data.get("token_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputFileError(f"{path}: expected a non-empty JSON list of token ids")
    outside = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if outside:
        vocabulary = f"[0, {vocab_size})" if vocab_size is not None else "(ids are >= 0)"
        raise InputFileError(f"{path}: token id {outside[0]} is not in the model's vocabulary {vocabulary} "
                             f"({len(outside)} such ids); was the file made for another model?")
    return ids


def read_calibration(path: str, key: str, kind: type):
    """``data[key]`` of a calibration JSON file (``genspec calibrate``), checked to be of type ``kind``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InputFileError(f"calibration file not found: {path}") from exc
    except json.JSONDecodeError as exc:  # a file cut short or edited by hand: where the parser stopped
        raise InputFileError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{path}: not a JSON file (not UTF-8 text)") from exc
    except OSError as exc:
        raise InputFileError(f"cannot read calibration file {path}: {exc.strerror or exc}") from exc
    try:
        value = data[key]
    except (KeyError, TypeError) as exc:  # valid JSON, but not what genspec calibrate writes
        raise InputFileError(f'{path}: not a calibration file with a "{key}" entry') from exc
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputFileError(f'{path}: "{key}" must be a {kind.__name__}')
    return value


class _SelfDrafter(DraftModelDrafter):
    """A draft-model drafter whose model is made from the target by :meth:`variant` (a subclass adds the options
    its variant takes)."""

    options = (Option("draft_vocab_file", (*PATH, None)), CONFIDENCE_THRESHOLD, NUM_DRAFTS, Option("reuse_layers", bool))

    @classmethod
    def for_target(cls, target, draft_vocab_file: str | None = None, confidence_threshold: float = 0.0,
                   num_drafts: int = 1, reuse_layers: bool = True, **variant_options) -> "_SelfDrafter":
        if isinstance(target, LlamaCppLM):
            if draft_vocab_file is not None:
                raise ConfigError(f"drafter {cls.name!r} option draft_vocab_file needs the torch backend "
                                  "(--backend torch): a GGUF copy keeps the target's vocabulary")
            copy = cls.gguf_variant(target, **variant_options)
            model = LlamaCppLM.from_gguf(copy, tokenizer=target.tokenizer, max_rows=target.max_rows,
                                         context=target.max_context, kernels=Kernels.FAST)
            return cls(model, num_drafts=num_drafts, confidence_threshold=confidence_threshold, reuse_layers=False)
        if not isinstance(target, HFCausalLM):
            raise ConfigError("self-speculation needs a Hugging Face target model on the torch backend (--backend torch): "
                              "it builds its draft from the target's weights")
        model = cls.variant(target, read_vocab_file(draft_vocab_file, target.vocab_size), **variant_options)
        return cls(model, num_drafts=num_drafts, confidence_threshold=confidence_threshold, reuse_layers=reuse_layers)

    @classmethod
    def variant(cls, target: HFCausalLM, vocab_subset, **options) -> HFCausalLM:
        raise NotImplementedError

    @classmethod
    def gguf_variant(cls, target: LlamaCppLM, **options) -> Path:
        """The GGUF file of this drafter's model for a llama.cpp target (:func:`derived_gguf`); a kind that has
        none is refused for that backend."""
        raise ConfigError(f"drafter {cls.name!r} on the llamacpp backend: it builds its draft from the target's "
                          "layers as a torch model (--backend torch); quantized, layer-skip and pruned have GGUF "
                          "copies")


class EarlyExitDrafter(_SelfDrafter):
    """Option ``exit_layer``: an int, or a file written by ``genspec calibrate early-exit`` (default: a
    quarter of the layers); ``reuse_layers=false`` makes the target recompute the first layers."""

    name = "early-exit"
    options = _SelfDrafter.options + (Option("exit_layer", (int, *PATH, None), 1),)

    @classmethod
    def variant(cls, target, vocab_subset, exit_layer: int | str | None = None):
        if isinstance(exit_layer, str):
            exit_layer = read_calibration(exit_layer, "exit_layer", int)
        if exit_layer is None:
            exit_layer = max(1, target.num_layers // 4)
        return variants.early_exit(target, exit_layer, vocab_subset)


class LayerSkipDrafter(_SelfDrafter):
    """Option ``skip``: layer indices, or a file written by ``genspec calibrate layer-skip`` (default:
    every other middle layer)."""

    name = "layer-skip"
    options = _SelfDrafter.options + (Option("skip", (list, *PATH, None), 0, item=int),)

    @staticmethod
    def skipped_layers(num_layers: int, skip: list[int] | str | None) -> list[int]:
        """The layers ``skip`` names (a list, a calibration file, or None: every other middle layer)."""
        if skip is None:
            return list(range(1, num_layers - 1, 2))
        if isinstance(skip, str):
            skip = read_calibration(skip, "skip", list)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in skip):
                raise InputFileError('calibration file: "skip" must be a list of layer indices')
        return list(skip)

    @classmethod
    def variant(cls, target, vocab_subset, skip: list[int] | str | None = None):
        return variants.layer_skip(target, cls.skipped_layers(target.num_layers, skip), vocab_subset)

    @classmethod
    def gguf_variant(cls, target, skip: list[int] | str | None = None):
        skip = cls.skipped_layers(target.num_layers, skip)
        if any(not 0 <= i < target.num_layers for i in skip) or len(set(skip)) >= target.num_layers:
            raise ConfigError(f"drafter 'layer-skip' option skip={skip!r}: indices of the target's layers "
                              f"0..{target.num_layers - 1}, keeping at least one")
        return derived_gguf(target.path, None, tuple(skip))


class QuantizedDrafter(_SelfDrafter):
    """A lower-precision copy of the target: on the torch backend int8 dynamic quantisation of every Linear (the
    head included); on the llamacpp backend the GGUF file requantised by llama.cpp's own quantiser to option
    ``gguf_type`` (:class:`~genspec.models.llamacpp.GGUFType`, default Q2_K), made once and cached."""

    name = "quantized"
    options = _SelfDrafter.options + (Option("gguf_type", str, choices=tuple(t.value for t in GGUFType)),)

    @classmethod
    def variant(cls, target, vocab_subset, gguf_type: str | None = None):
        if gguf_type is not None:
            raise ConfigError("drafter 'quantized' option gguf_type applies to a GGUF target (the llamacpp "
                              "backend); on the torch backend the copy is int8")
        return variants.quantized(target, vocab_subset)

    @classmethod
    def gguf_variant(cls, target, gguf_type: str = GGUFType.Q2_K.value):
        return derived_gguf(target.path, GGUFType(gguf_type))


#: what ``--drafter pruned`` needs, and its refusal without it
PLAN = "a pruning plan: -O path=PLAN.json (written by genspec calibrate prune)"
PLAN_NEEDED = f"drafter 'pruned' needs {PLAN}"


def read_prune_plan(path: str | None, target: HFCausalLM | LlamaCppLM) -> dict:
    """The plan a ``genspec calibrate prune`` wrote to ``path`` for ``target``: its ``layers``, ``heads``
    and ``channels``, and ``weights``: the file of its healed weights, or None (a plan made for another
    model is refused)."""
    if path is None:
        raise ConfigError(PLAN_NEEDED)
    plan = {key: read_calibration(path, key, list) for key in ("layers", "heads", "channels")}
    if read_calibration(path, "fingerprint", str) != target_fingerprint(target):
        raise ConfigError(f"{path}: the pruning plan was made for another model (its fingerprint differs from "
                          "the target's); run genspec calibrate prune for this one")
    healed = json.loads(Path(path).read_text()).get("healed")
    if healed is not None and not (isinstance(healed, dict) and isinstance(healed.get("weights"), str)):
        raise InputFileError(f'{path}: "healed" must name the file of the healed weights')
    plan["weights"] = None if healed is None else Path(path).parent / healed["weights"]
    return plan


class PrunedDrafter(_SelfDrafter):
    """Option ``path``: a pruning plan written by ``genspec calibrate prune`` (required): the target with
    the heads, MLP channels and layers it names removed (and its healed weights, if it was healed) drafts
    for the target; for a llama.cpp target, as a GGUF copy of the target's file cut by the plan
    (:func:`~genspec.models.pruned_gguf.pruned_gguf`), made once and cached."""

    name = "pruned"
    options = _SelfDrafter.options + (Option("path", PATH, needed=PLAN),)

    @classmethod
    def variant(cls, target, vocab_subset, path: str | None = None):
        plan = read_prune_plan(path, target)
        try:
            model = variants.pruned(target, plan["layers"], plan["heads"], plan["channels"], vocab_subset)
        except ConfigError as exc:
            raise InputFileError(f"{path}: not a pruning plan for this model: {exc}") from exc
        if plan["weights"] is not None:  # healed by genspec calibrate prune --heal-steps
            variants.load_own_weights(plan["weights"], model, target)
        return model

    @classmethod
    def gguf_variant(cls, target, path: str | None = None):
        plan = read_prune_plan(path, target)
        try:
            return pruned_gguf(target.path, plan["layers"], plan["heads"], plan["channels"], plan["weights"])
        except ConfigError as exc:
            raise InputFileError(f"{path}: cannot prune this GGUF model by it: {exc}") from exc
