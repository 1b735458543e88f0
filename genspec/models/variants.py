"""Cheaper models made from the target itself, for self-speculation.

- :func:`early_exit`: the target's first L layers + its final norm and LM head (LayerSkip, Kangaroo).
- :func:`layer_skip`: the target with a set of layers skipped (SWIFT, Draft-on-the-fly).
- :func:`quantized`: a copy of the target with int8 dynamic quantisation of its Linear layers.
Early exit and layer skip share the target's weights (no copy); each variant keeps its own KV cache.
Any of them may also draft over a truncated vocabulary (``vocab_subset``, FR-Spec style): the LM head
(262k x 640 on Gemma 3) is a large part of a step, so a draft that evaluates it in full is never cheap.
"""
from __future__ import annotations

import copy
import warnings

import torch

from genspec.errors import ConfigError
from genspec.models.hf import HFCausalLM, TransposedLinear


def num_layers(target: HFCausalLM) -> int:
    return len(target._decoder.layers)


def _decoder_view(target: HFCausalLM, kept: list[int]):
    """A shallow copy of the target's decoder that runs only the layers ``kept`` (weights shared)."""
    decoder = target._decoder
    view = copy.copy(decoder)
    view._modules = dict(decoder._modules)
    view.layers = torch.nn.ModuleList([decoder.layers[i] for i in kept])
    config = copy.copy(decoder.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [decoder.config.layer_types[i] for i in kept]
    view.config = config
    return view


def layer_skip(target: HFCausalLM, skip: list[int], vocab_subset: torch.Tensor | None = None) -> HFCausalLM:
    """The target without the layers in ``skip`` (indices 0..N-1)."""
    total = num_layers(target)
    bad = [i for i in skip if not (isinstance(i, int) and 0 <= i < total)]
    if bad:
        raise ConfigError(f"layer indices {bad} out of range: the model has layers 0..{total - 1}")
    kept = [i for i in range(total) if i not in set(skip)]
    if not kept:
        raise ConfigError("cannot skip every layer")
    return HFCausalLM(target.model, target.tokenizer, fast_kernels=False, decoder=_decoder_view(target, kept),
                      lm_head=target._lm_head, vocab_subset=vocab_subset)


def early_exit(target: HFCausalLM, exit_layer: int, vocab_subset: torch.Tensor | None = None) -> HFCausalLM:
    """The target's first ``exit_layer`` layers, then its final norm and LM head."""
    total = num_layers(target)
    if not (isinstance(exit_layer, int) and 1 <= exit_layer <= total):
        raise ConfigError(f"exit layer must be in 1..{total}, got {exit_layer}")
    return layer_skip(target, list(range(exit_layer, total)), vocab_subset)


def quantized(target: HFCausalLM, vocab_subset: torch.Tensor | None = None) -> HFCausalLM:
    """A copy of the target with every Linear layer (LM head included) quantised to int8 (PyTorch
    dynamic quantisation: int8 weights, activations quantised on the fly)."""
    model = copy.deepcopy(target.model)
    for parent in list(model.modules()):  # back to nn.Linear, which the quantiser knows
        for name, child in list(parent.named_children()):
            if isinstance(child, TransposedLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight = torch.nn.Parameter(child.weight_t.detach().t().contiguous(), requires_grad=False)
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
