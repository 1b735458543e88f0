"""Prompt lookup: draft what followed the most recent earlier occurrence of the sequence's last n-gram
(longest n first), searched in the prompt and the generated text. No model, almost no cost.

Each request keeps an incremental :class:`~genspec.drafters.ngrams.NGramIndex` of its sequence, so a
lookup is a few dict probes. With ``num_candidates > 1`` the drafter proposes continuations that start
with distinct tokens (from different earlier matches, longest n-gram and most recent first); the
engine verifies them together as a token tree, losslessly.
"""
from __future__ import annotations

from collections.abc import Mapping

from genspec.drafters.base import Option, RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngrams import (MAX_NGRAM_OPTION, MAX_SCAN, MIN_NGRAM_OPTION, NGramIndex, check_ngram_range,
                                     copy_forward)

#: the longest n-gram tried by default
DEFAULT_MAX_NGRAM = 4


class PromptLookupDrafter(CandidateDrafter):
    """Prompt lookup (n-gram copy from the sequence itself).

    Options: ``max_ngram`` / ``min_ngram`` the n-gram sizes tried (longest first); ``num_candidates``
    continuations with distinct first tokens, verified as a tree when > 1; ``max_scan`` how many
    occurrences per n-gram size are looked at for distinct candidates.
    Evidence: the length of the n-gram the first candidate matched (0: no match).
    """

    name = "prompt-lookup"
    options = CandidateDrafter.options + (MAX_NGRAM_OPTION, MIN_NGRAM_OPTION, Option("max_scan", int, 1, MAX_SCAN))

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1, num_candidates: int = 1,
                 max_scan: int = 64):
        self.check_options({"max_ngram": max_ngram, "min_ngram": min_ngram, "max_scan": max_scan})
        super().__init__(num_candidates)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.max_scan = int(max_scan)

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        super().check_options(options, owner)
        check_ngram_range(options.get("min_ngram", 1), options.get("max_ngram", DEFAULT_MAX_NGRAM))

    def new_row(self, context: RequestContext) -> NGramIndex:
        return NGramIndex(self.min_ngram, self.max_ngram)

    def candidates(self, row: NGramIndex, sequence: list[int], limit: int) -> tuple[list[list[int]], int]:
        row.sync(sequence)
        starts = row.continuations(self.num_candidates, self.max_scan)
        return [copy_forward(row.tokens, j, limit) for j, _ in starts], (starts[0][1] if starts else 0)
