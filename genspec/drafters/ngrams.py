"""N-gram helpers of the model-free drafters: where n-grams occurred in a growing token list, how to
copy a continuation, and the checks of their options."""
from __future__ import annotations

import numpy as np

from genspec.drafters.base import Option
from genspec.errors import ConfigError

#: the longest n-gram an option may ask for (``max_ngram``, ``min_ngram``, ``ngram_size``, ...): an index holds, per
#: token, an entry for every n-gram size it looks up, so its memory and each token's update grow with the sizes
MAX_NGRAM = 32
#: the most earlier occurrences an option may have a lookup read (``max_scan``, ``max_matches``): each step reads
#: them all
MAX_SCAN = 4096
#: the n-gram sizes a lookup tries, longest first (their relation: :func:`check_ngram_range`)
MAX_NGRAM_OPTION = Option("max_ngram", int, 1, MAX_NGRAM)
MIN_NGRAM_OPTION = Option("min_ngram", int, 1, MAX_NGRAM)

#: odd 64-bit constant (golden ratio) that spreads token ids in n-gram hashes
HASH_MULTIPLIER = 0x9E3779B97F4A7C15
_MASK64 = 0xFFFFFFFFFFFFFFFF


def hash_columns(columns: list[np.ndarray]) -> np.ndarray:
    """64-bit hashes of many n-grams at once: ``columns[i]`` holds token i of each n-gram (equal
    lengths); the same value as :func:`hash_ngram` of each n-gram."""
    key = np.zeros(len(columns[0]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in columns:
            key = (key * np.uint64(HASH_MULTIPLIER)) ^ (column.astype(np.uint64) + np.uint64(1))
    return key


def hash_ngram(ngram) -> int:
    """The 64-bit hash of one n-gram (a sequence of token ids), as :func:`hash_columns` computes it."""
    key = 0
    for token in ngram:
        key = ((key * HASH_MULTIPLIER) & _MASK64) ^ ((token + 1) & _MASK64)
    return key


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
    """Refuse n-gram sizes whose shortest is longer than their longest (each size is checked by its
    :class:`~genspec.drafters.base.Option`)."""
    if not min_ngram <= max_ngram:
        raise ConfigError(f"{what} needs min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


class NGramIndex:
    """Where every n-gram (``min_n <= n <= max_n``) of a growing token list occurred.

    ``positions[ngram]`` lists, oldest first, each ``j`` with ``tokens[j - n:j] == ngram`` and
    ``j < len(tokens)``: the index of the token that followed that occurrence.

    Why incremental: drafters look up every step in sequences of thousands of tokens that only grow
    between calls, so the index only adds the tokens appended since the last call: a lookup is a few
    dict probes instead of a scan. If a sequence changed (a hierarchical stack proposes on uncommitted
    text), it rolls back to the common prefix first, so it is exact for any caller.
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
