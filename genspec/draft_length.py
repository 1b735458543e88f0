"""How many tokens to draft at each step, per row.

- ``fixed``: always k.
- ``heuristic``: Hugging Face's schedule: +2 after a fully accepted draft, -1 otherwise (1 <= k <= k_max).
- ``cost`` (the default): the k that maximises expected tokens per second (Leviathan et al.), from running
  acceptance estimates and the measured costs of drafting and of verifying the block a draft of depth k
  puts in front of the target: ``rate(k) = E[tokens](k) / (drafting(k) + verify_cost(block(k)))``. k = 0
  (plain decoding) is allowed, so speculation switches itself off where it does not pay: a k > 0 must
  promise ``MARGIN`` (10%) more tokens per second than plain decoding, because the estimate leaves out the
  engine's own work and timing noise (without the margin, prompt lookup on Spec-Bench's humanities prompts,
  acceptance 0.16, ran below plain decoding).

Acceptance is not i.i.d. along a draft: the first token is the hard one (a lookup draft whose first
token is right usually goes on being right). The cost policy therefore keeps two discounted rates,
``first`` (P[draft token 1 accepted]) and ``later`` (P[token i+1 accepted | token i accepted]), with
``E[tokens](k) = 1 + first * (1 + later + ... + later^(k-1))``.

Evidence: a drafter may say, per row, how strong the evidence behind its proposal is (prompt lookup:
the length of the matched n-gram: a one-token match is right far less often than a four-token one). The
policy keeps
separate rates per evidence level, so weak proposals are dropped and strong ones drafted long, in the
same request. A drafter that costs nothing proposes before the policy decides (the decision can use the
evidence) and is scored on what it would have proposed when nothing is verified (a new evidence level
starts no higher than what the row's other levels have shown, so a request where lookups are mostly
wrong does not pay to learn each level); a costly one is asked for the policy's k and, when switched
off, probed with a single token now and then (until its time is measured, a draft position is priced
at what the drafter declares, ``DrafterCapabilities.draft_cost_prior``: a new engine does not draft blind with it).

Probes are priced: a probe costs its draft position and the wider verify block, and probes may spend
``PROBE_SHARE`` (3%) of the idle time, so a drafter whose probe costs 0.6 of a plain step is probed after
20 idle steps, a trained head (about 0.08 of a step to draft, 0.05 to verify one token more) after 5. That
wait is multiplied by a backoff that each probe moves: a failed one multiplies it by 2^price, a kept one
by 2^(price - 1) (price in plain steps, capped at 1, so a probe that cannot pay doubles it on failure).
Its logarithm is a random walk with drift price - acceptance: it grows, and probes thin out up to 256
idle steps apart, only while the probes are kept less often than the break-even acceptance of a
one-token draft, which is the probe's price. (Doubling on every failure and resetting on a kept probe
grows without bound for any drafter kept less than half the time, though a drafter as cheap as a head
pays from an acceptance of about 0.1.)

Before anything is measured the policy assumes verifying k + 1 tokens costs ``1 + 0.1 k`` plain
steps (the order of what a small model's block costs on a CPU), so the first step of a request drafts a
couple of tokens, not k_max blind.

A cost model must not lock itself out of drafting: a width it never tries is never measured, so a wrong
estimate of it would stand for good. (Where a CPU switches kernels between one row and two, a 2-token
block can cost more than wider ones, and that slope, extrapolated, prices a 9-token block at several times
what it costs.) Hence two rules. Beyond the measured widths the slope is taken from
widths >= 2, and where only one of those is measured it is the lower of the measured slope and the
growth prior's; an extra token never costs more than a whole plain step. And the plan explores: where
a width not yet measured for this batch size would win if it cost what the growth prior says, the
plan drafts it, the first time at once and then one such plan in ``EXPLORE_EVERY`` (16), so the
estimate is replaced by a measurement; each width is explored until measured once, so exploring costs
a bounded number of steps per engine, never a steady share of them.

Requests learn from the requests before them: the engine keeps an :class:`AcceptanceMemory` per drafter
(greedy and sampled requests apart), and an evidence level a request has not seen yet starts from what
earlier requests saw of it, so a short answer does not pay again for drafts the traffic has already
shown to fail (or wait to trust those it has shown to succeed).

In a batch the draft lengths are chosen together (:func:`plan`): the target verifies one block for
all rows, and a batch of B rows already fills the machine more than one row does, so a draft that pays
for one request alone may not pay in a batch (its B - 1 neighbours gain nothing from its extra
tokens). The block is padded to its widest row, so the plan picks a width W and lets every row whose
draft gains fill it: it maximises the batch's expected tokens per unit of time,
sum_i E_i(k_i) / (cost(B rows x W) + drafting), against plain decoding's B / cost(B x 1) with the
same margin. Verify costs are kept by block shape, so a batch's costs are measured, not guessed, once
seen; a shape not yet seen is priced by its token count from the shapes that were (a block's matrix products
cost what its rows x width tokens cost, whatever rows hold them), so a batch size timed only at its plain step
is not priced from one row's relative curve. With one request this is the rule above.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from genspec.errors import ConfigError
from genspec.models.base import padded
from genspec.theory.leviathan import expected_tokens_per_call


class DraftLengthPolicy(StrEnum):
    """How many tokens a request drafts per step (:class:`DraftLength`)."""

    FIXED = "fixed"
    HEURISTIC = "heuristic"
    COST = "cost"


POLICIES = tuple(policy.value for policy in DraftLengthPolicy)
#: how much faster than plain decoding the cost policy's estimate must be before it drafts at all
MARGIN = 1.1
#: probes of a switched-off costly drafter spend at most this share of the idle time (:meth:`DraftLength.probe_wait`):
#: a drafter that keeps failing its probes costs about 3% of plain speed once it is switched off
PROBE_SHARE = 0.03
#: a probe may cost at most this share of the plain decoding time its request has left (:func:`probe_affordable`),
#: its reading of the request included: a useless drafter costs a fresh request about a tenth of plain speed at most
PROBE_BUDGET = 0.1
#: the longest wait, in idle steps, between probes of a switched-off costly drafter
MAX_PROBE_WAIT = 256
#: after the first, one plan in this many (among those where a width not yet measured would win at the
#: growth prior's cost) drafts that width to measure it: exploring a 2.5-plain-step block that gains 1.5
#: tokens wastes about one step, so at most ~1/16 of a step per step while a width is unmeasured
EXPLORE_EVERY = 16


class CostModel:
    """The target's verify time by the block's shape, ``batch`` rows x ``width`` tokens (padding runs
    through the decoder like real tokens): a running (exponentially weighted) average per measured
    shape. For a shape not measured (:meth:`verify_cost` gives the order): within its batch size, linear
    interpolation between measured widths; between two measured batch sizes of its width; else by its token
    count (:meth:`token_curve`) where a block of that many tokens or more was measured or the batch size has no
    curve of its own; beyond every measured block, the least-squares slope of that batch size's measurements;
    the growth prior (each extra token costs ``growth_prior`` of a one-token step) where nothing is measured.
    Shapes differ much: on a CPU an extra token of a block costs a single row far more than each of four rows
    (the manual's Draft length page has the measured curves).
    ``genspec serve`` measures a grid of shapes at start (:func:`genspec.calibration.measure_verify_costs`)."""

    def __init__(self, decay: float = 0.8, growth_prior: float = 0.1, explore_every: int = EXPLORE_EVERY):
        self.decay = decay
        self.growth_prior = growth_prior
        self.explore_every = explore_every
        self.verify: dict[tuple[int, int], float] = {}  # (batch, width) -> seconds; changed by observe_verify only
        # (batch, width) -> the plain step of that batch when that width was timed (averaged alike): a width is
        # priced at its time scaled by how the plain step moved since (:meth:`_widths`)
        self._plain_then: dict[tuple[int, int], float] = {}
        self.prefill_per_token: float | None = None  # the target's prefill, seconds per prompt token
        self._priced: dict[tuple[int, int], float | None] = {}  # (width, batch) -> verify_cost, until an observation
        self._guessed: dict[tuple[int, int], bool] = {}  # (width, batch) -> extrapolated, until an observation
        # batch -> what steps of several blocks took over the sum of their blocks' costs (the engine's work over
        # the padded slots of its logits, contexts longer than the calibration's): such a step is priced at it
        self.split_factor: dict[int, float] = {}
        self._explore_wait: dict[int, int] = {}  # batch -> plans since the last exploration
        self._curves: dict[int, dict[int, float]] = {}  # batch -> _widths(batch), until an observation
        self._tokens: dict[int, float] | None = None  # the token curve (:meth:`token_curve`), until an observation
        # (shapes, batch) -> shapes_relative, until an observation: a plan prices the same steps many times
        self._steps: dict[tuple[tuple[tuple[int, int], ...], int], float] = {}

    def widest(self, batch: int = 1) -> int:
        """The widest block measured for ``batch`` rows (0: none)."""
        return max((w for b, w in self.verify if b == batch), default=0)

    def extrapolated(self, width: int, batch: int) -> bool:
        """Whether :meth:`verify_cost` of ``batch`` rows x ``width`` tokens is a guess beyond what was measured:
        wider than any block of ``batch`` rows, not between two measured batch sizes with that width (a 13 x 8
        block between a measured 8 x 8 and 16 x 8 is interpolated, not guessed), and more tokens than any
        block measured (a 4 x 3 block, 12 tokens, is priced from blocks of 9 and 16 tokens: :meth:`token_curve`)."""
        key = (width, batch)
        if key not in self._guessed:  # asked for every block of every candidate a plan prices: once per observation
            self._guessed[key] = (width > self.widest(batch) and self._between_batches(width, batch) is None
                                  and batch * width > max(self.token_curve(), default=0))
        return self._guessed[key]

    def token_curve(self) -> dict[int, float]:
        """The measured blocks by their token count, rows x width -> seconds (the cheapest block of each count):
        what prices a shape its batch size has not measured. A block's matrix products cost what its token count
        does, whatever rows hold them (16 rows of 1 token and 1 row of 16 multiply the same 16 vectors), so on a
        machine where 9 tokens of one row cost 3.8 plain steps, 16 rows of 9 tokens cost about 8 plain steps
        of 16 rows, not the 3.8 that one row's relative curve says."""
        if self._tokens is None:
            self._tokens = {}
            for batch in {b for b, _ in self.verify}:
                for width, seconds in self._widths(batch).items():
                    n = batch * width
                    self._tokens[n] = min(seconds, self._tokens.get(n, seconds))
        return self._tokens

    def prior_relative(self, width: int) -> float:
        """The growth prior: verifying ``width`` tokens costs ``1 + growth_prior (width - 1)`` plain steps."""
        return 1 + self.growth_prior * (width - 1)

    def explore_due(self, batch: int) -> bool:
        """Called by :func:`plan` when a width not yet measured for ``batch`` rows could win: True the
        first time, then one call in ``explore_every`` (the plan then drafts that width, and the engine
        measures it)."""
        wait = self._explore_wait.get(batch, self.explore_every - 1) + 1
        self._explore_wait[batch] = 0 if wait >= self.explore_every else wait
        return wait >= self.explore_every

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target read ``tokens`` prompt tokens in ``seconds`` (a join's prefill)."""
        if tokens > 0:
            value, old = seconds / tokens, self.prefill_per_token
            self.prefill_per_token = value if old is None else self.decay * old + (1 - self.decay) * value

    def observe_verify(self, width: int, seconds: float, batch: int = 1) -> None:
        self._priced.clear()
        self._steps.clear()
        self._guessed.clear()
        self._curves.clear()
        self._tokens = None
        old = self.verify.get((batch, width))
        self.verify[(batch, width)] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        plain = self.verify.get((batch, 1))
        if width > 1 and plain is not None:
            then = self._plain_then.get((batch, width))
            self._plain_then[(batch, width)] = plain if then is None else self.decay * then + (1 - self.decay) * plain

    def observe_split(self, shapes: list[tuple[int, int]], seconds: float, batch: int) -> None:
        """A step of ``batch`` rows the target ran as the blocks ``shapes`` (more than one) took ``seconds``: the
        ratio to its blocks' summed costs, a running average per batch size, prices such steps from now on; or,
        where blocks are priced by a guess (:meth:`extrapolated`), what the others leave is shared among them in
        proportion to their guesses (a step of 16 x 1, 3 x 6 and 8 x 6 blocks, the last two guessed, times them
        both), so that exploring measures what it explores."""
        if len(shapes) < 2:
            return
        beyond = [i for i, (rows, tokens) in enumerate(shapes) if self.extrapolated(tokens, rows)]
        costs = [self.verify_cost(tokens, rows) for rows, tokens in shapes]
        if beyond:
            others = [c for i, c in enumerate(costs) if i not in beyond]
            guesses = [costs[i] for i in beyond]
            if any(c is None for c in others + guesses) or seconds <= sum(others) or sum(guesses) <= 0:
                return
            left = seconds - sum(others)
            for i, guess in zip(beyond, guesses):
                rows, tokens = shapes[i]
                self.observe_verify(tokens, left * guess / sum(guesses), rows)
            return
        if any(c is None or c <= 0 for c in costs):
            return
        value, old = seconds / sum(costs), self.split_factor.get(batch)
        self.split_factor[batch] = value if old is None else self.decay * old + (1 - self.decay) * value
        self._steps.clear()

    def _widths(self, batch: int) -> dict[int, float]:
        """The measured widths of ``batch`` rows, each at most what any wider block of them cost: timing
        noise only ever adds time, and one slow sample (4 rows x 3 tokens timed dearer than 4 x 5) must not
        keep the plan off a width for good.

        A width is timed rarely and the plain step every step, as the contexts grow and a shared machine's speed
        moves: a wide block timed when a plain step of ``batch`` rows took 0.10 s, priced as it was while plain
        steps now take 0.20 s, would look half its price against them (drafting would look cheap because the
        machine slowed). So each width's time is scaled by the plain step's now over the plain step's when it
        was timed."""
        if batch not in self._curves:  # a plan reads it for many shapes: once per observation
            self._curves[batch] = self._measured_widths(batch)
        return self._curves[batch]

    def _measured_widths(self, batch: int) -> dict[int, float]:
        plain = self.verify.get((batch, 1))
        curve = sorted((w, t) for (b, w), t in self.verify.items() if b == batch)
        out, cheapest = {}, float("inf")
        for width, seconds in reversed(curve):
            then = self._plain_then.get((batch, width))
            if plain is not None and then:
                seconds *= plain / then
            cheapest = min(cheapest, seconds)
            out[width] = cheapest
        return out

    def verify_cost(self, width: int, batch: int = 1) -> float | None:
        """Seconds to verify ``batch`` rows of ``width`` tokens (None if nothing is known of this batch
        size and nothing can be borrowed). A batch size with fewer than two widths measured, between two
        that have this width measured, is interpolated linearly in the rows (12 rows x 1 token between 8
        and 16 rows: the micro-batches of a ragged step have such shapes)."""
        key = (width, batch)
        if key not in self._priced:  # a plan prices many shapes per step: each once until the next observation
            self._priced[key] = self._verify_cost(width, batch)
        return self._priced[key]

    def _verify_cost(self, width: int, batch: int) -> float | None:
        """In order: the measured width; between two measured widths of this batch size; between two measured
        batch sizes of this width; by token count (:meth:`token_curve`, scaled to this batch's plain step) where a
        block of as many tokens or more was measured, or where this batch size has no curve of its own; beyond
        every measured block, this batch size's own slope (:func:`_along`); the growth prior."""
        curve = self._widths(batch)
        if width in curve:
            return curve[width]
        if len(curve) >= 2 and width < max(curve):
            return _along(curve, width, self.growth_prior)
        between = self._between_batches(width, batch)
        if between is not None:
            return between
        tokens = self.token_curve()
        step = curve.get(1) if curve else None
        if len(tokens) >= 2 and (batch * width <= max(tokens) or len(curve) < 2):
            priced = _along(tokens, batch * width, self.growth_prior)
            return priced if step is None else step * priced / _along(tokens, batch, self.growth_prior)
        if len(curve) >= 2:
            return _along(curve, width, self.growth_prior)
        if step is None:
            step = self._borrowed_step(batch)
            if step is None:
                return None
        return step * self.prior_relative(width)

    def _between_batches(self, width: int, batch: int) -> float | None:
        """``width`` tokens at ``batch`` rows, linear between the nearest batch sizes below and above that have
        that width measured (None where there are not both)."""
        measured = {b: self._widths(b)[width] for b, w in self.verify if w == width}
        below = [b for b in measured if b < batch]
        above = [b for b in measured if b > batch]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        return measured[lo] + (measured[hi] - measured[lo]) * (batch - lo) / (hi - lo)

    def shapes_relative(self, shapes: list[tuple[int, int]], batch: int) -> float:
        """The cost of a step that runs as the uniform blocks ``shapes`` (``(rows, tokens)`` each:
        :meth:`genspec.models.base.CausalLM.block_shapes`), in plain steps of ``batch`` rows: the sum of the
        blocks' verify costs, times what such steps were seen to cost over that sum (:meth:`observe_split`). One
        block of all the rows is :meth:`relative` of its width; where a block's cost or the plain step is unknown,
        the step is priced as its rows padded to the widest."""
        key = (tuple(shapes), batch)
        if key not in self._steps:
            self._steps[key] = self._shapes_relative(shapes, batch)
        return self._steps[key]

    def _shapes_relative(self, shapes: list[tuple[int, int]], batch: int) -> float:
        if len(shapes) == 1 and shapes[0][0] == batch:
            return self.relative(shapes[0][1], batch)
        plain = self.verify_cost(1, batch)
        costs = [self.verify_cost(tokens, rows) for rows, tokens in shapes]
        if plain is None or plain <= 0 or any(c is None for c in costs):
            return self.relative(sum(tokens for _, tokens in shapes), batch)
        return self.split_factor.get(batch, 1.0) * sum(costs) / plain

    def _borrowed_step(self, batch: int) -> float | None:
        """A plain step at ``batch`` rows from the nearest measured plain step (linear in rows)."""
        plain = {b: t for (b, w), t in self.verify.items() if w == 1}
        if not plain:
            return None
        nearest = min(plain, key=lambda b: abs(b - batch))
        return plain[nearest] * (1 + self.growth_prior * (batch - 1)) / (1 + self.growth_prior * (nearest - 1))

    def relative(self, width: int, batch: int = 1) -> float:
        """Verify cost of ``batch`` rows x ``width`` tokens in plain steps of that batch (the growth prior where
        nothing prices either)."""
        block, plain = self.verify_cost(width, batch), self.verify_cost(1, batch)
        if block is None or not plain:
            return self.prior_relative(width)
        return block / plain


def _along(curve: dict[int, float], width: int, growth_prior: float) -> float:
    """``curve`` (width -> seconds, two widths or more) at ``width``: interpolated, or extrapolated with a
    slope (below the narrowest width, never under its time per token). The step from 1 token to 2 is no
    per-token cost: on a CPU it is where the matrix kernels change (a 2-token block may cost nearly twice a
    one-token step and a 9-token one barely more than the 2-token one). So the slope is the least-squares
    slope of the widths >= 2 where two or more are measured; else (width 1 and one wider width) the measured
    slope or the growth prior's (``growth_prior`` plain steps per token), whichever is lower: an optimistic
    price is corrected by drafting that width once, a pessimistic one never is (a 1-to-2 slope extrapolated
    can price a 9-token block at five times what it costs). Any slope above one plain step per token is a
    jump, not a cost, and the growth prior's stands in."""
    if width in curve:
        return curve[width]
    below = [w for w in curve if w < width]
    above = [w for w in curve if w > width]
    if below and above:
        lo, hi = max(below), min(above)
        return curve[lo] + (curve[hi] - curve[lo]) * (width - lo) / (hi - lo)
    narrowest = min(curve)
    plain_step = curve[narrowest] / (1 + growth_prior * (narrowest - 1))  # curve[1] where that is measured
    prior_slope = growth_prior * plain_step
    wide = [w for w in curve if w >= 2]
    widths = wide if len(wide) >= 2 else list(curve)
    mean_w, mean_t = sum(widths) / len(widths), sum(curve[w] for w in widths) / len(widths)
    slope = max(sum((w - mean_w) * (curve[w] - mean_t) for w in widths) / sum((w - mean_w) ** 2 for w in widths),
                0.0)
    if len(wide) < 2:
        slope = min(slope, prior_slope)
    if slope > plain_step:
        slope = prior_slope
    if below:
        nearest = max(below)
        return curve[nearest] + slope * (width - nearest)
    # below every measured width: never under the narrowest one's time per token, since a wider block costs
    # less per token, not more (widths 50 and 176 measured at 0.10 s and 0.56 s price 16 tokens at 0.032 s,
    # where their slope alone would reach zero at 23 tokens)
    nearest = min(above)
    return max(curve[nearest] + slope * (width - nearest), curve[nearest] * width / nearest)


class DraftCost:
    """A costly drafter's time, averaged: per draft position (one pass of its model over its rows) and per
    draft for the reading before it (:meth:`Drafter.read`: what it must take in of the tokens committed
    since its last draft, whatever the depth).

    The reading is priced apart because it does not grow with the depth: a head with 3 token layers runs
    those layers over the tokens just committed before it can draft at all (about twice a head pass), while
    one more position is one more head pass. Priced per
    position, the reading would make every position look as dear as a whole draft and keep such a head
    one token deep.

    Until measured, a position is priced at ``prior_steps`` plain steps (the drafter's ``draft_cost_prior``;
    0.5 by default: early exit at layer 4 of 18 and layer skip also run the 262k-token head per draft
    position, the int8 copy measured 0.9) and the reading at nothing. Priced at nothing, a new engine's
    first step would draft as if the drafter were free (a drafter that accepts nothing, on a fresh engine as
    ``genspec generate`` has, would cost short answers a good share of plain speed; the manual's
    self-speculation page has the measurement). At this price a fresh engine does not draft blind; it probes one token after a few steps and
    prices from then on."""

    def __init__(self, decay: float = 0.8, prior_steps: float = 0.5):
        self.decay = decay
        self.prior_steps = prior_steps
        self.per_position: float | None = None
        self.per_read: float | None = None

    def steps(self, step_seconds: float) -> float:
        """Time per draft position in plain steps of ``step_seconds`` (the prior until measured)."""
        if self.per_position is None or not step_seconds:
            return self.prior_steps
        return self.per_position / step_seconds

    def draft_steps(self, step_seconds: float, positions: int) -> float:
        """A draft of ``positions`` positions (0: none, free), its reading included, in plain steps."""
        if positions <= 0:
            return 0.0
        reading = self.per_read / step_seconds if self.per_read is not None and step_seconds else 0.0
        return reading + positions * self.steps(step_seconds)

    def observe(self, positions: int, seconds: float, read_seconds: float = 0.0) -> None:
        """A draft of ``positions`` positions took ``seconds`` after ``read_seconds`` of reading."""
        if positions <= 0:
            return
        self.per_position = self._average(self.per_position, seconds / positions)
        self.per_read = self._average(self.per_read, read_seconds)

    def _average(self, old: float | None, value: float) -> float:
        return value if old is None else self.decay * old + (1 - self.decay) * value


def probe_affordable(draft_cost: DraftCost, costs: CostModel, batch: int, read_tokens: int, room: int) -> bool:
    """May a switched-off costly drafter be probed for a request with ``room`` tokens left to generate,
    when it must first read ``read_tokens`` of the request (:meth:`Drafter.catch_up_tokens`)? The probe
    costs a one-position draft (:meth:`DraftCost.draft_steps`) and that reading, each of its tokens priced at
    the drafter's cost per position (a model reads a prompt token for about what the target's prefill pays per token, times the drafter's size
    relative to the target); it is made only if that is at most ``PROBE_BUDGET`` of the plain decoding
    time left. A useless drafter then costs about a tenth of plain speed at most, where reading a long
    prompt (a layer skip reading a 1,500-token document) to probe a 32-token answer would cost more than the
    answer. A probe of a request with a long prompt and a short answer is skipped: the drafter could not win
    that time back."""
    step = costs.verify_cost(1, batch)
    if not step:
        return True
    reading = read_tokens * (costs.prefill_per_token or step) / step
    return draft_cost.draft_steps(step, 1) + draft_cost.steps(step) * reading <= PROBE_BUDGET * room


class Acceptance:
    """Discounted counts of one (row, evidence level): how often draft token 1 was accepted, and how
    often token i + 1 was accepted once token i had been."""

    def __init__(self, prior_first: float, prior_later: float, prior_weight: float, decay: float):
        self.decay = decay
        self.first = [prior_first * prior_weight, prior_weight]  # accepted, tested
        self.later = [prior_later * prior_weight, prior_weight]

    # the counts are discounted sums rounded separately, so "accepted / tested" may round to just above 1
    # when every draft was kept (1.0000000000000002 broke Leviathan's formula mid-benchmark): rates are capped
    @property
    def rate_first(self) -> float:
        return min(1.0, self.first[0] / self.first[1])

    @property
    def rate_later(self) -> float:
        return min(1.0, self.later[0] / self.later[1])

    def record(self, drafted: int, accepted: int) -> None:
        d = self.decay
        self.first = [d * self.first[0] + (accepted > 0), d * self.first[1] + 1]
        if accepted > 0 and drafted > 1:
            tested = accepted - 1 + (1 if accepted < drafted else 0)
            if tested:
                self.later = [d * self.later[0] + (accepted - 1), d * self.later[1] + tested]

    def record_later(self, kept: bool) -> None:
        """One later-position outcome alone: a draft token after ones that were kept (scored unverified)."""
        d = self.decay
        self.later = [d * self.later[0] + kept, d * self.later[1] + 1]

    def expected_tokens(self, k: int) -> float:
        """Leviathan's expected tokens per target call with these two rates (the theory's formula)."""
        return expected_tokens_per_call(self.rate_later, k, first_alpha=self.rate_first)


class AcceptanceMemory:
    """What one drafter's proposals achieved across requests, per evidence level: where a new request's
    estimates start. Without it every request would start from the same prior (first token kept 1 time
    in 2), so each short answer would pay again for drafts the previous requests had already shown to
    fail: on a 32-token answer one failed 8-token lookup draft costs the time of one or two plain tokens (a
    9-token block costs two to three plain steps on a CPU).
    The engine keeps one memory per drafter and per kind of request (greedy or sampled: when sampling, a
    deterministic draft token y is kept with probability q(y) only, so the same evidence is worth less).
    Counts decay (``decay`` per record), so the memory follows a change of traffic."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.levels: dict[object, Acceptance] = {}

    def _level(self, evidence) -> Acceptance:
        if evidence not in self.levels:
            self.levels[evidence] = Acceptance(0.0, 0.0, 0.0, self.decay)
        return self.levels[evidence]

    def record(self, evidence, drafted: int, accepted: int) -> None:
        self._level(evidence).record(drafted, accepted)

    def record_later(self, evidence, kept: bool) -> None:
        self._level(evidence).record_later(kept)

    def rates(self, evidence) -> tuple[float | None, float | None]:
        """(first, later) acceptance seen for ``evidence`` across requests (None where nothing was seen)."""
        seen = self.levels.get(evidence)
        if seen is None:
            return None, None
        first = seen.rate_first if seen.first[1] > 0 else None
        later = seen.rate_later if seen.later[1] > 0 else None
        return first, later


class DraftLength:
    """One request's draft-length state: its policy, its acceptance estimates (per evidence level) and,
    for the cost policy, the probing of a switched-off costly drafter. ``costs`` / ``draft_cost`` are
    shared with the engine's other requests (the machine's costs); :func:`plan` decides a batch's
    lengths, :meth:`limit` one request's alone."""

    def __init__(self, policy: "str | DraftLengthPolicy", k_max: int, cost_model: CostModel | None = None,
                 draft_cost: DraftCost | None = None, prior_alpha: float = 0.5, prior_later: float = 0.6,
                 prior_weight: float = 2.0, decay: float = 0.9, memory: AcceptanceMemory | None = None,
                 probe_tokens: int = 1):
        if policy not in POLICIES:
            raise ConfigError(f"unknown draft length policy {policy!r}; choose from: {', '.join(POLICIES)}")
        self.policy = DraftLengthPolicy(policy)
        self.k_max = k_max
        self.current = k_max
        self.costs = cost_model or CostModel()
        self.draft_cost = draft_cost
        self.memory = memory
        self.probe_tokens = probe_tokens  # what a one-token probe puts in the verify block (a tree: its first level)
        self._prior = (prior_alpha, prior_later, prior_weight, decay)
        self.acceptance: dict[object, Acceptance] = {}
        # a drafter switched off is probed with one token now and then, less often each time a probe fails
        self.idle_steps = 0
        self.probe_backoff = 1.0  # the priced wait between probes is multiplied by this
        self._probing = False
        # the rest of an unverified free proposal whose first token was right, and its evidence: scored against
        # the tokens the next steps emit (:meth:`shadow`)
        self._unseen: tuple[list[int], object] | None = None

    def estimate(self, evidence=None) -> Acceptance:
        """The acceptance counts for proposals backed by ``evidence`` (None: no evidence). A level seen
        for the first time starts from what earlier requests saw of it (the memory); a level they never
        saw starts from the global prior, or from the pooled rates over this request's levels seen so far
        where those are lower: pessimism is shared, optimism is not. Either is a weak prior
        (``prior_weight`` pseudo-counts) that the request's own outcomes soon outweigh."""
        table = self.acceptance
        if evidence not in table:
            prior_first, prior_later, weight, decay = self._prior
            first, later = self.memory.rates(evidence) if self.memory is not None else (None, None)
            if first is not None:
                table[evidence] = Acceptance(first, prior_later if later is None else later, weight, decay)
                return table[evidence]
            if table:
                seen = list(table.values())
                prior_first = min(prior_first, sum(a.first[0] for a in seen) / sum(a.first[1] for a in seen))
                prior_later = min(prior_later, sum(a.later[0] for a in seen) / sum(a.later[1] for a in seen))
            table[evidence] = Acceptance(prior_first, prior_later, weight, decay)
        return table[evidence]

    def expected_tokens(self, k: int, evidence=None) -> float:
        return self.estimate(evidence).expected_tokens(k) if k > 0 else 1.0

    def limit(self, evidence=None, probe: bool = True) -> int:
        """Tokens to draft for this request alone (cost policy: 0 switches speculation off; with
        ``probe`` a switched-off request drafts one token now and then to re-estimate; a free drafter
        needs no probes, it is scored on its unverified proposals)."""
        if self.policy is not DraftLengthPolicy.COST:
            return self.current
        return self.after_plan(self.best_k(evidence), probe)

    def best_k(self, evidence=None) -> int:
        """The k with the highest predicted tokens per plain-step time (0 unless it beats MARGIN)."""
        return plan([RowPlan(self, evidence, self.k_max, self.draft_cost)], self.costs)[0]

    def after_plan(self, planned: int, probe: bool | Callable[[], bool]) -> int:
        """The planned length, or after too many steps without drafting a one-token probe. ``probe`` may be
        a check asked only when a probe is due (whether it is affordable: it reads the request's sequence,
        which is not work for every decode step); if it says no, the probe waits another round."""
        self._probing = False
        if planned > 0:
            self.idle_steps, self.probe_backoff = 0, 1.0
            return planned
        if not probe:
            return 0
        self.idle_steps += 1
        if self.idle_steps >= self.probe_wait():  # probe: one draft token, to re-estimate
            self.idle_steps = 0
            if callable(probe) and not probe():
                return 0
            self._probing = True
            return 1
        return 0

    def probe_price(self) -> float:
        """A probe's price in plain steps of one row: its one-position draft and the verified tokens it adds
        (``probe_tokens``: one, or a tree's first level). It is also the break-even acceptance of a one-token
        draft (a kept token saves one plain step)."""
        step = self.costs.verify_cost(1)
        drafting = self.draft_cost.draft_steps(step, 1) if self.draft_cost is not None else 0.0
        return max(0.0, drafting + self.costs.relative(1 + self.probe_tokens) - 1)

    def probe_wait(self) -> int:
        """Idle steps before the next probe: the probe's price over ``PROBE_SHARE``, times the backoff of
        failed probes (at most ``MAX_PROBE_WAIT``)."""
        base = max(1, math.ceil(self.probe_price() / PROBE_SHARE - 1e-9))
        return min(math.ceil(base * self.probe_backoff - 1e-9), MAX_PROBE_WAIT)

    def update(self, drafted: int, accepted: int, evidence=None) -> None:
        """Record a verified draft of ``drafted`` tokens of which ``accepted`` were kept."""
        if drafted <= 0:
            return
        if self._probing:  # the backoff walks with drift (break-even - acceptance): see the module docstring
            self._probing = False
            price = min(1.0, self.probe_price())
            self.probe_backoff = min(max(1.0, self.probe_backoff * 2 ** (price - 1 if accepted else price)),
                                     MAX_PROBE_WAIT)
        self.estimate(evidence).record(drafted, accepted)
        if self.memory is not None:
            self.memory.record(evidence, drafted, accepted)
        if self.policy is DraftLengthPolicy.HEURISTIC:
            step = 2 if accepted == drafted else -1
            self.current = max(1, min(self.k_max, self.current + step))

    def shadow(self, proposal: list[int], emitted: list[int], evidence=None, drafted: int = 0) -> None:
        """Score the part of a free proposal that was not verified against what the target emitted instead
        (``emitted``: the kept draft tokens, then the target's own next token). Nothing drafted: its first
        token, a first-position outcome (and if that was right, the rest of it against what the next steps emit,
        later-position outcomes: :meth:`_score_unseen`). ``drafted`` tokens of it drafted and all kept: its next token against
        the target's, a later-position outcome. Without the second a plan that drafts one token at a time
        never learns that longer drafts would pay (only drafts of two tokens or more test later positions):
        at temperature 0.7 a suffix hybrid drafted 1 token and kept it at step after step of repeating
        answers."""
        if len(proposal) <= drafted or len(emitted) <= drafted or proposal[:drafted] != emitted[:drafted]:
            return
        kept = proposal[drafted] == emitted[drafted]
        if drafted == 0:
            self.estimate(evidence).record(1, int(kept))
            if self.memory is not None:
                self.memory.record(evidence, 1, int(kept))
            if kept and len(proposal) > 1 and self._unseen is None:
                self._unseen = (list(proposal[1:]), evidence)
        else:
            self._score_later(evidence, kept)

    def _score_later(self, evidence, kept: bool) -> None:
        self.estimate(evidence).record_later(kept)
        if self.memory is not None:
            self.memory.record_later(evidence, kept)

    def _score_unseen(self, emitted: list[int]) -> None:
        """Score the rest of the last unverified proposal whose first token was right against the tokens this
        step emitted after it: a later-position outcome per token, up to the first wrong one. Without it, a plan
        that stopped drafting never learns later positions again: where a 2-token block costs two plain steps, a
        request whose first drafts failed past their first token prices every draft at a loss, and the requests
        that start from its memory draft nothing, however often their lookups would be right. Example: proposal
        ``[5, 6, 7]`` with 5 emitted; the next step emits 6 (kept), the one after 9 (7 was wrong): two later
        outcomes, one kept."""
        rest, evidence = self._unseen
        for i, token in enumerate(emitted):
            if i >= len(rest):
                break
            kept = rest[i] == token
            self._score_later(evidence, kept)
            if not kept:
                self._unseen = None
                return
        rest = rest[len(emitted):]
        self._unseen = (rest, evidence) if rest else None

    def learn(self, reached: int, accepted: int, emitted: list[int], evidence=None, proposal: list[int] = (),
              drafted: int = 0) -> None:
        """One verified step: a draft that went ``reached`` deep along the kept path and kept ``accepted``
        (:meth:`update`), then the part of a free ``proposal`` (its first chain before the plan clipped it)
        that was not verified, against what the target ``emitted`` (:meth:`shadow`). A step that drafted scores its
        own positions; one that did not first scores the rest of an earlier unverified proposal against what it
        emitted."""
        if self._unseen is not None:
            if reached > 0:
                self._unseen = None
            else:
                self._score_unseen(list(emitted))
        self.update(reached, accepted, evidence)
        self.shadow(list(proposal), emitted, evidence, drafted=drafted)

    def __repr__(self) -> str:
        rates = {e: round(a.rate_first, 2) for e, a in self.acceptance.items()}
        return f"DraftLength({self.policy}, k_max={self.k_max}, first-token acceptance={rates})"


@dataclass
class RowPlan:
    """One row of a batch step for :func:`plan`: its policy (None: no drafter), the evidence behind its
    drafter's offer, ``cap`` the most tokens it can draft (what a free drafter proposed, or the room left),
    ``draft_cost`` its drafter's cost per position (None: free), ``block`` the draft tokens a draft of each
    depth puts in its verify block (:meth:`Drafter.block_tokens`; None: the depth, a chain's). For the probes
    of :func:`decide`: ``room`` the tokens the row may still draft, ``read_tokens`` what its costly drafter must
    read before drafting for it (:meth:`Drafter.catch_up_tokens`, asked only when a probe is due)."""

    policy: DraftLength | None
    evidence: object = None
    cap: int = 0
    draft_cost: DraftCost | None = None
    block: Callable[[int], int] | None = None
    room: int = 0
    read_tokens: Callable[[], int] | None = None

    def width(self, depth: int) -> int:
        """The draft tokens this row adds to the verify block when it drafts ``depth`` deep."""
        return self.block(depth) if self.block is not None and depth > 0 else depth


def plan(rows: list[RowPlan], costs: CostModel, shapes: Callable[[list[int]], list[tuple[int, int]]] = padded
         ) -> list[int]:
    """Draft lengths for one batch step. Rows with a fixed or heuristic policy draft their own k. For
    each depth d the cost rows draft ``min(d, cap)`` tokens: a free drafter's rows always
    (their tokens fill a block that is that wide anyway), a costly drafter's rows together if that raises
    the batch's expected tokens per unit of time (its drafting costs time); the best d is kept if it
    beats plain decoding by ``MARGIN``. Time: the block's verify cost in plain steps of
    this batch, plus each costly drafter's time for its longest draft (its pass serves all its rows): its
    reading once and each position (:meth:`DraftCost.draft_steps`). A row's block is what its drafter says a draft of that depth puts in it (``RowPlan.block``): a tree of
    4 nodes makes a 5-token block at every depth, so its one-token draft is no cheaper to verify than a
    4-deep one. (Priced as a chain, such a tree is planned one token deep at every step, and gains far
    less than the same head drafting 4 deep always: the manual's Draft length page.)

    Exploring: a block wider than any measured at its rows, and not between two measured batch sizes, is
    priced by extrapolation (:meth:`CostModel.extrapolated`), which
    may be wrong and, if too dear, would never be corrected. If such a width would beat the choice
    above when it cost what the growth prior says (or less, where the model says so), the plan drafts
    it when :meth:`CostModel.explore_due` says so (the first such plan, then one in ``EXPLORE_EVERY``),
    taking the widest such block.

    ``shapes``: the uniform blocks the target runs a step of given row widths as (its
    :meth:`~genspec.models.base.CausalLM.block_shapes`), priced by :meth:`CostModel.shapes_relative`. Where
    rows are not padded (llama.cpp with a cache stream per row), one row drafting 4 tokens beside 15 plain ones
    costs a 16 x 1 block and a 1 x 4 one, not a 16 x 5 block."""
    batch = len(rows)
    ks = [min(r.policy.current, r.cap) if r.policy is not None and r.policy.policy is not DraftLengthPolicy.COST else 0 for r in rows]
    costed = [i for i, r in enumerate(rows) if r.policy is not None and r.policy.policy is DraftLengthPolicy.COST and r.cap > 0]
    if not costed:
        return ks
    step = costs.verify_cost(1, batch)

    gains: dict[tuple[int, int], float] = {}  # each row's gain at each depth, computed once per plan

    def gain(i: int, k: int) -> float:
        if (i, k) not in gains:
            gains[(i, k)] = rows[i].policy.expected_tokens(k, rows[i].evidence) - 1.0
        return gains[(i, k)]

    def row_widths(lengths: list[int]) -> list[int]:  # each row's tokens in the verify block
        return [1 + r.width(k) for r, k in zip(rows, lengths)]

    def estimated(widths: list[int]) -> float:
        return costs.shapes_relative(shapes(widths), batch)

    def unmeasured(widths: list[int]) -> bool:  # a block priced by extrapolation
        return any(costs.extrapolated(width, count) for count, width in shapes(widths))

    def optimistic(widths: list[int]) -> float:  # unmeasured wider blocks at the growth prior's cost, if lower
        if not unmeasured(widths):
            return estimated(widths)
        return min(estimated(widths), costs.prior_relative(max(widths)))

    def tokens(lengths: list[int]) -> float:  # expected tokens of the step
        return batch + sum(gain(i, k) for i, k in enumerate(lengths) if k and rows[i].policy is not None)

    def draft_steps(lengths: list[int]) -> float:  # the costly drafters' time, in plain steps
        longest: dict[int, tuple[DraftCost, int]] = {}
        for r, k in zip(rows, lengths):
            if r.draft_cost is not None and k:
                cost, most = longest.get(id(r.draft_cost), (r.draft_cost, 0))
                longest[id(r.draft_cost)] = (cost, max(most, k))
        return sum(c.draft_steps(step, k) for c, k in longest.values())

    def rate(lengths: list[int], relative=estimated) -> float:
        return tokens(lengths) / (relative(row_widths(lengths)) + draft_steps(lengths))

    best, best_rate = list(ks), rate(ks) * (MARGIN if not any(ks) else 1.0)
    top = 1 + max(min(rows[i].cap, rows[i].policy.k_max) for i in costed)
    free = [i for i in costed if rows[i].draft_cost is None]
    by_drafter: dict[int, list[int]] = {}
    for i in costed:
        if rows[i].draft_cost is not None:
            by_drafter.setdefault(id(rows[i].draft_cost), []).append(i)

    def fill(depth: int, relative) -> tuple[list[int], float]:
        """The lengths for drafts at most ``depth`` deep and their rate (verify costs from ``relative``)."""
        lengths = {i: min(depth, rows[i].cap, rows[i].policy.k_max) for i in free}
        if shapes is padded:  # free tokens in a block that is this wide anyway
            trial = list(ks)
            for i in free:
                trial[i] = lengths[i]
            current = rate(trial, relative)
        else:  # each row's tokens cost their own: the likeliest to gain first, as many as give the best rate
            # (the free rows' drafting costs nothing, so only the block and the expected tokens change as rows
            # are added: both kept up to date row by row)
            widths, expected, drafting = row_widths(ks), tokens(ks), draft_steps(ks)
            trial, current = list(ks), expected / (relative(widths) + drafting)
            candidate, order = list(ks), sorted(free, key=lambda i: gain(i, lengths[i]), reverse=True)
            for n, i in enumerate(order):
                candidate[i], widths[i] = lengths[i], 1 + rows[i].width(lengths[i])
                expected += gain(i, lengths[i]) if lengths[i] else 0.0
                if n + 1 < len(order) and gain(order[n + 1], lengths[order[n + 1]]) == gain(i, lengths[i]):
                    continue  # rows that gain alike are taken together (one rate per evidence level, not per row)
                value = expected / (relative(widths) + drafting)
                if value >= current:
                    trial, current = list(candidate), value
        for group in by_drafter.values():  # a costly drafter drafts for its rows, or not at all
            candidate = list(trial)
            for i in group:
                candidate[i] = min(depth, rows[i].cap, rows[i].policy.k_max)
            value = rate(candidate, relative)
            if value > current:
                trial, current = candidate, value
        return trial, current

    candidates = []  # (lengths, rate at the optimistic price) of steps with a block wider than any measured
    for depth in range(1, top):
        trial, current = fill(depth, estimated)
        if current > best_rate:
            best, best_rate = trial, current
        deepest = [min(depth, rows[i].cap, rows[i].policy.k_max) if i in costed else k for i, k in enumerate(ks)]
        if unmeasured(row_widths(deepest)):  # (no block this deep is wider than one measured: nothing to explore)
            trial, current = fill(depth, optimistic)
            if unmeasured(row_widths(trial)):
                candidates.append((trial, current))
    # explore the widest block that could win: once it is measured, every narrower width is interpolated,
    # so an engine explores about once per batch size (exploring the best-looking width instead measured
    # one width more each time, 4, 5, 6, ... 9: six failed drafts of 4 to 8 tokens over the first
    # requests at T 0.7, each costing 1.5-2 plain steps)
    winners = [trial for trial, current in candidates if current > best_rate]
    if winners and not unmeasured(row_widths(best)) and costs.explore_due(batch):  # (an unmeasured best explores)
        return max(winners, key=lambda lengths: max(row_widths(lengths)))
    return best


def decide(rows: list[RowPlan], costs: CostModel, shapes: Callable[[list[int]], list[tuple[int, int]]] = padded
           ) -> list[int]:
    """The lengths a batch step drafts: the :func:`plan` (``shapes`` as there), then, for the costly rows of the cost policy, a
    one-token probe now and then where the plan switched them off (:meth:`DraftLength.after_plan`), if it is
    affordable (:func:`probe_affordable`, checked only when a probe is due), each at most the row's room."""
    lengths = plan(rows, costs, shapes)
    for i, row in enumerate(rows):
        if row.policy is None or row.draft_cost is None or row.policy.policy is not DraftLengthPolicy.COST:
            continue

        def affordable(row: RowPlan = row) -> bool:
            read = row.read_tokens() if row.read_tokens is not None else 0
            return probe_affordable(row.draft_cost, costs, len(rows), read, row.room)

        lengths[i] = min(row.policy.after_plan(lengths[i], affordable), row.room)
    return lengths
