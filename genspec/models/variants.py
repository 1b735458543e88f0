"""Cheaper models made from the target itself, for self-speculation.

- :func:`early_exit`: the target's first L layers + its final norm and LM head (LayerSkip, Kangaroo).
- :func:`layer_skip`: the target with a set of layers skipped (SWIFT, Draft-on-the-fly).
- :func:`quantized`: a copy of the target with int8 dynamic quantisation of its Linear layers.
Early exit and layer skip share the target's weights (no copy); each variant keeps its own KV cache,
and an early-exit draft hands the layers it computed to the target's verify pass (KV reuse).
Any of them may also draft over a truncated vocabulary (``vocab_subset``, FR-Spec style): the LM head
(262k x 640 on Gemma 3) is a large part of a step, so a draft that evaluates it in full is never cheap.
"""
from __future__ import annotations

import copy
import warnings

import torch

from genspec.errors import ConfigError
from genspec.models.base import CausalLM, PrefixKV
from genspec.models.hf import HFCausalLM, TransposedLinear, decoder_view


def num_layers(target: HFCausalLM) -> int:
    return target.num_layers


class EarlyExitModel(HFCausalLM):
    """The target's first L layers (weights shared), then the target's final norm and head.

    It also serves the target's verify pass (LayerSkip-style KV reuse): the draft has already run
    layers 0..L-1 over the tokens it drafted, so :meth:`prefix_for` hands their keys / values and the
    hidden states entering layer L to the target, which then runs only layers L.. for the block
    (see :class:`genspec.models.base.PrefixKV`). The hidden states of the last few positions of each
    row are kept for that."""

    KEEP = 64  # positions per row whose layer-L hidden states are kept

    def __init__(self, target: HFCausalLM, exit_layer: int, vocab_subset=None):
        view = decoder_view(target.decoder, list(range(exit_layer)), final_norm=False)
        super().__init__(target.model, target.tokenizer, fast_kernels=False, decoder=view,
                         lm_head=target.lm_head, vocab_subset=vocab_subset, final_norm=target.decoder.norm)
        self.source = target
        self.exit_layer = exit_layer

    def reset(self, batch_size: int = 0) -> None:
        super().reset(batch_size)
        self._exit_hidden: list[dict[int, torch.Tensor]] = [{} for _ in range(batch_size)]

    def add_rows(self, prefixes: list[list[int]], return_hidden: bool = False, hidden_layers: tuple[int, ...] = ()):
        held = self._exit_hidden
        hidden = super().add_rows(prefixes, return_hidden, hidden_layers)  # resets, prefills the new rows (recording theirs), merges
        self._exit_hidden = held + self._exit_hidden
        return hidden

    def remove_rows(self, rows: list[int]) -> None:
        super().remove_rows(rows)
        gone = set(rows)
        self._exit_hidden = [r for i, r in enumerate(self._exit_hidden) if i not in gone] if self.num_rows else []

    def hidden_states(self, tokens, valid=None, tree_mask=None, prefix=None, layers=()):
        before = self._lengths.clone()
        hidden, valid = super().hidden_states(tokens, valid, tree_mask, prefix, layers)
        final = hidden[..., :self.config.hidden_size]
        if tree_mask is None:  # chains: position = row length + index among the valid tokens
            positions = before.unsqueeze(1) + valid.long().cumsum(-1) - 1
            for row in range(hidden.shape[0]):
                record, last = self._exit_hidden[row], int(before[row]) + int(valid[row].sum())
                for j in valid[row].nonzero().flatten().tolist()[-self.KEEP:]:
                    record[int(positions[row, j])] = final[row, j]
                for position in [p for p in record if p < last - self.KEEP]:
                    del record[position]
        return hidden, valid

    @property
    def prefix_source(self) -> CausalLM:
        return self.source

    def shares_prefix_with(self, target: CausalLM) -> bool:
        return target is self.source

    def prefix_for(self, target: CausalLM, start: torch.Tensor, valid: torch.Tensor) -> PrefixKV | None:
        """Layers 0..L-1 of the block at positions ``start[b] + j`` (``valid`` ``[B, n]``), all of which
        this model must hold; None if some hidden state is no longer kept."""
        if not self.shares_prefix_with(target):
            return None
        batch, n = valid.shape
        wanted = start.unsqueeze(1) + torch.arange(n)
        hidden = torch.zeros(batch, n, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for row in range(batch):
            for j in valid[row].nonzero().flatten().tolist():
                state = self._exit_hidden[row].get(int(wanted[row, j]))
                if state is None or int(wanted[row, j]) >= int(self._lengths[row]):
                    return None
                hidden[row, j] = state
        match = self.slot_positions.unsqueeze(2) == wanted.to(self.device).unsqueeze(1)  # [B, S, n]
        slots = match.long().argmax(1)  # [B, n] (padding: any slot, never kept by the target)
        keys, values = [], []
        for layer in list(self._cache_tensors())[:self.exit_layer]:
            index = slots[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            keys.append(layer.keys.gather(2, index))
            values.append(layer.values.gather(2, index))
        return PrefixKV(hidden, keys, values, valid.clone())


def layer_skip(target: HFCausalLM, skip: list[int], vocab_subset: torch.Tensor | None = None) -> HFCausalLM:
    """The target without the layers in ``skip`` (indices 0..N-1)."""
    total = num_layers(target)
    bad = [i for i in skip if not (isinstance(i, int) and 0 <= i < total)]
    if bad:
        raise ConfigError(f"layer indices {bad} out of range: the model has layers 0..{total - 1}")
    kept = [i for i in range(total) if i not in set(skip)]
    if not kept:
        raise ConfigError("cannot skip every layer")
    return HFCausalLM(target.model, target.tokenizer, fast_kernels=False, decoder=decoder_view(target.decoder, kept),
                      lm_head=target.lm_head, vocab_subset=vocab_subset)


def early_exit(target: HFCausalLM, exit_layer: int, vocab_subset: torch.Tensor | None = None) -> HFCausalLM:
    """The target's first ``exit_layer`` layers, then its final norm and LM head."""
    total = num_layers(target)
    if not (isinstance(exit_layer, int) and 1 <= exit_layer <= total):
        raise ConfigError(f"exit layer must be in 1..{total}, got {exit_layer}")
    if exit_layer == total:  # the whole model: nothing to hand over
        return layer_skip(target, [], vocab_subset)
    return EarlyExitModel(target, exit_layer, vocab_subset)


def first_layers(target: HFCausalLM, count: int) -> HFCausalLM:
    """The target's first ``count`` layers (weights shared, its own KV cache), whose hidden states are
    those layers' output un-normed (transformers' ``hidden_states[count]``): what a draft head with
    ``token_layers`` reads of each committed token (:class:`genspec.speculators.head.DraftHead`)."""
    total = num_layers(target)
    if not (isinstance(count, int) and 1 <= count < total):
        raise ConfigError(f"the number of the target's layers to run must be in 1..{total - 1}, got {count}")
    return HFCausalLM(target.model, target.tokenizer, fast_kernels=False, lm_head=target.lm_head,
                      decoder=decoder_view(target.decoder, list(range(count)), final_norm=False))


def quantized(target: HFCausalLM, vocab_subset: torch.Tensor | None = None) -> HFCausalLM:
    """A copy of the target with every Linear layer (LM head included) quantised to int8 (PyTorch
    dynamic quantisation: int8 weights, activations quantised on the fly)."""
    model = copy.deepcopy(target.model)
    for parent in list(model.modules()):  # back to nn.Linear, which the quantiser knows
        for name, child in list(parent.named_children()):
            if isinstance(child, TransposedLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight = child.weight  # the deep copy's own
                linear.bias = child.bias
                setattr(parent, name, linear)
    head = model.get_output_embeddings()
    weight = head.weight.detach()
    if vocab_subset is not None:
        subset = torch.as_tensor(vocab_subset, dtype=torch.long).unique()
        weight = weight[subset]
    untied = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    untied.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    model.set_output_embeddings(untied)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice; the API still works in torch 2.x
        from torch.ao.quantization import quantize_dynamic

        quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    variant = HFCausalLM(model, target.tokenizer, fast_kernels=False)
    variant.vocab_size = target.vocab_size
    if vocab_subset is not None:  # the quantised head computes the subset; widen to the full vocabulary
        variant.vocab_subset = subset
    return variant
