"""Prompt lookup: the continuation of the most recent earlier occurrence of the sequence's last
n-gram (longest n first), searched in the prompt and the generated text. No model, no cost."""
from __future__ import annotations

import numpy as np

from genspec.drafters.base import Draft, Drafter
from genspec.errors import ConfigError


def find_continuation(sequence: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """Tokens following the most recent earlier match of the longest suffix n-gram (n from
    ``max_ngram`` down to ``min_ngram``); empty if none matches."""
    length = len(sequence)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = sequence[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(sequence[:length - 1], n)
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return sequence[follow:follow + num_tokens].tolist()
    return []


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    deterministic = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ConfigError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, sequences, max_tokens):
        proposals = [find_continuation(np.asarray(seq), self.max_ngram, self.min_ngram, limit) if limit > 0 else []
                     for seq, limit in zip(sequences, max_tokens)]
        return Draft.from_lists(proposals)
