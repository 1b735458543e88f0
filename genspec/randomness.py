"""A request's random numbers, indexed by the position of the token they decide.

Why by position: how many tokens a step drafts and keeps varies (the draft-length policy reacts to
timing; a neighbour in the batch changes nothing of a request's tokens but may change its step
boundaries). If a request drew its uniforms step by step, the same seed would give different tokens
under different step splits. Here the uniform that draws generated token t (and the keep-test
uniforms of the draft candidates at t) is the t-th of its own stream, whatever the steps were: with a
deterministic drafter a seeded request produces exactly plain sampling's tokens (see
:mod:`genspec.acceptance.rules`), and with any drafter its tokens do not depend on the batch.

Streams come from :class:`numpy.random.SeedSequence` (seed, sample index): ``n > 1`` samples of one
seeded call are independent and each reproducible on its own.
"""
from __future__ import annotations

import numpy as np
import torch

_CHUNK = 64  # positions drawn at a time


class RequestRandomness:
    """Per-position uniforms of one request: ``sample`` (the draw of the token at each position) and
    ``accept`` (``num_candidates`` keep tests per position), plus a generator for its drafter."""

    def __init__(self, seed: int | None, sample_index: int = 0, num_candidates: int = 1):
        entropy = None if seed is None else int(seed)
        sequence = np.random.SeedSequence(entropy, spawn_key=(int(sample_index),))
        token_seed, accept_seed, draft_seed = (int(s) for s in sequence.generate_state(3, dtype=np.uint64))
        self._sample = torch.Generator().manual_seed(token_seed)
        self._accept = torch.Generator().manual_seed(accept_seed)
        self.draft_generator = torch.Generator().manual_seed(draft_seed)
        self.num_candidates = max(1, int(num_candidates))
        self._start = 0  # position of the first buffered uniform
        self._sample_buffer = torch.empty(0, dtype=torch.float64)
        self._accept_buffer = torch.empty(0, self.num_candidates, dtype=torch.float64)

    def uniforms(self, position: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample`` ``[count]`` and ``accept`` ``[count, num_candidates]`` uniforms of positions
        ``position .. position + count - 1`` (positions before the last :meth:`advance` are gone)."""
        if position < self._start:
            raise ValueError(f"position {position} was released (stream starts at {self._start})")
        need = position + count - self._start
        while len(self._sample_buffer) < need:
            self._sample_buffer = torch.cat([self._sample_buffer, torch.rand(_CHUNK, generator=self._sample,
                                                                             dtype=torch.float64)])
            self._accept_buffer = torch.cat([self._accept_buffer, torch.rand(
                _CHUNK, self.num_candidates, generator=self._accept, dtype=torch.float64)])
        at = position - self._start
        return self._sample_buffer[at:at + count], self._accept_buffer[at:at + count]

    def advance(self, position: int) -> None:
        """Positions before ``position`` are decided: forget their uniforms."""
        drop = min(max(position - self._start, 0), len(self._sample_buffer))
        if drop:
            self._sample_buffer = self._sample_buffer[drop:]
            self._accept_buffer = self._accept_buffer[drop:]
            self._start += drop
