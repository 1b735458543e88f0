"""Adapter for any Hugging Face ``AutoModelForCausalLM``.

Design: genspec owns the attention mask. The KV cache (a ``transformers.DynamicCache`` with one full
layer per decoder layer) holds *slots*; each slot has a position, or -1 for a hole (padding, or a
token dropped after a rejection in a batch). Every forward passes an explicit 4-D mask built from
the slot positions, the new block's ancestor (tree) mask and the sliding window, and explicit
position ids. That one mechanism gives chains, token trees, ragged batches and exact rollback for
every architecture whose attention takes a prepared 4-D mask (Llama, Gemma 3, Qwen, Mistral, ...).

The LM head is applied by genspec (:class:`genspec.kernels.LMHead`), only to the rows that need it,
with the fastest exact CPU kernel for the number of rows (one ``W @ x.T`` or oneDNN's GEMM over a packed
copy, timed per row count on a large head); with a 262k vocabulary that halves a decode step's head and makes
verifying a draft much cheaper than ``F.linear`` (the manual's Backends page has the measurements).
The decoder's ``nn.Linear`` layers are swapped for :class:`TransposedLinear`, which computes each product
with the exact kernel (``F.linear``, ``(W @ x.T).T``, or oneDNN's GEMM over a packed copy) that timed
fastest for that number of rows on this CPU: the ranking differs between CPUs.
"""
from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path

import torch
from safetensors import SafetensorError

from genspec.errors import ConfigError, ContextLengthError, InputFileError
from genspec.kernels import (KernelTuner, LMHead, PackedWeight, in_fixed_blocks, needs_grad, packable,
                             weight_times_rows, worth_tuning)
from genspec.models import gguf_file
from genspec.models.base import CausalLM, PrefixKV, states_kept
from genspec.models.exact_attention import use_exact_attention

# transformers is imported where it is used: `import genspec` would otherwise spend seconds on it

#: files that make a model directory's tokenizer (if one is there but does not load, that is an error)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


#: the dtypes a model loads in (weights and activations in floating point)
DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` (one of :data:`DTYPES`, or such a ``torch.dtype``) as a ``torch.dtype``; anything else is a
    :class:`ConfigError` before any weights load."""
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype in DTYPES else dtype
    if not (isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point
            and str(torch_dtype).replace("torch.", "") in DTYPES):
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return torch_dtype


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this machine has; a malformed name or a device it lacks (``cuda``
    without a GPU) is a :class:`ConfigError` before any weights load."""
    try:
        parsed = torch.device(device)
        torch.empty(0, device=parsed)  # an absent backend raises here (CUDA: AssertionError or RuntimeError)
    except (RuntimeError, AssertionError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not available on this machine: {_first_line(exc)}") from None
    return parsed


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def decoder_view(decoder, kept: list[int], final_norm: bool = True):
    """A shallow copy of a decoder stack that runs only the layers ``kept`` (weights shared); without
    ``final_norm`` it returns the hidden states before the final norm."""
    view = copy.copy(decoder)
    view._modules = dict(decoder._modules)
    view.layers = torch.nn.ModuleList([decoder.layers[i] for i in kept])
    if not final_norm:
        view.norm = torch.nn.Identity()
    config = copy.copy(decoder.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [decoder.config.layer_types[i] for i in kept]
    view.config = config
    return view


class HFCausalLM(CausalLM):
    """A transformers causal LM with genspec's slot cache. Build with :meth:`from_pretrained` or
    wrap an already loaded model: ``HFCausalLM(model)``.

    ``exact=True`` makes it batch invariant (:attr:`batch_invariant`): a position's logits are bitwise the same
    as a one-token step, inside a block of any width or beside other rows of any lengths, so greedy speculation
    gives plain greedy decoding's tokens. Every product of rows with a weight (the decoder's linears, the output
    layer) is made ``EXACT_ROWS`` rows at a time (:func:`genspec.kernels.in_fixed_blocks`), and attention is
    :mod:`genspec.models.exact_attention`'s; the norms, rotary embeddings, activations and residual sums work on
    each row apart. It changes ``model`` in place (its linears and its attention implementation), for every
    wrapper of it. Without it (the default) the kernels are chosen by speed per number of rows, and a position's
    logits differ between those cases in the last bits."""

    backend = "torch"
    #: True for an exact model (set per model)
    batch_invariant = False

    def __init__(self, model, tokenizer=None, fast_kernels: bool = True, decoder=None,
                 lm_head: LMHead | None = None, vocab_subset: torch.Tensor | None = None,
                 final_norm: torch.nn.Module | None = None, exact: bool = False):
        """``decoder`` replaces the model's own decoder stack (a view with fewer layers, see
        genspec.models.variants); ``lm_head`` shares an already laid-out :class:`LMHead`; ``vocab_subset``
        restricts the head to those token ids (other logits are -inf: a cheaper draft head);
        ``final_norm`` is applied before the head (for a decoder view that returns un-normed states);
        ``exact``: batch invariant logits (the class docstring)."""
        if exact and not fast_kernels:
            raise ConfigError("exact=True computes with genspec's kernels: it needs fast_kernels=True")
        if exact and lm_head is not None and not lm_head.exact:
            raise ConfigError("exact=True needs an exact output layer: LMHead(..., exact=True)")
        self.model = model.eval()
        #: a position's logits do not depend on the block or the batch that computes them (``exact``)
        self.batch_invariant = bool(exact)
        self._final_norm = final_norm
        self._tails: dict[int, object] = {}
        self.tokenizer = tokenizer
        self._decoder = decoder if decoder is not None else (
            model.get_decoder() if hasattr(model, "get_decoder") else model.model)
        config = self._decoder.config
        # transformers 5.x renamed the decoder's cache argument (``past_key_values`` warns from 5.2x and goes
        # in 5.40); older versions only know the old name
        self._cache_kwarg = ("cache" if "cache" in inspect.signature(self._decoder.forward).parameters
                             else "past_key_values")
        self.config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        head = model.get_output_embeddings()
        head_weight = head.weight() if callable(head.weight) else head.weight  # quantised heads: a method
        self.vocab_size = int(head_weight.shape[0])
        self.max_context = getattr(self.config, "max_position_embeddings", None)
        self.device = head_weight.device
        if exact and self.device.type != "cpu":
            raise ConfigError(f"exact=True runs on the CPU, not {self.device}: other devices' kernels are not known to "
                              "keep a row's result independent of the rows beside it")
        self.dtype = model.get_input_embeddings().weight.dtype
        self._softcap = getattr(self.config, "final_logit_softcapping", None)
        self._sliding_window = getattr(self.config, "sliding_window", None)
        self._layer_types = getattr(self.config, "layer_types", None)
        self._head = head
        self._head_bias = getattr(head, "bias", None)
        self.vocab_subset = None
        if vocab_subset is not None:
            self.vocab_subset = torch.as_tensor(vocab_subset, dtype=torch.long, device=self.device).unique()
            if not len(self.vocab_subset) or self.vocab_subset[0] < 0 or self.vocab_subset[-1] >= self.vocab_size:
                raise ConfigError(f"a vocabulary subset needs token ids in [0, {self.vocab_size}), got "
                                  + (f"{int(self.vocab_subset[0])}..{int(self.vocab_subset[-1])}" if len(self.vocab_subset) else "none"))
            # (``_head_bias`` stays the full vocabulary's: ``subset_head`` names tokens by their full ids)
            lm_head = LMHead(head.weight.detach()[self.vocab_subset],
                             None if self._head_bias is None else self._head_bias[self.vocab_subset], exact=exact)
        elif lm_head is None and fast_kernels:
            lm_head = LMHead(head.weight, self._head_bias, exact=exact)
        self._lm_head = lm_head
        #: the kernel choice of the decoder's linear layers (None with ``fast_kernels=False``: stock layers,
        #: or a view sharing another model's)
        self.linear_kernels = transpose_linears(self._decoder, exact=exact) if fast_kernels else None
        if exact:
            use_exact_attention(model)
        self.reset(0)

    @property
    def decoder(self):
        """The decoder stack (embeddings, layers, final norm) this model runs."""
        return self._decoder

    @property
    def lm_head(self) -> LMHead | None:
        """genspec's laid-out LM head (None with ``fast_kernels=False`` and no vocabulary subset)."""
        return self._lm_head

    @property
    def num_layers(self) -> int:
        return len(self._decoder.layers)

    gives_layer_states = True

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def trained_context(self) -> int | None:
        return self.max_context

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens.to(self.device))

    def output_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self._head.weight() if callable(self._head.weight) else self._head.weight  # quantised heads: a method
        return weight.detach()[torch.as_tensor(token_ids, dtype=torch.long, device=self.device)].float()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence id and the model's generation config's (e.g. Gemma's
        ``<end_of_turn>``), as ``generate()`` stops at them."""
        ids: list[int] = []
        sources = (getattr(self.tokenizer, "eos_token_id", None),
                   getattr(getattr(self.model, "generation_config", None), "eos_token_id", None))
        for source in sources:
            for i in (source if isinstance(source, (list, tuple)) else [source]):
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return tuple(ids)

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str | torch.dtype = "float32",
                        device: str = "cpu", fast_kernels: bool = True, exact: bool = False) -> "HFCausalLM":
        """Load model and tokenizer from a local directory (never from the network); ``exact``: batch invariant
        logits (the class docstring)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # genspec shows its own progress; keep stderr for errors
        hf_logging.set_verbosity_error()
        torch_dtype, device = parse_dtype(dtype), parse_device(device)
        path = Path(path)
        if gguf_file.is_gguf(path) and path.is_file():
            raise InputFileError(f"{path} is a GGUF file: transformers runs a model directory with config.json and "
                                 "weights (a GGUF target runs on the llamacpp backend: --backend llamacpp)")
        if not path.is_dir() or not (path / "config.json").is_file():
            raise InputFileError(f"no model at {path}: expected a directory with config.json and weights")
        try:  # SafetensorError: a truncated or overwritten weights file
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
        except (OSError, ValueError, SafetensorError) as exc:
            raise InputFileError(f"cannot load model from {path}: {_first_line(exc)}") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer.json raises ValueError, KeyError, ...
            if any((path / name).exists() for name in _TOKENIZER_FILES):  # there is one, but it is broken
                raise InputFileError(f"cannot load the tokenizer in {path}: {type(exc).__name__}: "
                                     f"{_first_line(exc)}") from exc
            if not isinstance(exc, (OSError, ValueError)):
                raise
            tokenizer = None  # a model without a tokenizer: token ids only
        return cls(model.to(device), tokenizer, fast_kernels=fast_kernels, exact=exact)

    @staticmethod
    def context_of(path: str | os.PathLike) -> int | None:
        """``max_context`` of the model directory ``path``, from its config.json alone (no weights); None
        if the config gives none or cannot be read."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):
            return None
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        return getattr(config, "max_position_embeddings", None)

    # ---------------------------------------------------------------- cache state
    @torch.inference_mode()
    def reset(self, batch_size: int = 0) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.slot_positions = torch.empty(batch_size, 0, dtype=torch.long, device=self.device)
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._block_start = 0

    @torch.inference_mode()
    def add_rows(self, prefixes: list[list[int]], return_hidden: bool = False,
                 hidden_layers: tuple[int, ...] = (), hidden_last: int | None = None) -> list[torch.Tensor] | None:
        """Prefill the new rows in a cache of their own, then append that cache's rows to this one
        (holes pad the shorter of the two along the slot axis): one copy of the cache per join, as a
        decode step's ``torch.cat`` costs anyway."""
        if not prefixes:
            return [] if return_hidden else None
        held = (self.cache, self.slot_positions, self._lengths)
        self.reset(len(prefixes))
        longest = max(len(p) for p in prefixes)
        width = self.config.hidden_size * (1 + len(hidden_layers))
        hidden = [torch.zeros(0, width, dtype=self.dtype, device=self.device)] * len(prefixes)
        if longest:
            tokens = torch.zeros(len(prefixes), longest, dtype=torch.long)
            valid = torch.zeros(len(prefixes), longest, dtype=torch.bool)
            for row, prefix in enumerate(prefixes):
                tokens[row, :len(prefix)] = torch.as_tensor(prefix, dtype=torch.long)
                valid[row, :len(prefix)] = True
            states, _ = self.hidden_states(tokens, valid, layers=hidden_layers)
            self.commit_all(valid)
            hidden = [states[row, len(prefix) - states_kept(len(prefix), hidden_last):len(prefix)]
                      for row, prefix in enumerate(prefixes)]
        added_cache, added_slots, added_lengths = self.cache, self.slot_positions, self._lengths
        self.cache, self.slot_positions, self._lengths = held
        slots = max(self.num_slots, added_slots.shape[1])
        old_layers, new_layers = list(_filled_layers(self.cache)), list(_filled_layers(added_cache))
        if not old_layers:  # nothing cached yet: the new cache becomes the cache
            self.cache = added_cache
        for index, layer in enumerate(new_layers or old_layers):
            old = old_layers[index] if old_layers else None
            new = new_layers[index] if new_layers else None
            for name in ("keys", "values"):
                parts = [_padded(None if old is None else getattr(old, name), len(self._lengths), slots, getattr(layer, name)),
                         _padded(None if new is None else getattr(new, name), len(added_lengths), slots,
                                 getattr(layer, name))]
                setattr(old if old is not None else new, name, torch.cat(parts, dim=0))
        self.slot_positions = torch.cat([torch.nn.functional.pad(p, (0, slots - p.shape[1]), value=-1)
                                         for p in (self.slot_positions, added_slots)], dim=0)
        self._lengths = torch.cat([self._lengths, added_lengths])
        self._block_start = self.num_slots
        return hidden if return_hidden else None

    @torch.inference_mode()
    def remove_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        gone = set(rows)
        kept = torch.tensor([r for r in range(self.num_rows) if r not in gone], dtype=torch.long, device=self.device)
        if not len(kept):
            self.reset(0)
            return
        for layer in self._cache_tensors():
            layer.keys = layer.keys.index_select(0, kept)
            layer.values = layer.values.index_select(0, kept)
        self.slot_positions = self.slot_positions.index_select(0, kept)
        self._lengths = self._lengths.index_select(0, kept)
        self._block_start = self.num_slots
        self._trim()

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @property
    def num_slots(self) -> int:
        return self.slot_positions.shape[1]

    def _cache_tensors(self):
        return _filled_layers(self.cache)

    def _select_slots(self, index: torch.Tensor, new_num_slots: int) -> None:
        """Rewrite slots [start, start + index.shape[1]) of each row from ``index`` (absolute slot
        numbers, [B, m]) and cut the cache to ``new_num_slots``."""
        start = new_num_slots - index.shape[1]
        for layer in self._cache_tensors():
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # [B, H, S, D]
                gather_index = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                moved = tensor.gather(2, gather_index)
                tensor = tensor[:, :, :new_num_slots]
                tensor[:, :, start:] = moved
                setattr(layer, name, tensor)

    @torch.inference_mode()
    def keep_block(self, keep: torch.Tensor) -> None:
        start = self._block_start
        keep = keep.to(self.device)
        num_kept = (keep >= 0).sum(-1)
        width = int(num_kept.max()) if keep.numel() else 0
        keep = keep[:, :width]
        absolute = torch.where(keep >= 0, keep + start, torch.full_like(keep, start))
        positions = self._lengths.unsqueeze(1) + torch.arange(width, device=self.device)
        positions = torch.where(keep >= 0, positions, torch.full_like(positions, -1))
        self._select_slots(absolute, start + width)
        self.slot_positions = torch.cat([self.slot_positions[:, :start], positions], dim=1)
        self._lengths = self._lengths + num_kept
        self._trim()

    @torch.inference_mode()
    def truncate(self, lengths: torch.Tensor) -> None:
        lengths = lengths.to(self.device)
        drop = self.slot_positions >= lengths.unsqueeze(1)
        self.slot_positions = self.slot_positions.masked_fill(drop, -1)
        self._lengths = torch.minimum(self._lengths, lengths)
        self._trim()

    @torch.inference_mode()
    def _trim(self) -> None:
        """Drop trailing slots that are holes in every row, and compact when holes dominate."""
        used = (self.slot_positions >= 0).any(0).nonzero()
        num_slots = int(used.max()) + 1 if used.numel() else 0
        if num_slots < self.num_slots:
            for layer in self._cache_tensors():
                layer.keys = layer.keys[:, :, :num_slots]
                layer.values = layer.values[:, :, :num_slots]
            self.slot_positions = self.slot_positions[:, :num_slots]
        longest = int(self._lengths.max()) if self._lengths.numel() else 0
        if self.num_slots > 64 and self.num_slots > 2 * longest:
            self._compact(longest)

    @torch.inference_mode()
    def _compact(self, longest: int) -> None:
        """Move each row's tokens to the front (in position order), leaving holes only at the end."""
        order = torch.where(self.slot_positions >= 0, self.slot_positions,
                            torch.full_like(self.slot_positions, 1 << 40)).argsort(dim=1, stable=True)
        index = order[:, :longest]
        positions = self.slot_positions.gather(1, index)
        self._select_slots(index, longest)
        self.slot_positions = positions

    # ---------------------------------------------------------------- forward
    def _attention_masks(self, query_positions: torch.Tensor, tree_mask: torch.Tensor,
                         valid: torch.Tensor):
        """Additive 4-D masks ``[B, 1, n, S + n]`` for full and sliding-window attention."""
        key_positions = torch.cat([self.slot_positions, torch.where(valid, query_positions, -1)], dim=1)
        cached = (self.slot_positions >= 0).unsqueeze(1).expand(-1, query_positions.shape[1], -1)
        visible = torch.cat([cached, tree_mask & valid.unsqueeze(1)], dim=2)  # [B, n, S + n]
        # a padded query sees only itself, so its softmax stays finite; its output is never used
        n = query_positions.shape[1]
        eye = torch.eye(n, dtype=torch.bool, device=self.device).unsqueeze(0)
        pad_query = ~valid
        visible[:, :, self.num_slots:] |= eye & pad_query.unsqueeze(2)
        masks = {"full_attention": visible}
        if self._sliding_window:
            distance = query_positions.unsqueeze(2) - key_positions.unsqueeze(1)
            masks["sliding_attention"] = visible & ((distance < self._sliding_window) | pad_query.unsqueeze(2))
        lowest = torch.finfo(self.dtype).min
        return {kind: torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill(~m, lowest).unsqueeze(1)
                for kind, m in masks.items()}

    def _mask_argument(self, masks):
        if self._layer_types is not None:
            return {kind: masks.get(kind, masks["full_attention"]) for kind in set(self._layer_types)}
        if self._sliding_window and getattr(self.config, "use_sliding_window", True):
            return masks["sliding_attention"]
        return masks["full_attention"]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` from final hidden states ``[..., H]``."""
        logits = self._logits(hidden, self._lm_head if self._lm_head is not None else self._head)
        if self.vocab_subset is not None:
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), -torch.inf)
            full[..., self.vocab_subset] = logits
            logits = full
        return logits

    def _logits(self, hidden: torch.Tensor, head) -> torch.Tensor:
        """The final norm (for a decoder view without it), the output layer ``head``, the soft cap."""
        if self._final_norm is not None:
            hidden = self._final_norm(hidden)
        logits = head(hidden)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def subset_head(self, token_ids: torch.Tensor):
        """A function from final hidden states ``[..., H]`` to this model's logits of ``token_ids`` only,
        ``[..., S]``: the same norm, output-layer rows and soft cap as :meth:`head` (a draft head's
        truncated vocabulary; differentiable in the hidden states, for training). The rows go through an
        :class:`LMHead`, whose kernels take a draft token's logits at a fraction of ``F.linear``'s cost (the
        manual's Backends page)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        bias = None if self._head_bias is None else self._head_bias.detach()[ids]
        head = LMHead(self._head.weight.detach()[ids], bias)
        return lambda hidden: self._logits(hidden, head)

    def hidden_states(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                      tree_mask: torch.Tensor | None = None,
                      prefix: PrefixKV | None = None, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the decoder on a new block; returns final hidden states ``[B, n, H]`` and ``valid``.
        With ``prefix`` the first layers come ready-made (see :class:`PrefixKV`); with ``layers``, those
        layers' outputs follow the final states along the last axis (see :meth:`CausalLM.forward`)."""
        layers = tuple(layers)
        if prefix is not None and not prefix.fits(torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid,
                                                  tree_mask):
            prefix = None  # another block than the one the draft computed: every layer runs
        if layers and (prefix is not None or not all(0 < layer < len(self._decoder.layers) for layer in layers)):
            raise ConfigError(f"hidden states of layers {list(layers)} are not available from this "
                              f"{len(self._decoder.layers)}-layer model" + (" with a prefix" if prefix is not None else ""))
        tokens = tokens.to(self.device)
        batch, n = tokens.shape
        if batch != self._lengths.shape[0]:
            raise ValueError(f"model holds {self._lengths.shape[0]} rows, got a block of {batch}")
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        valid = valid.to(self.device)
        if tree_mask is None:
            tree_mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril().expand(batch, n, n)
        tree_mask = tree_mask.to(self.device)
        depth = (tree_mask & valid.unsqueeze(1)).sum(-1) - 1
        query_positions = self._lengths.unsqueeze(1) + depth.clamp(min=0)
        if self.max_context is not None and int(query_positions.masked_fill(~valid, 0).max()) >= self.max_context:
            raise ContextLengthError(f"sequence would exceed the model's context of {self.max_context} tokens")
        masks = self._attention_masks(query_positions, tree_mask, valid)
        self._block_start = self.num_slots
        with torch.inference_mode():
            if prefix is None:
                def decode(_kernel: str | None):  # the linears read the kernel from the shared choice
                    return self._decoder(input_ids=tokens, attention_mask=self._mask_argument(masks),
                                         position_ids=query_positions, use_cache=True,
                                         output_hidden_states=bool(layers), **{self._cache_kwarg: self.cache})

                out = decode(None) if self.linear_kernels is None else self.linear_kernels.run(tokens.numel(), decode)
            else:
                out = self._tail(prefix.num_layers)(
                    inputs_embeds=prefix.hidden.to(self.device, self.dtype), attention_mask=self._mask_argument(masks),
                    position_ids=query_positions, use_cache=True, **{self._cache_kwarg: self.cache})
                for layer, (keys, values) in enumerate(zip(prefix.keys, prefix.values)):
                    self.cache.update(keys.to(self.device), values.to(self.device), layer)
        self.slot_positions = torch.cat([self.slot_positions, torch.full_like(tokens, -1)], dim=1)
        if layers:
            return torch.cat([out.last_hidden_state] + [out.hidden_states[layer] for layer in layers], -1), valid
        return out.last_hidden_state, valid

    def _tail(self, start: int):
        """The decoder from layer ``start`` on (fed hidden states instead of token ids)."""
        if start not in self._tails:
            if not 0 < start < len(self._decoder.layers):
                raise ConfigError(f"a prefix of {start} layers does not fit a {len(self._decoder.layers)}-layer model")
            self._tails[start] = decoder_view(self._decoder, list(range(start, len(self._decoder.layers))))
        return self._tails[start]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, last_only: bool = False,
                prefix: PrefixKV | None = None, return_hidden: bool = False, hidden_layers: tuple[int, ...] = ()):
        """See :meth:`CausalLM.forward`; ``prefix``: layers already computed by an early-exit draft."""
        states, valid = self.hidden_states(tokens, valid, tree_mask, prefix, hidden_layers)
        hidden = states[..., :self.config.hidden_size]
        if last_only:
            last = valid.long().cumsum(-1).argmax(-1)  # index of the last valid token
            hidden = hidden[torch.arange(hidden.shape[0], device=self.device), last].unsqueeze(1)
            logits = self.head(hidden)
        elif bool(valid.all()):
            logits = self.head(hidden)
        else:
            # the head only where a token is real: with a 262k vocabulary it is a large share of a verified
            # token's cost (genspec/kernels.py has the kernel timings), and padding is never read
            logits = hidden.new_zeros(*hidden.shape[:-1], self.vocab_size)
            logits[valid] = self.head(hidden[valid]).to(logits.dtype)
        return (logits, states) if return_hidden else logits

    @torch.inference_mode()
    def commit_all(self, valid: torch.Tensor | None = None) -> None:
        """Keep every valid token of the last block (a prefill or a plain decode step)."""
        n = self.num_slots - self._block_start
        keep = torch.arange(n, device=self.device).expand(self._lengths.shape[0], n).clone()
        if valid is not None:
            keep = keep.masked_fill(~valid.to(self.device), -1)
            keep = keep.gather(1, (keep < 0).long().argsort(dim=1, stable=True))  # valid first, in order
        self.keep_block(keep)


def _padded(tensor: torch.Tensor | None, rows: int, slots: int, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``[rows, H, S, D]`` padded with zeros to ``slots`` slots (an all-hole block if None)."""
    if tensor is None:
        return like.new_zeros(rows, like.shape[1], slots, like.shape[3])
    return torch.nn.functional.pad(tensor, (0, 0, 0, slots - tensor.shape[2]))


def _filled_layers(cache):
    """The layers of a ``DynamicCache`` that hold key / value tensors."""
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4:
            yield layer


#: from this many rows on, the decoder's linears take the packed GEMM when their kernel is not timed
#: (TransposedLinear's docstring has the timings)
PACKED_MIN_ROWS = 3
#: the decoder's linears time their kernels for passes of up to this many rows (decode steps and verify
#: blocks of a batch); a prefill's hundreds of rows keep the fixed choice
LINEAR_TUNE_MAX_ROWS = 64


def linear_kernels(weights: list[torch.Tensor], tune: bool | None = None, exact: bool = False) -> KernelTuner:
    """The kernel choice shared by the linear layers of ``weights`` (a decoder's): ``F.linear``,
    ``W @ x.T`` or the packed GEMM; fixed (``W @ x.T`` below ``PACKED_MIN_ROWS`` rows, then packed), or
    with ``tune`` (default: a large CPU decoder, :func:`genspec.kernels.worth_tuning`) timed per row count
    over whole decoder passes (:meth:`HFCausalLM.hidden_states`). ``exact``: ``blocks`` for every row count
    (:meth:`TransposedLinear.blocks`), untimed."""
    if exact:
        return KernelTuner(("blocks",), lambda rows: "blocks")
    packs = all(packable(w) for w in weights)

    def default(rows: int) -> str:
        return "packed" if packs and rows >= PACKED_MIN_ROWS else "gemm"

    return KernelTuner(("linear", "gemm", "packed") if packs else ("linear", "gemm"), default,
                       worth_tuning(*weights) if tune is None else tune, max_rows=LINEAR_TUNE_MAX_ROWS)


class TransposedLinear(torch.nn.Module):
    """``nn.Linear`` computed with the kernel its :class:`~genspec.kernels.KernelTuner` picks for the
    number of rows, shared by all the linears of a decoder: ``F.linear``; the transposed product
    ``(W @ x.T).T`` (one row duplicated to two); or oneDNN's GEMM over a packed copy of the weight
    (:class:`genspec.kernels.PackedWeight`, where the weight can take it and no gradient is asked for).
    All exact: the same fp32 products; only the summation order differs.

    The ranking differs between CPUs, hence the timing: on one CPU measured one or two rows go faster as
    ``W @ x.T`` with one row as two columns (MKL's two-column GEMM beats its one-column GEMV) and the packed
    GEMM is the fastest from 3 rows on; on another ``F.linear`` is the fastest for one or two rows and
    ``W @ x.T`` the slowest (the manual's Backends page has the measurements). The result is made
    contiguous because a transposed view sends every later op of the layer (norms, RoPE, attention) down a
    strided path: the CPU flash attention refuses a query whose last dimension is strided and falls back
    to the math kernel. Shares the original weight; the packed copy (as large again: 400 MB for the
    embedded model) is made the first time the packed GEMM runs. ``HFCausalLM(..., fast_kernels=False)``
    keeps the stock layers. The fourth kernel, ``blocks``, is the exact models' (:meth:`blocks`)."""

    def __init__(self, linear: torch.nn.Linear, tuner: KernelTuner | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed_weight = PackedWeight(self.weight)
        #: the kernel choice (shared by a decoder's linears; its own fixed one when built alone)
        self.tuner = tuner if tuner is not None else linear_kernels([self.weight], tune=False)

    def kernel(self, rows: torch.Tensor) -> str:
        """``"linear"``, ``"gemm"`` or ``"packed"``: what a product with ``rows`` ``[R, in]`` runs."""
        if needs_grad(rows, self.weight):
            return "gemm"
        kernel = self.tuner.kernel(rows.shape[0])
        return "gemm" if kernel == "packed" and not packable(self.weight) else kernel

    def blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """The packed GEMM (``F.linear`` where the weight cannot take it, as :meth:`genspec.kernels.LMHead.blocks`
        says why) ``EXACT_ROWS`` rows at a time (:func:`genspec.kernels.in_fixed_blocks`), for ``rows``
        ``[R, in]``: each row's result the same whatever the number of rows."""
        kernel = "packed" if packable(self.weight) else "linear"
        return in_fixed_blocks(rows, lambda block: self.product(kernel, block))

    def product(self, kernel: str, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[R, in]`` times the weight (plus the bias) with ``kernel``."""
        if kernel == "linear":
            return torch.nn.functional.linear(rows, self.weight, self.bias)
        if kernel == "packed":
            return self.packed_weight(rows, self.bias)
        if kernel == "blocks":
            return self.blocks(rows)
        out = weight_times_rows(self.weight, rows).contiguous()
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.product(self.kernel(rows), rows).reshape(*x.shape[:-1], self.out_features)


def transpose_linears(module: torch.nn.Module, tune: bool | None = None, exact: bool = False) -> KernelTuner:
    """Replace every ``nn.Linear`` below ``module`` by a :class:`TransposedLinear` (in place), all sharing
    one kernel choice (:func:`linear_kernels`), which is returned. ``exact``: the exact choice, taken by the
    ``TransposedLinear`` layers already there too (a model wrapped before), so that every product is exact."""
    found = [(parent, name, child) for parent in list(module.modules())
             for name, child in list(parent.named_children()) if type(child) is torch.nn.Linear]
    tuner = linear_kernels([child.weight for _, _, child in found], tune, exact)
    for parent, name, child in found:
        setattr(parent, name, TransposedLinear(child, tuner))
    if exact:
        for layer in module.modules():
            if isinstance(layer, TransposedLinear):
                layer.tuner = tuner
    return tuner
