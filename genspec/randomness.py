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
and batch composition. A drafter that samples its drafts (``DrafterCapabilities.samples_drafts``: a draft model,
self-speculation, a head's chain) would get the standard rule's token, which depends on whether t was
drafted, and no rule can remove that dependence and keep the standard rule's acceptance probability
1 - TV(p, q): the token would then be a function of the target's law and shared randomness alone while
the draft is one of the draft's law and shared randomness alone (it is drawn before the target runs),
and every such "correlated sampling" scheme disagrees with probability about 2 TV / (1 + TV) > TV on
some pairs of laws (Bavarian et al. 2016, "Optimality of correlated sampling strategies"). So a seeded
request with such a drafter uses the coupled rule (:func:`genspec.acceptance.coupled_tokens`; the engine
picks it for ``GenerationConfig.rule`` "auto"): draft and target draw position t with the same noise
(:meth:`RequestRandomness.race`, one vector per position, from (seed, sample, position) alone),
the token at t is argmax(q_t / e_t) whatever was drafted, and the request is reproducible under
every draft-length policy, alone or in any batch, for some acceptance (agreement of the two draws instead of
1 - TV: a little less; the manual's Acceptance rules page has the measurement).
A request that asks for the standard rule by name (``rule="overaccept"``) keeps 1 - TV and reproduces
only where its draft lengths do: under the ``fixed`` and ``heuristic`` policies (their lengths follow
the request's own history), not under ``cost`` (measured times and the batch). Drafts drawn outside the
coupling use a sequential stream of the request (``draft_generator``): drawing them by position would not
remove the dependence above, and a position's uniform reused after a rejection would carry what the
discarded draft revealed (a confidence stop shortens the step, the cost policy reads the time) into the
next draft at that position, so that the standard rule would no longer be exactly lossless. The coupled
rule has no such leak: its token at t is a function of e_t and the tokens before t alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_CHUNK = 64  # positions drawn at a time


class RequestRandomness:
    """Per-position uniforms of one request: ``sample`` (the draw of the token at each position) and
    ``accept`` (``num_candidates`` keep tests per position); per-position noise for the coupled rule
    (:meth:`race`); and a sequential generator for its drafter."""

    def __init__(self, seed: int | None, sample_index: int = 0, num_candidates: int = 1):
        entropy = None if seed is None else int(seed)
        sequence = np.random.SeedSequence(entropy, spawn_key=(int(sample_index),))
        token_seed, accept_seed, draft_seed = (int(s) for s in sequence.generate_state(3, dtype=np.uint64))
        self._sample = torch.Generator().manual_seed(token_seed)
        self._accept = torch.Generator().manual_seed(accept_seed)
        self.draft_generator = torch.Generator().manual_seed(draft_seed)
        self.num_candidates = max(1, int(num_candidates))
        self._noise_key = (sequence.entropy, int(sample_index))
        self._race: dict[int, torch.Tensor] = {}  # position -> its noise, until the position is decided
        self._decided = 0  # positions before it are decided (their noise is gone)
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

    def race(self, position: int, vocab_size: int) -> torch.Tensor:
        """The coupled rule's noise of output ``position``: ``[vocab_size]`` i.i.d. standard exponentials,
        float64, a function of (seed, sample index, position) alone (a generator seeded per position), so
        the draft and the verifier, whenever each runs, see the same vector. A shorter ``vocab_size`` gets
        a prefix of a longer one (a drafter over a smaller vocabulary sees the target's noise of its tokens).
        Exponentials, not Gumbels: argmax(log p + g) = argmax(p / e) with g = -log e, and NumPy's ziggurat
        draws them without the two logs a Gumbel takes (262k float64 logs cost more than the draw itself).
        One position's vector is shared by the draft and the verifier: a coupled request pays its draw once per
        generated token (the manual's Acceptance rules page has its cost)."""
        if position < self._decided:
            raise ValueError(f"position {position} was released (positions before {self._decided} are decided)")
        noise = self._race.get(position)
        if noise is None or len(noise) < vocab_size:
            entropy, sample_index = self._noise_key
            generator = np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(sample_index, 1, int(position))))
            noise = torch.from_numpy(generator.standard_exponential(vocab_size))
            self._race[position] = noise
        return noise[:vocab_size]

    def races(self, position: int, count: int, vocab_size: int) -> torch.Tensor:
        """``[count, vocab_size]``: the noise of positions ``position .. position + count - 1``."""
        if not count:
            return torch.empty(0, vocab_size, dtype=torch.float64)
        return torch.stack([self.race(position + i, vocab_size) for i in range(count)])

    def advance(self, position: int) -> None:
        """Positions before ``position`` are decided: forget their uniforms."""
        drop = min(max(position - self._start, 0), len(self._sample_buffer))
        if drop:
            self._sample_buffer = self._sample_buffer[drop:]
            self._accept_buffer = self._accept_buffer[drop:]
            self._start += drop
        self._decided = max(self._decided, position)
        for decided in [p for p in self._race if p < position]:
            del self._race[decided]


@dataclass
class Noise:
    """The randomness of one verification, per row (:func:`genspec.acceptance.verify`): ``sample`` ``[B, k + 1]``
    uniforms (the draw of the token at each depth) and ``accept`` ``[B, k, M]`` (the keep tests of the M
    candidates at each depth; :func:`~genspec.acceptance.verify_multidraft`, one position: ``[B]`` and
    ``[B, M]``); either None: drawn from ``generator``. ``coupled`` ``[B]`` (bool) marks the rows verified by
    the coupled rule, ``race`` ``[B, k + 1, V]`` their noise at each depth (zeros on the other rows)."""

    sample: torch.Tensor | None = None
    accept: torch.Tensor | None = None
    coupled: torch.Tensor | None = None
    race: torch.Tensor | None = None
    generator: torch.Generator | None = None


def block_noise(streams: Sequence[RequestRandomness | None], positions: Sequence[int], coupled: Sequence[bool],
                depth: int, num_chains: int, vocab_size: int) -> Noise | None:
    """The :class:`Noise` of a block ``depth`` draft positions deep and ``num_chains`` candidates wide whose
    row i starts at output position ``positions[i]`` of its request: ``streams[i]`` is the request's
    :class:`RequestRandomness`, or None for a greedy row (zeros: it draws nothing); rows marked ``coupled``
    also get their race noise. None when every row is greedy (nothing is drawn)."""
    if all(stream is None for stream in streams):
        return None
    rows = len(streams)
    width = max([num_chains] + [s.num_candidates for s in streams if s is not None])
    sample = torch.zeros(rows, depth + 1, dtype=torch.float64)
    accept = torch.zeros(rows, depth, width, dtype=torch.float64)
    race = torch.zeros(rows, depth + 1, vocab_size, dtype=torch.float64) if any(coupled) else None
    for i, (stream, position) in enumerate(zip(streams, positions)):
        if stream is None:
            continue
        sample[i], row_accept = stream.uniforms(position, depth + 1)
        accept[i, :, :row_accept.shape[1]] = row_accept[:depth]
        if coupled[i]:
            race[i] = stream.races(position, depth + 1, vocab_size)
    return Noise(sample, accept, torch.tensor(list(coupled), dtype=torch.bool), race)
