"""Lookahead decoding's n-gram pool (Fu et al. 2024) as a drafter, within the draft/verify interface.

Full Lookahead decoding runs two branches in each target pass: a *lookahead branch* (a window of
W positions x N-1 Jacobi iterations: the target re-predicts every window position in parallel, and
each column's trajectory yields a new n-gram) and a *verification branch* (the pool's n-grams that
start with the last token). The lookahead branch needs extra tokens with their own attention mask
in the target's pass and their logits back; this interface gives a drafter neither (it only proposes
tokens and sees what was kept in the next call's sequence), so what is implemented here is:

- the pool: ``pool[t]`` holds the ``pool_size`` most recent distinct (N-1)-grams that followed token
  t, fed by every committed token (prompt and output);
- the draft's own Jacobi trajectory: after a rejection, the rest of the rejected draft (the tokens
  drafted after the rejected one) is kept as the guess for the positions after the target's
  correction, as a Jacobi iteration would start from it; it is one more candidate;
- verification: up to ``num_candidates`` pool n-grams starting with the last token (most recent
  first, each chained through the pool up to the draft length) and the trajectory, as one token tree
  (the engine merges shared prefixes); with ``num_candidates == 1`` only the most recent n-gram.

Whether it pays (measured on the embedded Gemma 3 270M, greedy, 2-core CPU: 1.96x plain against 2.25x
for prompt lookup, ``genspec bench --methods "prompt-lookup,lookahead" --num-prompts 1 --repeats 2``):
the pool without the lookahead branch is a unigram-keyed prompt lookup, so it drafts less precisely than
``prompt-lookup`` (which matches up to 4 tokens of context), and the trajectory
candidate is rarely right. Drafts are deterministic (``probs=None``), so it is lossless either way.
"""
from __future__ import annotations

from collections import OrderedDict

from genspec.drafters.base import RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngrams import common_prefix_length
from genspec.errors import ConfigError


class _Pool:
    """Per row: token -> most recent distinct (N-1)-grams that followed it (an LRU of ``size``)."""

    def __init__(self, ngram_size: int, size: int):
        self.ngram_size, self.size = ngram_size, size
        self.tokens: list[int] = []
        self.grams: dict[int, OrderedDict] = {}

    def sync(self, sequence: list[int]) -> None:
        """Add the n-grams completed by the tokens appended since the last call (a changed tail
        restarts the pool from scratch: rare, only inside hierarchical stacks)."""
        if common_prefix_length(self.tokens, sequence) < len(self.tokens):
            self.tokens, self.grams = [], {}
        n, start = self.ngram_size, len(self.tokens)
        self.tokens.extend(sequence[start:])
        for end in range(max(start, n - 1), len(self.tokens)):
            self.add(self.tokens[end - n + 1], tuple(self.tokens[end - n + 2:end + 1]))

    def add(self, key: int, gram: tuple[int, ...]) -> None:
        grams = self.grams.setdefault(key, OrderedDict())
        grams[gram] = None
        grams.move_to_end(gram)
        if len(grams) > self.size:
            grams.popitem(last=False)

    def candidates(self, key: int, num: int) -> list[tuple[int, ...]]:
        grams = self.grams.get(key)
        return list(reversed(grams))[:num] if grams else []

    def chain(self, gram: tuple[int, ...], limit: int) -> list[int]:
        """``gram`` extended through the pool (most recent n-gram of its last token) to ``limit``."""
        chain = list(gram[:limit])
        while len(chain) < limit:
            following = self.candidates(chain[-1], 1)
            if not following:
                break
            chain.extend(following[0][:limit - len(chain)])
        return chain


class _Row:
    """One request: its pool, and its last proposal (sequence length then, chains)."""

    def __init__(self, ngram_size: int, pool_size: int):
        self.pool = _Pool(ngram_size, pool_size)
        self.last: tuple[int, list[list[int]]] = (0, [])


class LookaheadDrafter(CandidateDrafter):
    """N-gram pool plus Jacobi trajectory (see the module docstring for what is and is not lookahead).

    Options: ``ngram_size`` N (pool n-grams hold N-1 draft tokens); ``pool_size`` n-grams kept per
    key token; ``num_candidates`` chains verified as a tree (pool n-grams and the trajectory).
    """

    name = "lookahead"

    def __init__(self, ngram_size: int = 4, pool_size: int = 8, num_candidates: int = 1):
        if int(ngram_size) != ngram_size or ngram_size < 2:
            raise ConfigError(f"lookahead ngram_size must be an integer >= 2, got {ngram_size}")
        if int(pool_size) != pool_size or pool_size < 1:
            raise ConfigError(f"lookahead pool_size must be an integer >= 1, got {pool_size}")
        super().__init__(num_candidates)
        self.ngram_size, self.pool_size = int(ngram_size), int(pool_size)

    def new_row(self, context: RequestContext) -> _Row:
        return _Row(self.ngram_size, self.pool_size)

    @staticmethod
    def _trajectory(row: _Row, sequence: list[int], limit: int) -> list[int]:
        """The rest of the draft the target corrected last step, after the correction (the guess a
        Jacobi iteration would start from); empty after a full acceptance."""
        length, drafts = row.last
        new = sequence[length:]
        for draft in drafts if new else []:
            accepted = len(new) - 1
            if accepted < len(draft) and draft[:accepted] == new[:-1] and draft[accepted] != new[-1]:
                return draft[accepted + 1:accepted + 1 + limit]
        return []

    def candidates(self, row: _Row, sequence: list[int], limit: int) -> tuple[list[list[int]], None]:
        row.pool.sync(sequence)
        chains = [row.pool.chain(gram, limit) for gram in row.pool.candidates(sequence[-1], self.num_candidates)]
        if self.num_candidates > 1:
            guess = self._trajectory(row, sequence, limit)
            if guess and guess not in chains:
                chains = chains[:self.num_candidates - 1] + [guess]
        row.last = (len(sequence), chains)
        return chains, None
