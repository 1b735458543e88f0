"""Prompt lookup: draft what followed the most recent earlier occurrence of the sequence's last n-gram
(longest n first), searched in the prompt and the generated text. No model, almost no cost.

Why an incremental index: ``propose`` runs every step on sequences of thousands of tokens that only
grow between calls, so each row keeps a hash index of its n-grams (n-gram -> positions) and only
indexes the tokens appended since the last call: a lookup is a few dict probes instead of a scan of
the whole sequence. If a sequence changed (a hierarchical stack proposes on uncommitted text), the
index rolls back to the common prefix first, so it is exact for any caller.

With ``num_candidates > 1`` the drafter returns a :class:`TreeDraft` of continuations that start
with distinct tokens (from different earlier matches, longest n-gram and most recent first); the
engine verifies them together as a token tree, losslessly (deterministic drafts, ``probs=None``).
"""
from __future__ import annotations

import torch

from genspec.drafters.base import Draft, Drafter, TreeDraft
from genspec.errors import ConfigError


def common_prefix_length(held: list[int], sequence: list[int]) -> int:
    """Length of the common prefix of two token lists (fast path: ``sequence`` extends ``held``)."""
    n = len(held)
    if len(sequence) >= n and sequence[:n] == held:
        return n
    n = min(n, len(sequence))
    for i in range(n):
        if held[i] != sequence[i]:
            return i
    return n


def copy_forward(tokens: list[int], start: int, count: int) -> list[int]:
    """``count`` tokens read from ``tokens[start:]``; a copy that runs into the end goes on with its
    own output (the text repeats with period ``len(tokens) - start``, as in LZ77)."""
    out = tokens[start:start + count]
    period = len(tokens) - start
    while len(out) < count and period > 0:
        out.append(out[len(out) - period])
    return out


def check_ngram_range(min_ngram: int, max_ngram: int, what: str = "prompt lookup") -> None:
    if int(min_ngram) != min_ngram or int(max_ngram) != max_ngram or min_ngram < 1 or max_ngram < min_ngram:
        raise ConfigError(f"{what} needs integers 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def check_candidates(num_candidates: int) -> None:
    if int(num_candidates) != num_candidates or num_candidates < 1:
        raise ConfigError(f"num_candidates must be an integer >= 1, got {num_candidates}")


def chain_from_lists(proposals: list[list[int]], evidence: list | None = None) -> Draft:
    """A :class:`Draft` (``[B, k]``, probs None) from per-row token lists, built with one tensor
    call (three times faster than filling rows one by one, which matters at a few microseconds)."""
    width = max((len(p) for p in proposals), default=0)
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in proposals], dtype=torch.long)
    return Draft(tokens.reshape(len(proposals), width), torch.tensor([len(p) for p in proposals], dtype=torch.long),
                 evidence=evidence)


def candidates_draft(found: list[tuple[list[list[int]], object]], num_candidates: int) -> Draft | TreeDraft:
    """The draft of a candidate drafter from per-row ``(chains, evidence)``: the best chain per row
    (``num_candidates == 1``) or a tree of up to ``num_candidates`` chains."""
    proposals, evidence = [f[0] for f in found], [f[1] for f in found]
    if num_candidates == 1:
        return chain_from_lists([p[0] if p else [] for p in proposals], evidence)
    return tree_from_lists(proposals, num_candidates, evidence)


def candidates_option(options: dict) -> dict:
    """Accept ``num_drafts`` (the CLI's ``--num-drafts``) as the model-free drafters' ``num_candidates``."""
    if "num_drafts" in options:
        if "num_candidates" in options:
            raise ConfigError("give num_candidates or num_drafts, not both")
        options = dict(options)
        options["num_candidates"] = options.pop("num_drafts")
    return options


def tree_from_lists(proposals: list[list[list[int]]], num_chains: int, evidence: list | None = None) -> TreeDraft:
    """A :class:`TreeDraft` (``[B, M, k]``, probs None) from per-row lists of up to ``num_chains``
    candidate chains (missing chains have length 0)."""
    width = max((len(chain) for row in proposals for chain in row), default=0)
    rows = [(row[:num_chains] + [[]] * (num_chains - len(row[:num_chains]))) for row in proposals]
    chains = torch.tensor([[c + [0] * (width - len(c)) for c in row] for row in rows], dtype=torch.long)
    lengths = torch.tensor([[len(c) for c in row] for row in rows], dtype=torch.long)
    return TreeDraft(chains.reshape(len(proposals), num_chains, width), lengths.reshape(len(proposals), num_chains),
                     evidence=evidence)


class NGramIndex:
    """Where every n-gram (``min_n <= n <= max_n``) of a growing token list occurred.

    ``positions[ngram]`` lists, oldest first, each ``j`` with ``tokens[j - n:j] == ngram`` and
    ``j < len(tokens)``: the index of the token that followed that occurrence.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = {}

    def sync(self, sequence: list[int]) -> None:
        """Make the index hold exactly ``sequence``: roll back a changed tail, then add the new tokens."""
        keep = common_prefix_length(self.tokens, sequence)
        if keep < len(self.tokens):
            self._truncate(keep)
        for token in sequence[len(self.tokens):]:
            self._append(token)

    def _append(self, token: int) -> None:
        tokens, j = self.tokens, len(self.tokens)
        for n in range(self.min_n, min(self.max_n, j) + 1):
            self.positions.setdefault(tuple(tokens[j - n:j]), []).append(j)
        tokens.append(token)

    def _truncate(self, length: int) -> None:
        tokens = self.tokens
        for j in range(len(tokens) - 1, length - 1, -1):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                key = tuple(tokens[j - n:j])
                found = self.positions[key]
                found.pop()  # positions are appended in order, so j is the last one
                if not found:
                    del self.positions[key]
        del tokens[length:]

    def matches(self, n: int) -> list[int]:
        """Continuation positions of earlier occurrences of the last ``n`` tokens, oldest first."""
        if n > len(self.tokens):
            return []
        return self.positions.get(tuple(self.tokens[len(self.tokens) - n:]), [])

    def continuations(self, num: int, max_scan: int = 64) -> list[tuple[int, int]]:
        """Up to ``num`` ``(position, n)``: continuation positions whose next tokens differ, with the
        length n of the matched n-gram; longest n first, then most recent first (at most
        ``max_scan`` occurrences looked at per n)."""
        starts, firsts = [], set()
        for n in range(self.max_n, self.min_n - 1, -1):
            for j in reversed(self.matches(n)[-max_scan:]):
                if self.tokens[j] not in firsts:
                    firsts.add(self.tokens[j])
                    starts.append((j, n))
                    if len(starts) == num:
                        return starts
        return starts


class PromptLookupDrafter(Drafter):
    """Prompt lookup (n-gram copy from the sequence itself).

    Options: ``max_ngram`` / ``min_ngram`` the n-gram sizes tried (longest first); ``num_candidates``
    continuations with distinct first tokens, verified as a tree when > 1; ``max_scan`` how many
    occurrences per n-gram size are looked at for distinct candidates.
    """

    name = "prompt-lookup"
    deterministic = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, num_candidates: int = 1, max_scan: int = 64):
        check_ngram_range(min_ngram, max_ngram)
        check_candidates(num_candidates)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.num_candidates = int(num_candidates)
        self.max_scan = max_scan
        self._indexes: list[NGramIndex] = []

    @classmethod
    def for_target(cls, target, **options) -> "PromptLookupDrafter":
        """The registry's factory (``genspec.load(drafter="prompt-lookup", **options)``)."""
        return cls(**candidates_option(options))

    def begin(self, prompts, sampling, generator=None):
        super().begin(prompts, sampling, generator)
        self._indexes = [NGramIndex(self.min_ngram, self.max_ngram) for _ in prompts]

    def fit_batch(self, batch: int) -> None:
        """Per-row indexes for ``batch`` rows (when used without :meth:`begin`, or with another batch)."""
        if len(self._indexes) != batch:
            self._indexes = [NGramIndex(self.min_ngram, self.max_ngram) for _ in range(batch)]

    def row_candidates(self, row: int, sequence: list[int], limit: int) -> tuple[list[list[int]], int]:
        """Candidate chains of ``row`` and the evidence: the n-gram length matched by the first one (0: none)."""
        index = self._indexes[row]
        index.sync(sequence)
        starts = index.continuations(self.num_candidates, self.max_scan)
        return [copy_forward(index.tokens, j, limit) for j, _ in starts], (starts[0][1] if starts else 0)

    def propose(self, sequences, max_tokens):
        self.fit_batch(len(sequences))
        return candidates_draft([self.row_candidates(row, seq, limit) if limit > 0 else ([], 0)
                                 for row, (seq, limit) in enumerate(zip(sequences, max_tokens))],
                                self.num_candidates)
