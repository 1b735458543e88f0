"""Prompt lookup: draft what followed the most recent earlier occurrence of the sequence's last n-gram
(longest n first), searched in the prompt and the generated text. No model, almost no cost.

Each request keeps an incremental :class:`~genspec.drafters.ngrams.NGramIndex` of its sequence, so a
lookup is a few dict probes. With ``num_candidates > 1`` the drafter proposes continuations that start
with distinct tokens (from different earlier matches, longest n-gram and most recent first); the
engine verifies them together as a token tree, losslessly.
"""
from __future__ import annotations

from genspec.drafters.base import RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngrams import NGramIndex, check_ngram_range, copy_forward


class PromptLookupDrafter(CandidateDrafter):
    """Prompt lookup (n-gram copy from the sequence itself).

    Options: ``max_ngram`` / ``min_ngram`` the n-gram sizes tried (longest first); ``num_candidates``
    continuations with distinct first tokens, verified as a tree when > 1; ``max_scan`` how many
    occurrences per n-gram size are looked at for distinct candidates.
    Evidence: the length of the n-gram the first candidate matched (0: no match).
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, num_candidates: int = 1, max_scan: int = 64):
        check_ngram_range(min_ngram, max_ngram)
        super().__init__(num_candidates)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.max_scan = max_scan

    def new_row(self, context: RequestContext) -> NGramIndex:
        return NGramIndex(self.min_ngram, self.max_ngram)

    def candidates(self, row: NGramIndex, sequence: list[int], limit: int) -> tuple[list[list[int]], int]:
        row.sync(sequence)
        starts = row.continuations(self.num_candidates, self.max_scan)
        return [copy_forward(row.tokens, j, limit) for j, _ in starts], (starts[0][1] if starts else 0)
