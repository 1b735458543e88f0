"""The model interface every target and draft model implements.

A model holds a batch of token sequences in its own KV cache. ``forward`` appends a block of new
tokens (a chain, or a token tree with its ancestor mask) and returns their logits; ``truncate`` and
``keep_block`` roll the cache back after a rejection. Rows are independent: each has its own length.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class CausalLM(ABC):
    """A causal language model with a per-row KV cache.

    Shapes: ``B`` rows, ``n`` new tokens, ``V`` vocabulary.
    """

    vocab_size: int
    #: maximum sequence length (prompt + generated) or None if unbounded
    max_context: int | None = None
    device: torch.device = torch.device("cpu")

    @abstractmethod
    def reset(self, batch_size: int) -> None:
        """Forget every sequence; the next ``forward`` starts ``batch_size`` empty rows."""

    @abstractmethod
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Append ``tokens`` ``[B, n]`` to each row and return logits ``[B, n, V]``.

        ``valid`` ``[B, n]`` marks real tokens (padding is right-aligned per row and is not kept).
        ``tree_mask`` ``[B, n, n]`` bool: entry (i, j) says new token i may see new token j (its
        ancestor or itself); default causal (a chain). Token i's position is the row's length plus its
        depth (number of new ancestors, itself excluded). With ``last_only`` the logits are
        ``[B, 1, V]`` for each row's last valid token (prefill needs no more).
        """

    @abstractmethod
    def keep_block(self, keep: torch.Tensor) -> None:
        """After a ``forward``, keep only some of its tokens, in order: ``keep`` ``[B, m]`` holds
        indices into the last block (-1 = nothing), e.g. the accepted path of a tree or the first
        a + 1 tokens of a chain. The kept tokens must form a chain (each the child of the previous)."""

    @abstractmethod
    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first ``lengths[b]`` tokens of row b (``lengths`` ``[B]``)."""

    @property
    @abstractmethod
    def lengths(self) -> torch.Tensor:
        """``[B]`` number of tokens held per row."""
