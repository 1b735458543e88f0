"""Lookahead decoding (Fu et al. 2024) as a drafter: an n-gram pool, fed by the text and by a Jacobi window.

Lookahead decoding runs two branches in each target pass: a *lookahead branch*, a window of guessed future
tokens that the target re-predicts in parallel (Jacobi iterations), whose trajectories yield n-grams the
text has not shown; and a *verification branch*, the pool's n-grams that start with the last token. Here
both are candidates of one draft, verified in one target pass:

- the pool: ``pool[t]`` holds the ``pool_size`` most recent distinct (N-1)-grams that followed token t in the
  text (prompt and output), and as many more made by the window's predictions, offered after the text's (a
  predicted n-gram is a guess about a context the text may never reach; ranked by recency with the text's, it
  would displace them as the one candidate drafted);
- the verification branch: up to ``num_candidates`` pool n-grams starting with the last token (most recent
  first, each chained through the pool up to the draft length);
- the lookahead branch (``window`` W > 0): W guesses ``g_1..g_W`` of the tokens after the last one, drafted
  in a candidate slot the pool leaves free (with one candidate, the default: where the pool has no n-gram
  after the last token). The target's pass over ``[last, g_1..g_W]`` is a Jacobi iteration: its most
  likely token after ``g_i`` is the next guess for position i + 1, and the prefix of guesses that matches
  those predictions is what greedy verification accepts anyway. So the engine hands the drafter the
  target's predictions at every node of its block, also past the first rejection
  (:attr:`~genspec.drafters.base.DrafterCapabilities.reads_block_predictions`), and the drafter refreshes
  the window from them: each position's guess over the steps is that column's trajectory (when a pool chain
  took the slot, the window is refreshed from the target's predictions along that chain: any chain the target
  scored is a Jacobi iterate). Every prediction
  with the N-1 tokens it followed in the chain is an n-gram the target produced, added to the pool (in the
  paper's 2-D window each new token attends to the N-1 earlier guesses along its diagonal, so its n-gram
  is that diagonal; in one causal chain the N-1 tokens a prediction follows are the window's own).
  Guesses the target has not refreshed yet are kept; a short window is extended through the pool, and an
  empty one (the first step, or after the target accepted all of it) starts from the sequence's last W
  tokens, as the paper starts from prompt tokens.

Evidence (per row, for the draft-length policy; :class:`Evidence`): ``pool`` where an n-gram the text showed
starts the draft, ``guessed`` where one only the target's predictions made does, and where only the window does,
``jacobi-settled`` when its first guess is the target's prediction for that position and the one drafted there a
step before (it survived a Jacobi iteration unchanged, Jacobi decoding's sign of convergence), else ``jacobi``
(None with ``window=0``). The two window grades differ: on held-out prompts settled windows kept far more tokens
a step than the others (the manual's Lookup page), so the policy drafts the first deep and mostly declines the
second. Drafts are deterministic (``probs`` None),
and for a sampled request the window is a point-mass candidate like the others, so it is lossless either
way. With ``window=0`` (the pool only), after a rejection the rest of the rejected draft is kept as the
guess for the positions after the correction and verified as the last of ``num_candidates`` chains (a
Jacobi step that never sees the target's predictions).

Whether the window pays: on the embedded model it gains nothing over the pool alone, and both trail
``prompt-lookup``; the manual's Lookup page has the figures and why.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from enum import StrEnum

from genspec.drafters.base import BlockPredictions, Option, RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngrams import MAX_NGRAM, common_prefix_length

#: guessed positions in the Jacobi window by default
DEFAULT_WINDOW = 4
#: the widest window ``window`` may ask for: each step drafts it whole and re-reads the target's predictions
#: over it, and no more of it than the draft depth (k) is verified
MAX_WINDOW = 64
#: the most n-grams per key token ``pool_size`` may ask for (the pool keeps as many more from the window)
MAX_POOL_SIZE = 256


class Evidence(StrEnum):
    """What backs a lookahead draft (module docstring): the grades the draft-length policy prices apart."""

    POOL = "pool"
    GUESSED = "guessed"
    JACOBI = "jacobi"
    JACOBI_SETTLED = "jacobi-settled"


class _Pool:
    """Per row: token -> most recent distinct (N-1)-grams that followed it (an LRU of ``size``), in two tiers:
    those the text showed, and those only the target's predictions made (the window's), offered after them."""

    def __init__(self, ngram_size: int, size: int):
        self.ngram_size, self.size = ngram_size, size
        self.tokens: list[int] = []
        self.grams: dict[int, OrderedDict] = {}
        self.guessed: dict[int, OrderedDict] = {}

    def sync(self, sequence: list[int]) -> None:
        """Add the n-grams completed by the tokens appended since the last call (a changed tail
        restarts the pool from scratch: rare, only inside hierarchical stacks)."""
        if common_prefix_length(self.tokens, sequence) < len(self.tokens):
            self.tokens, self.grams, self.guessed = [], {}, {}
        n, start = self.ngram_size, len(self.tokens)
        self.tokens.extend(sequence[start:])
        for end in range(max(start, n - 1), len(self.tokens)):
            self.add(self.tokens[end - n + 1], tuple(self.tokens[end - n + 2:end + 1]))

    def add(self, key: int, gram: tuple[int, ...], guessed: bool = False) -> None:
        """Record ``gram`` after ``key``: shown by the text, or (``guessed``) predicted by the target after
        guesses; a guessed n-gram the text already showed stays in the text's tier."""
        if guessed and self.shown(key, gram):
            return
        tier = self.guessed if guessed else self.grams
        grams = tier.setdefault(key, OrderedDict())
        grams[gram] = None
        grams.move_to_end(gram)
        if len(grams) > self.size:
            grams.popitem(last=False)
        if not guessed:
            self.guessed.get(key, {}).pop(gram, None)

    def candidates(self, key: int, num: int) -> list[tuple[int, ...]]:
        """Up to ``num`` n-grams after ``key``: the text's, most recent first, then the guessed ones."""
        found = list(reversed(self.grams.get(key, ())))[:num]
        if len(found) < num:
            found += list(reversed(self.guessed.get(key, ())))[:num - len(found)]
        return found

    def shown(self, key: int, gram: tuple[int, ...]) -> bool:
        """Did the text show ``gram`` after ``key`` (not only the target's predictions)?"""
        return gram in self.grams.get(key, ())

    def chain(self, gram: tuple[int, ...], limit: int) -> list[int]:
        """``gram`` extended through the pool (the first candidate after its last token) to ``limit``."""
        chain = list(gram[:limit])
        while len(chain) < limit:
            following = self.candidates(chain[-1], 1)
            if not following:
                break
            chain.extend(following[0][:limit - len(chain)])
        return chain


class _Row:
    """One request: its pool, its last proposal (sequence length then, chains), and its Jacobi window."""

    def __init__(self, ngram_size: int, pool_size: int):
        self.pool = _Pool(ngram_size, pool_size)
        self.last: tuple[int, list[list[int]]] = (0, [])
        #: the window's guesses: (the sequence index of the first, the guesses in order)
        self.window: tuple[int, list[int]] = (0, [])
        #: how many of those guesses are the target's predictions of the last step (the rest were kept)
        self.refreshed = 0
        #: the window last drafted (the sequence length then, its guesses), until the target's predictions come
        self.proposed: tuple[int, list[int]] | None = None
        #: the window's guesses a step before (the sequence length then, the guesses)
        self.previous: tuple[int, list[int]] = (0, [])
        #: whether the window's next guess is a prediction equal to the previous guess for its position (it
        #: survived a Jacobi iteration unchanged)
        self.settled = False
        #: False once a drafted window got no predictions back (proposed for outside the engine's step)
        self.jacobi = True


class LookaheadDrafter(CandidateDrafter):
    """Lookahead decoding: an n-gram pool and a Jacobi window (module docstring).

    Options: ``ngram_size`` N (pool n-grams hold N-1 draft tokens); ``pool_size`` n-grams kept per key token;
    ``num_candidates`` pool chains verified (as a tree); ``window`` W guessed positions of the Jacobi window,
    one more chain (0: the pool only).
    """

    name = "lookahead"
    options = CandidateDrafter.options + (Option("ngram_size", int, 2, MAX_NGRAM),
                                          Option("pool_size", int, 1, MAX_POOL_SIZE), Option("window", int, 0, MAX_WINDOW))

    def __init__(self, ngram_size: int = 4, pool_size: int = 8, num_candidates: int = 1,
                 window: int = DEFAULT_WINDOW):
        self.check_options({"ngram_size": ngram_size, "pool_size": pool_size, "window": window})
        super().__init__(num_candidates)
        self.ngram_size, self.pool_size, self.window = int(ngram_size), int(pool_size), int(window)
        self.pool_candidates = self.num_candidates
        if window:
            self.capabilities = replace(self.capabilities, reads_block_predictions=True)

    def new_row(self, context: RequestContext) -> _Row:
        return _Row(self.ngram_size, self.pool_size)

    def candidates(self, row: _Row, sequence: list[int], limit: int) -> tuple[list[list[int]], Evidence | None]:
        row.pool.sync(sequence)
        grams = row.pool.candidates(sequence[-1], self.pool_candidates)
        chains = [row.pool.chain(gram, limit) for gram in grams]
        evidence = None
        if self.window:
            guess = self._window(row, sequence)[:limit]
            evidence = self._evidence(row, sequence[-1], grams, chains, guess)
            if guess and len(chains) < self.pool_candidates and guess not in chains:
                chains.append(guess)  # in a slot the pool leaves free (module docstring)
        elif self.pool_candidates > 1:
            guess = self._trajectory(row, sequence, limit)
            if guess and guess not in chains:
                chains = chains[:self.pool_candidates - 1] + [guess]
        row.last = (len(sequence), chains)
        return chains, evidence

    @staticmethod
    def _evidence(row: _Row, last: int, grams: list[tuple[int, ...]], chains: list[list[int]],
                  guess: list[int]) -> Evidence | None:
        """What backs the draft: the pool's first n-gram (shown or only predicted), else the window."""
        if chains:
            return Evidence.POOL if row.pool.shown(last, grams[0]) else Evidence.GUESSED
        if guess:
            return Evidence.JACOBI_SETTLED if row.settled else Evidence.JACOBI
        return None

    def read_predictions(self, predictions: list[BlockPredictions]) -> None:
        """Refresh each row's window from the target's predictions along the chain it drafted (a Jacobi
        iteration) and add the n-grams those predictions make to its pool."""
        for block in predictions:
            row = self._rows.get(block.request_id)
            if row is None or not row.jacobi or not block.chains:
                continue
            proposed = row.proposed[1] if row.proposed is not None and row.proposed[0] == block.start else []
            row.proposed = None
            # the window as verified: the chain that shares most with it (list renumbering may have changed a
            # token; a window equal to a pool chain was merged into it), else the longest: any chain the target
            # scored is a Jacobi iterate
            m = max(range(len(block.chains)),
                    key=lambda m: (common_prefix_length(block.chains[m], proposed), len(block.chains[m])))
            chain, predicted = list(block.chains[m]), list(block.predicted[m])
            guesses = predicted  # position start + d: the target's token after the chain's first d
            if chain == proposed[:len(chain)]:
                guesses = guesses + proposed[len(chain) + 1:]  # guesses the plan cut off keep their place
            row.window, row.refreshed = (block.start, guesses), len(predicted)
            self._learn(row, block.start, chain, predicted)

    def _learn(self, row: _Row, start: int, chain: list[int], predicted: list[int]) -> None:
        """Add to the pool each prediction after a chain token with the N-1 tokens it followed (the sequence's
        last ones, then the chain's)."""
        n = self.ngram_size
        before = row.pool.tokens[max(0, start - n + 1):start] if len(row.pool.tokens) >= start else []
        context = before + chain
        for i in range(1, len(chain) + 1):
            end = len(before) + i  # where prediction i would sit in ``context``
            if end >= n - 1:
                row.pool.add(context[end - n + 1], tuple(context[end - n + 2:end]) + (predicted[i],), guessed=True)

    def _window(self, row: _Row, sequence: list[int]) -> list[int]:
        """The window's W guesses for the positions after ``sequence``: those not yet committed, extended
        through the pool; the sequence's last W tokens where there are none."""
        length = len(sequence)
        if row.proposed is not None and row.proposed[0] != length:
            row.jacobi = False  # the sequence moved on and the target's predictions never came
        if not row.jacobi:
            return []
        start, guesses = row.window
        guesses = guesses[length - start:] if start <= length else []
        if guesses:
            guesses = row.pool.chain(tuple(guesses), self.window)
        else:
            following = row.pool.candidates(sequence[-1], 1)
            guesses = row.pool.chain(following[0], self.window) if following else sequence[-self.window:]
        # settled: the first guess is a prediction of the last step, equal to the guess drafted a step before
        predicted = start <= length < start + row.refreshed
        before, previous = row.previous
        row.settled = (bool(guesses) and predicted and 0 <= length - before < len(previous)
                       and previous[length - before] == guesses[0])
        row.previous = row.proposed = (length, guesses)
        return guesses

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
