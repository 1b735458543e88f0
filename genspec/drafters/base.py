"""The drafter interface: anything that guesses the next tokens.

Life cycle (one generation request, possibly a batch of rows):
``begin(prompts, sampling, generator)`` once; then per step ``propose(sequences, max_tokens)``
returns a :class:`Draft` and ``feedback(accepted_lengths)`` tells what the target kept.
A drafter keeps its own state (its own KV cache, tables, ...) and never touches the target's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from genspec.sampling import SamplingConfig


@dataclass
class Draft:
    """Proposed continuations, one chain per row.

    tokens: ``[B, k]`` (padding beyond ``lengths`` is arbitrary); lengths: ``[B]``;
    probs: ``[B, k, V]`` the (processed) draft law each token was drawn from, or None when the drafter
    is deterministic (its law is the point mass on the token; lossless verification still holds).
    evidence: optional, per row, a small hashable grade of how well the proposal is backed (prompt
    lookup: the matched n-gram length); the cost-aware draft length learns acceptance per grade.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    evidence: list | None = None

    @classmethod
    def from_lists(cls, proposals: list[list[int]], device=None) -> "Draft":
        width = max((len(p) for p in proposals), default=0)
        tokens = torch.zeros(len(proposals), width, dtype=torch.long, device=device)
        for row, proposal in enumerate(proposals):
            if proposal:
                tokens[row, :len(proposal)] = torch.as_tensor(proposal, dtype=torch.long, device=device)
        lengths = torch.tensor([len(p) for p in proposals], dtype=torch.long, device=device)
        return cls(tokens, lengths)


@dataclass
class TreeDraft:
    """Several candidate chains per row (multi-draft), verified together as a token tree.

    chains: ``[B, M, k]`` tokens of M candidate chains; lengths: ``[B, M]``; probs: ``[B, M, k, V]``
    the draft law each token was drawn from, or None (deterministic candidates). Chains are
    independent draws; identical prefixes are merged into one tree node for the target pass, but
    every chain stays a separate candidate for the recursive residual verifier. evidence: as in
    :class:`Draft` (for the first chain).
    """

    chains: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    evidence: list | None = None


class Drafter(ABC):
    """Base class of every speculator. Subclasses set ``name`` and implement :meth:`propose`."""

    name: str = "drafter"
    #: True if proposals are deterministic (no probs), e.g. lookup drafters
    deterministic: bool = False

    def begin(self, prompts: list[list[int]], sampling: SamplingConfig,
              generator: torch.Generator | None = None) -> None:
        """Start a request: ``prompts`` are the token lists of the batch rows."""
        self.sampling = sampling
        self.generator = generator

    @abstractmethod
    def propose(self, sequences: list[list[int]], max_tokens: list[int]) -> Draft | TreeDraft:
        """Propose up to ``max_tokens[b]`` tokens continuing ``sequences[b]`` (all tokens so far)."""

    def feedback(self, accepted_lengths: list[int]) -> None:
        """How many proposed tokens the target kept, per row (after the last :meth:`propose`)."""
