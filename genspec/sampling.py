"""Turning logits into the probabilities that are sampled and verified.

Speculative decoding is lossless only if the draft and the target distributions are processed the
same way (temperature, top-k, top-p, repetition penalty) *before* the acceptance rule compares them.
This module is that one processing function; the engine calls it for both models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from genspec.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax); verification is token match.

    ``top_k == 0`` and ``top_p == 1`` disable those filters; ``repetition_penalty == 1`` disables it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): logits of tokens already seen are divided by
    ``penalty`` when positive, multiplied when negative. ``seen`` is a bool mask shaped like ``logits``."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def seen_mask(sequences: list[list[int]], vocab_size: int, device=None) -> torch.Tensor:
    """``[B, V]`` bool: which tokens occur in each row's sequence (for the repetition penalty)."""
    mask = torch.zeros(len(sequences), vocab_size, dtype=torch.bool, device=device)
    for row, sequence in enumerate(sequences):
        if sequence:
            mask[row, torch.as_tensor(sequence, device=device)] = True
    return mask


def block_seen_mask(base_seen: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, n, V]``: position i of a block sees ``base_seen`` plus block tokens 1..i (token 0 of a
    verify block is the last token of the sequence, already in ``base_seen``)."""
    vocab = base_seen.shape[-1]
    one_hot = torch.zeros(*block_tokens.shape, vocab, dtype=torch.bool, device=base_seen.device)
    one_hot.scatter_(-1, block_tokens.unsqueeze(-1), True)
    one_hot[:, 0] = False
    return base_seen.unsqueeze(1) | (one_hot.long().cummax(dim=1).values.bool())


def process_logits(logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition penalty (if configured and ``seen`` is given), then :func:`logits_to_probs`."""
    if seen is not None and config.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, config.repetition_penalty)
    return logits_to_probs(logits, config)


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Processed probabilities ``[..., V]`` from raw (already repetition-penalised) logits ``[..., V]``.

    Applies temperature, then top-k, then top-p (nucleus), then softmax; computed in float32 at least
    (float64 stays float64). Greedy configs (temperature 0) return the one-hot of the argmax, which
    is the distribution greedy decoding samples from.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= config.top_p  # the top token always stays (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(-1)
