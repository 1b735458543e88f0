"""Cheaper models made from the target itself, for self-speculation.

- :func:`early_exit`: the target's first L layers + its final norm and LM head (LayerSkip, Kangaroo).
- :func:`layer_skip`: the target with a set of layers skipped (SWIFT, Draft-on-the-fly).
- :func:`quantized`: a copy of the target with int8 dynamic quantisation of its Linear layers.
- :func:`pruned`: the target structurally pruned: fewer layers, attention heads and MLP channels (the
  choice is ``genspec calibrate prune``'s, :func:`genspec.calibration.prune_plan`); its own, smaller weights
  may be healed (:mod:`genspec.train.heal`) and saved apart (:func:`save_own_weights`).
Early exit and layer skip share the target's weights (no copy), a pruned copy every module it keeps whole
(embeddings, norms, the LM head, unpruned projections); each variant keeps its own KV cache,
and an early-exit draft hands the layers it computed to the target's verify pass (KV reuse).
Any of them may also draft over a truncated vocabulary (``vocab_subset``, FR-Spec style): the LM head
(262k x 640 on Gemma 3) is a large part of a step, so a draft that evaluates it in full is never cheap.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from genspec.errors import ConfigError, InputFileError
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

    def add_rows(self, prefixes: list[list[int]], return_hidden: bool = False, hidden_layers: tuple[int, ...] = (),
                 hidden_last: int | None = None):
        held = self._exit_hidden
        hidden = super().add_rows(prefixes, return_hidden, hidden_layers, hidden_last)  # resets, prefills the new rows (recording theirs), merges
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


# ---------------------------------------------------------------- structured pruning
def attention_shape(layer) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head size)`` of a decoder layer whose attention has Llama-style
    ``q_proj``/``k_proj``/``v_proj``/``o_proj`` projections and whose MLP is gated
    (``gate_proj``/``up_proj``/``down_proj``): Llama, Gemma, Qwen, Mistral... Another layout is refused."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if (attention is None or mlp is None or not isinstance(getattr(attention, "head_dim", None), int)
            or not all(hasattr(attention, n) for n in names)
            or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))):
        raise ConfigError(f"cannot prune a {type(layer).__name__}: pruning needs Llama-style attention "
                          "(q_proj, k_proj, v_proj, o_proj) and a gated MLP (gate_proj, up_proj, down_proj)")
    size = attention.head_dim
    return attention.q_proj.out_features // size, attention.k_proj.out_features // size, size


def _kept_linear(linear, rows: torch.Tensor | None = None, columns: torch.Tensor | None = None):
    """A new linear of the same kind (``nn.Linear`` or :class:`TransposedLinear`) holding the ``rows``
    (outputs) and ``columns`` (inputs) of ``linear``'s weight kept (None: all)."""
    with torch.no_grad():
        weight, bias = linear.weight.detach(), linear.bias
        if rows is not None:
            weight = weight.index_select(0, rows)
            bias = None if bias is None else bias.detach().index_select(0, rows)
        if columns is not None:
            weight = weight.index_select(1, columns)
        new = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                              device=weight.device, dtype=weight.dtype)
        new.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        if bias is not None:
            new.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return TransposedLinear(new, linear.tuner) if isinstance(linear, TransposedLinear) else new


def _copy_module(module):
    """A shallow copy of ``module`` whose submodules can be replaced without touching the original."""
    view = copy.copy(module)
    view._modules = dict(module._modules)
    return view


def _check_indices(indices: list, size: int, what: str) -> None:
    """``indices`` must be distinct sorted ints in 0..size-1, at least one."""
    if (not isinstance(indices, (list, tuple)) or not indices
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
            or sorted(set(indices)) != list(indices) or indices[0] < 0 or indices[-1] >= size):
        shown = indices if not isinstance(indices, (list, tuple)) or len(indices) <= 8 else \
            f"[{indices[0]!r}, ... ({len(indices)} values)]"
        raise ConfigError(f"{what} must be distinct sorted indices in 0..{size - 1}, at least one, got {shown}")


def _pruned_layer(layer, index: int, heads: list[int], channels: list[int]):
    """``layer`` keeping the query ``heads`` (each key/value head that serves none of them goes) and the
    MLP ``channels``; a part kept whole is the target's own module."""
    num_heads, num_kv, size = attention_shape(layer)
    per_group = num_heads // num_kv
    attention, mlp = layer.self_attn, layer.mlp
    intermediate = mlp.down_proj.in_features
    _check_indices(heads, num_heads, f"layer {index}: heads")
    _check_indices(channels, intermediate, f"layer {index}: MLP channels")
    heads, channels = list(heads), list(channels)
    groups = sorted({h // per_group for h in heads})
    counts = {sum(h // per_group == g for h in heads) for g in groups}
    if len(counts) != 1:  # grouped-query attention repeats each key/value head the same number of times
        raise ConfigError(f"layer {index}: each key/value head kept must serve as many query heads as the others "
                          f"(groups of {per_group}), got heads {heads}")
    if len(heads) == num_heads and len(channels) == intermediate:
        return layer
    new = _copy_module(layer)
    if len(heads) < num_heads:
        query = torch.cat([torch.arange(h * size, (h + 1) * size) for h in heads]).to(attention.q_proj.weight.device)
        pruned = _copy_module(attention)
        pruned.q_proj = _kept_linear(attention.q_proj, rows=query)
        pruned.o_proj = _kept_linear(attention.o_proj, columns=query)
        if len(groups) < num_kv:
            kv = torch.cat([torch.arange(g * size, (g + 1) * size) for g in groups]).to(query.device)
            pruned.k_proj = _kept_linear(attention.k_proj, rows=kv)
            pruned.v_proj = _kept_linear(attention.v_proj, rows=kv)
        pruned.num_key_value_groups = counts.pop()
        new.self_attn = pruned
    if len(channels) < intermediate:
        kept = torch.tensor(channels, dtype=torch.long, device=mlp.down_proj.weight.device)
        pruned = _copy_module(mlp)
        pruned.gate_proj = _kept_linear(mlp.gate_proj, rows=kept)
        pruned.up_proj = _kept_linear(mlp.up_proj, rows=kept)
        pruned.down_proj = _kept_linear(mlp.down_proj, columns=kept)
        if hasattr(mlp, "intermediate_size"):
            pruned.intermediate_size = len(channels)
        new.mlp = pruned
    return new


def pruned(target: HFCausalLM, layers: list[int], heads: list[list[int]], channels: list[list[int]],
           vocab_subset: torch.Tensor | None = None) -> HFCausalLM:
    """The target keeping only the ``layers`` (indices 0..N-1), and in layer i only the query heads
    ``heads[i]`` and the MLP channels ``channels[i]`` (one list per layer of the target; a key/value
    head none of whose query heads is kept goes too). The pruned projections are new, smaller weights;
    everything else (embeddings, norms, the LM head, the layers and projections kept whole) is the target's."""
    total = num_layers(target)
    if len(heads) != total or len(channels) != total:
        raise ConfigError(f"a pruning plan needs heads and channels for each of the target's {total} layers, "
                          f"got {len(heads)} and {len(channels)}")
    _check_indices(layers, total, "kept layers")
    view = decoder_view(target.decoder, list(layers))
    view.layers = torch.nn.ModuleList([_pruned_layer(target.decoder.layers[i], i, heads[i], channels[i])
                                       for i in layers])
    return HFCausalLM(target.model, target.tokenizer, fast_kernels=False, decoder=view, lm_head=target.lm_head,
                      vocab_subset=vocab_subset)


def decoder_parameters(model: HFCausalLM) -> int:
    """The number of weights in ``model``'s decoder layers (embeddings, final norm and LM head left out)."""
    return sum(p.numel() for p in model.decoder.layers.parameters())


def own_weights(draft: HFCausalLM, target: HFCausalLM) -> dict[str, torch.nn.Parameter]:
    """The weights of a copy made from ``target`` that are not the target's (a pruned copy's smaller
    projections), by their names in its decoder's layers (``"0.self_attn.q_proj.weight"``: its first layer)."""
    shared = {id(p) for p in target.model.parameters()}
    return {name: p for name, p in draft.decoder.layers.named_parameters() if id(p) not in shared}


def save_own_weights(path: str | Path, draft: HFCausalLM, target: HFCausalLM) -> None:
    """:func:`own_weights` (a healed pruned copy's) to a safetensors file."""
    save_file({name: p.detach().contiguous() for name, p in own_weights(draft, target).items()}, str(path))


def load_own_weights(path: str | Path, draft: HFCausalLM, target: HFCausalLM) -> None:
    """Weights :func:`save_own_weights` wrote into ``draft``, a copy made by the same plan."""
    try:
        saved = load_file(str(path))
    except FileNotFoundError as exc:
        raise InputFileError(f"healed weights not found: {path}") from exc
    except (OSError, SafetensorError) as exc:
        raise InputFileError(f"cannot read the healed weights {path}: {str(exc).splitlines()[0]}") from exc
    load_weights(own_weights(draft, target), saved, str(path))


def load_weights(weights: dict[str, torch.nn.Parameter], saved: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``saved`` into ``weights`` (the same names and shapes, else an :class:`InputFileError`)."""
    if set(saved) != set(weights) or any(tuple(saved[n].shape) != tuple(weights[n].shape) for n in weights):
        raise InputFileError(f"{source} holds the weights of another pruned copy than this plan's")
    with torch.no_grad():
        for name, p in weights.items():
            p.copy_(saved[name].to(p.dtype))
