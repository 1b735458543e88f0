"""A separate (smaller) language model with the target's tokenizer drafts autoregressively.

The draft model keeps its own KV cache. Before drafting it syncs with the committed sequence the
llama.cpp way: keep the longest common prefix of what it holds and what the target committed,
drop the rest, and feed the difference in one ragged block.
"""
from __future__ import annotations

import torch

from genspec.drafters.base import Draft, Drafter, TreeDraft
from genspec.errors import ConfigError
from genspec.models.base import CausalLM
from genspec.sampling import apply_repetition_penalty, process_logits, seen_mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelDrafter(Drafter):
    """Drafts with ``model``; ``num_drafts`` > 1 samples that many independent chains (multi-draft)."""

    name = "draft-model"

    def __init__(self, model: CausalLM, num_drafts: int = 1):
        if num_drafts < 1:
            raise ConfigError(f"num_drafts must be >= 1, got {num_drafts}")
        self.model = model
        self.num_drafts = num_drafts
        self._held: list[list[int]] = []

    def begin(self, prompts, sampling, generator=None):
        super().begin(prompts, sampling, generator)
        self.model.reset(len(prompts))
        self._held = [[] for _ in prompts]

    # --------------------------------------------------------------- helpers
    def _sync(self, sequences: list[list[int]], active: list[bool]) -> torch.Tensor:
        """Bring the model's cache to ``sequences`` (minus nothing) and return the logits
        ``[B, V]`` for the next token of each row."""
        keep = [min(_common_prefix(held, seq), len(seq) - 1) for held, seq in zip(self._held, sequences)]
        self.model.truncate(torch.tensor(keep, dtype=torch.long))
        new = [seq[k:] if on else [] for seq, k, on in zip(sequences, keep, active)]
        width = max(1, max(len(n) for n in new))
        tokens = torch.zeros(len(new), width, dtype=torch.long)
        valid = torch.zeros(len(new), width, dtype=torch.bool)
        for row, chunk in enumerate(new):
            tokens[row, :len(chunk)] = torch.tensor(chunk, dtype=torch.long)
            valid[row, :len(chunk)] = True
        logits = self.model.forward(tokens, valid, last_only=True)[:, 0]
        self.model.commit_all(valid)
        self._held = [seq[:k] + chunk for seq, k, chunk in zip(sequences, keep, new)]
        return logits

    def _choose(self, logits: torch.Tensor, sequences: list[list[int]]):
        """Next draft token ``[B]`` and the law it was drawn from ``[B, V]`` (None when greedy)."""
        penalty = self.sampling.repetition_penalty != 1.0
        seen = seen_mask(sequences, logits.shape[-1], logits.device) if penalty else None
        if self.sampling.greedy:
            if seen is not None:
                logits = apply_repetition_penalty(logits, seen, self.sampling.repetition_penalty)
            return logits.argmax(-1), None
        probs = process_logits(logits, self.sampling, seen)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1), probs

    def _draft_chain(self, sequences, max_tokens):
        active = [m > 0 for m in max_tokens]
        logits = self._sync(sequences, active)
        width = max(max_tokens, default=0)
        tokens, laws = [], []
        current = [list(s) for s in sequences]
        for step in range(width):
            token, law = self._choose(logits, current)
            tokens.append(token)
            laws.append(law)
            if step + 1 == width:
                break
            running = torch.tensor([step + 1 < m for m in max_tokens])
            for row, seq in enumerate(current):
                if running[row]:
                    seq.append(int(token[row]))
            logits = self.model.forward(token.unsqueeze(1), running.unsqueeze(1))[:, 0]
            self.model.commit_all(running.unsqueeze(1))
            self._held = [held + [int(token[row])] if running[row] else held for row, held in enumerate(self._held)]
        lengths = torch.tensor(max_tokens, dtype=torch.long)
        if not tokens:
            return Draft(torch.zeros(len(sequences), 0, dtype=torch.long), lengths.clamp(max=0))
        probs = None if self.sampling.greedy else torch.stack(laws, dim=1)
        return Draft(torch.stack(tokens, dim=1), lengths, probs)

    # --------------------------------------------------------------- interface
    def propose(self, sequences, max_tokens):
        if self.num_drafts == 1 or self.sampling.greedy:
            return self._draft_chain(sequences, max_tokens)
        chains = [self._draft_chain(sequences, max_tokens) for _ in range(self.num_drafts)]
        probs = torch.stack([c.probs for c in chains], dim=1) if chains[0].probs is not None else None
        return TreeDraft(torch.stack([c.tokens for c in chains], dim=1),
                         torch.stack([c.lengths for c in chains], dim=1), probs)
