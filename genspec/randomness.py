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

What a seed reproduces. The token at position t is a function of the tokens before it, the uniforms of
position t and the draft at t (whether t was drafted, and what). With a drafter whose drafts are point
masses (the model-free drafters, trained heads' trees) the coupling above makes it plain sampling's
token whatever was drafted: a seeded request gives the same tokens under every draft-length policy
and batch composition. A drafter that samples its drafts (``Drafter.samples_drafts``: a draft model,
self-speculation, a head's chain) gets the standard rule's token, which depends on whether t was
drafted, and no rule can remove that dependence and keep the standard rule's acceptance probability
1 - TV(p, q): the token would then be a function of the target's law and shared randomness alone while
the draft is one of the draft's law and shared randomness alone (it is drawn before the target runs),
and every such "correlated sampling" scheme disagrees with probability about 2 TV / (1 + TV) > TV on
some pairs of laws (Bavarian et al. 2016, "Optimality of correlated sampling strategies"). So with such
a drafter a seed reproduces the tokens exactly when the draft lengths are reproducible: under the
``fixed`` and ``heuristic`` policies, whose lengths follow the request's own history (alone or in any
batch), not under ``cost``, whose lengths follow measured times and the batch. Such a drafter's own
draws (``draft_generator``) are a sequential stream of the request: drawing them by position instead
would not remove the dependence above, and a position's uniform reused after a rejection would carry
what the discarded draft revealed (a confidence stop shortens the step, the cost policy reads the
time) into the next draft at that position, so that the rule would no longer be exactly lossless.
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
