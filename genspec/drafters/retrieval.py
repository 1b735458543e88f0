"""Retrieval drafting (REST, He et al. 2024): the draft is what followed the longest suffix of the
current sequence in a datastore of text, found with a suffix array.

The datastore (``genspec index build CORPUS --out DIR``, see :mod:`genspec.datastore`) is the corpus
tokenised with the target's tokenizer plus the suffix array of the *reversed* token array, so the
longest suffix match costs ``O(n log N)``. The matches' continuations (up to ``max_matches`` of them)
are merged like REST's trie: the most frequent first token of each candidate, then the most frequent
path after it. Several candidates (distinct first tokens) go to the engine as a tree; drafts are
deterministic.

With ``context=True`` the drafter also looks in the request itself (prompt lookup over the prompt and
the generated text) and drafts from whichever source matched the longer suffix (the request on a tie:
it is the more specific text). A small datastore then adds to prompt lookup instead of replacing it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np

from genspec.datastore import RetrievalIndex, check_index_fits
from genspec.drafters.base import PATH, Option, RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngrams import MAX_NGRAM_OPTION, MAX_SCAN, MIN_NGRAM_OPTION
from genspec.drafters.prompt_lookup import DEFAULT_MAX_NGRAM, PromptLookupDrafter
from genspec.errors import ConfigError

#: the longest suffix ``max_suffix`` may ask for (each length matched is a search of the suffix array)
MAX_SUFFIX = 1024
#: the suffix lengths matched by default
DEFAULT_MIN_SUFFIX, DEFAULT_MAX_SUFFIX = 2, 16


# ------------------------------------------------------------------------------- the drafter
def frequent_chains(follow: np.ndarray, num_chains: int) -> list[list[int]]:
    """REST's trie selection, greedily: the ``num_chains`` most frequent first tokens of the rows of
    ``follow`` ``[M, k]`` (-1 = none), each continued by the most frequent next token among the
    rows that agree so far (ties: the first in suffix-array order). Plain Python: for the few dozen
    rows involved it is several times faster than numpy's per-call overhead."""
    rows_all = [row for row in follow.tolist() if row and row[0] >= 0]
    chains = []
    for first, _ in Counter(row[0] for row in rows_all).most_common(num_chains):
        rows, chain = [row for row in rows_all if row[0] == first], [first]
        for depth in range(1, follow.shape[1]):
            column = [row[depth] for row in rows if row[depth] >= 0]
            if not column:
                break
            best = column[0] if len(column) == 1 else Counter(column).most_common(1)[0][0]
            chain.append(best)
            rows = [row for row in rows if row[depth] == best]
        chains.append(chain)
    return chains


class RetrievalDrafter(CandidateDrafter):
    """REST-style drafting from a :class:`RetrievalIndex`.

    Options: ``max_suffix`` longest suffix looked up; ``min_suffix`` shortest match worth drafting
    from; ``num_candidates`` continuations with distinct first tokens (a tree when > 1);
    ``max_matches`` matches whose continuations are counted; ``context`` also draft from the request's
    own text (prompt lookup with n-grams of ``min_ngram..max_ngram``), the longer match winning.

    Evidence per row: the matched length, or with ``context`` ``("datastore", matched length)`` /
    ``("context", matched n)``, so the cost-aware draft length learns the two sources' acceptance apart.
    """

    name = "retrieval"
    options = CandidateDrafter.options + (
        Option("index", (*PATH, RetrievalIndex),
               needed="a datastore: -O index=DIR (build one with: genspec index build CORPUS --out DIR)"),
        Option("max_suffix", int, 1, MAX_SUFFIX), Option("min_suffix", int, 1, MAX_SUFFIX),
        Option("max_matches", int, 1, MAX_SCAN), Option("context", bool), MIN_NGRAM_OPTION, MAX_NGRAM_OPTION)

    def __init__(self, index: RetrievalIndex, num_candidates: int = 1, max_suffix: int = DEFAULT_MAX_SUFFIX,
                 min_suffix: int = DEFAULT_MIN_SUFFIX, max_matches: int = 64, context: bool = False, min_ngram: int = 1,
                 max_ngram: int = DEFAULT_MAX_NGRAM):
        self.check_options({"index": index, "max_suffix": max_suffix, "min_suffix": min_suffix,
                            "max_matches": max_matches, "context": context, "min_ngram": min_ngram,
                            "max_ngram": max_ngram})
        super().__init__(num_candidates)
        self.index = index
        self.max_suffix, self.min_suffix = int(max_suffix), int(min_suffix)
        self.max_matches = int(max_matches)
        # the request's own text, searched as prompt lookup does
        self._lookup = (PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram, num_candidates=num_candidates)
                        if context else None)

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        super().check_options(options, owner)
        low, high = options.get("min_suffix", DEFAULT_MIN_SUFFIX), options.get("max_suffix", DEFAULT_MAX_SUFFIX)
        if not low <= high:
            raise ConfigError(f"retrieval needs min_suffix <= max_suffix, got {low}, {high}")
        if options.get("context", False):  # the request's own text, searched by a prompt lookup
            PromptLookupDrafter.check_options({k: options[k] for k in ("min_ngram", "max_ngram") if k in options},
                                              owner or f"drafter {cls.name!r}")

    @classmethod
    def for_target(cls, target, index: str | RetrievalIndex | None = None, **options) -> "RetrievalDrafter":
        """The registry's factory: ``index`` is a directory written by ``genspec index build``."""
        cls.check_options({"index": index})
        if not isinstance(index, RetrievalIndex):
            index = RetrievalIndex.load(index)
        check_index_fits(index, target)
        return super().for_target(target, index=index, **options)

    def new_row(self, context: RequestContext):
        return None if self._lookup is None else self._lookup.new_row(context)

    def _store_candidates(self, sequence: list[int], limit: int) -> tuple[list[list[int]], int]:
        """Datastore chains and the matched suffix length (0: no draft)."""
        length, lo, hi = self.index.longest_suffix_match(sequence, self.max_suffix)
        if length < self.min_suffix:
            return [], 0
        chains = frequent_chains(self.index.continuations(lo, hi, limit, self.max_matches), self.num_candidates)
        return chains, (length if chains else 0)

    def candidates(self, row, sequence: list[int], limit: int) -> tuple[list[list[int]], object]:
        chains, length = self._store_candidates(sequence, limit)
        if self._lookup is None:
            return chains, length
        own_chains, n = self._lookup.candidates(row, sequence, limit)
        if n == 0 and length == 0:
            return [], 0
        first, second = (own_chains, chains) if n >= length else (chains, own_chains)
        merged, firsts = [], set()
        for chain in first + second:  # the winner's candidates first, then the other's new first tokens
            if chain and chain[0] not in firsts:
                firsts.add(chain[0])
                merged.append(chain)
        return merged[:self.num_candidates], (("context", n) if n >= length else ("datastore", length))
