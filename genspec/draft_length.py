"""How many tokens to draft at each step, per row.

- ``fixed``: always k.
- ``heuristic``: Hugging Face's schedule: +2 after a fully accepted draft, -1 otherwise (1 <= k <= k_max).
- ``cost``: pick the k that maximises expected tokens per second (Leviathan et al.), from running
  acceptance estimates and the measured costs of drafting and of verifying a block of k + 1 tokens:
  rate(k) = E[tokens](k) / (k * draft_cost + verify_cost(k + 1)). k = 0 (plain decoding) is allowed,
  so speculation switches itself off where it does not pay: a k > 0 must promise at least ``MARGIN``
  (10%) more tokens per second than plain decoding, because the estimate ignores engine overhead and
  timing noise (without the margin, prompt lookup on Spec-Bench's humanities prompts, acceptance 0.16,
  ran at 0.95x plain).

Acceptance is not i.i.d. along a draft: the first token is the hard one (a lookup draft whose first
token is right usually goes on being right). The cost policy therefore keeps two discounted rates,
``first`` (P[draft token 1 accepted]) and ``later`` (P[token i+1 accepted | token i accepted]), with
E[tokens](k) = 1 + first * (1 + later + ... + later^(k-1)).

Evidence: a drafter may say, per row, how strong the evidence behind its proposal is (prompt lookup:
the length of the matched n-gram; a 1-token match is right about 1 time in 5 on Spec-Bench, a 4-token
match 9 times in 10). The policy keeps separate rates per evidence level, so weak proposals are
dropped and strong ones drafted long, in the same request. A drafter that costs nothing proposes
before the policy decides (the decision can use the evidence) and is scored on what it would have
proposed when nothing is verified (a new evidence level starts no higher than what the row's
other levels have shown, so a request where lookups are mostly wrong does not pay to learn each level); a costly one is asked for the policy's k and, when switched off,
probed with a single token after 8, 16, 32, ... idle steps.

Before anything is measured the policy assumes verifying k + 1 tokens costs ``1 + 0.1 k`` plain
steps (near what the embedded model measures on a CPU: 1.12x for 2 tokens, 1.32x for 8), so the
first step of a request drafts a couple of tokens, not k_max blind.
"""
from __future__ import annotations

from genspec.errors import ConfigError
from genspec.theory.leviathan import expected_tokens_per_call

POLICIES = ("fixed", "heuristic", "cost")
#: how much faster than plain decoding the cost policy's estimate must be before it drafts at all
MARGIN = 1.1


class CostModel:
    """Running (exponentially weighted) averages of the verify time per block width and of the draft
    time per drafted token. Widths never measured are estimated from the nearest measured width
    with a mild linear growth prior (verifying costs a bit more per extra token)."""

    def __init__(self, decay: float = 0.8, growth_prior: float = 0.1):
        self.decay = decay
        self.growth_prior = growth_prior
        self.verify: dict[int, float] = {}
        self.draft_per_token: float | None = None

    def observe_verify(self, width: int, seconds: float) -> None:
        old = self.verify.get(width)
        self.verify[width] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        per_token = seconds / tokens
        old = self.draft_per_token
        self.draft_per_token = per_token if old is None else self.decay * old + (1 - self.decay) * per_token

    def verify_cost(self, width: int) -> float | None:
        if width in self.verify:
            return self.verify[width]
        if not self.verify:
            return None
        nearest = min(self.verify, key=lambda w: abs(w - width))
        base = self.verify[nearest] / (1 + self.growth_prior * (nearest - 1))
        return base * (1 + self.growth_prior * (width - 1))

    def relative(self, width: int) -> float:
        """Verify cost of ``width`` tokens in plain steps (the prior when nothing is measured)."""
        step = self.verify_cost(1)
        if step is None:
            return 1 + self.growth_prior * (width - 1)
        return self.verify_cost(width) / step


class Acceptance:
    """Discounted counts of one (row, evidence level): how often draft token 1 was accepted, and how
    often token i + 1 was accepted once token i had been."""

    def __init__(self, prior_first: float, prior_later: float, prior_weight: float, decay: float):
        self.decay = decay
        self.first = [prior_first * prior_weight, prior_weight]  # accepted, tested
        self.later = [prior_later * prior_weight, prior_weight]

    @property
    def rate_first(self) -> float:
        return self.first[0] / self.first[1]

    @property
    def rate_later(self) -> float:
        return self.later[0] / self.later[1]

    def record(self, drafted: int, accepted: int) -> None:
        d = self.decay
        self.first = [d * self.first[0] + (accepted > 0), d * self.first[1] + 1]
        if accepted > 0 and drafted > 1:
            tested = accepted - 1 + (1 if accepted < drafted else 0)
            if tested:
                self.later = [d * self.later[0] + accepted - 1, d * self.later[1] + tested]

    def expected_tokens(self, k: int) -> float:
        """Leviathan's expected tokens per target call with these two rates (the theory's formula)."""
        return expected_tokens_per_call(self.rate_later, k, first_alpha=self.rate_first)


class DraftLength:
    """One request's draft-length policy: ``limit(evidence)`` before verifying, ``update(...)`` after.

    ``costs`` is the :class:`CostModel` of the request's drafter, shared with the other requests that
    use it (verify and draft costs are the machine's, acceptance is the request's own)."""

    def __init__(self, policy: str, k_max: int, cost_model: CostModel | None = None,
                 prior_alpha: float = 0.5, prior_later: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.9):
        if policy not in POLICIES:
            raise ConfigError(f"unknown draft length policy {policy!r}; choose from: {', '.join(POLICIES)}")
        self.policy = policy
        self.k_max = k_max
        self.current = k_max
        self.costs = cost_model or CostModel()
        self._prior = (prior_alpha, prior_later, prior_weight, decay)
        self.acceptance: dict[object, Acceptance] = {}
        # a drafter switched off is probed with one token now and then, less often each time it fails
        self.idle_steps = 0
        self.probe_every = 8

    def estimate(self, evidence=None) -> Acceptance:
        """The acceptance counts for proposals backed by ``evidence`` (None: no evidence). A level seen
        for the first time starts from the global prior, or from the pooled rates over the levels seen
        so far where those are lower (a weak prior: ``prior_weight`` pseudo-counts): pessimism is
        shared, optimism is not."""
        table = self.acceptance
        if evidence not in table:
            prior_first, prior_later, weight, decay = self._prior
            if table:
                seen = list(table.values())
                prior_first = min(prior_first, sum(a.first[0] for a in seen) / sum(a.first[1] for a in seen))
                prior_later = min(prior_later, sum(a.later[0] for a in seen) / sum(a.later[1] for a in seen))
            table[evidence] = Acceptance(prior_first, prior_later, weight, decay)
        return table[evidence]

    def limit(self, evidence=None, probe: bool = True) -> int:
        """Tokens to draft (cost policy: 0 switches speculation off; with ``probe`` a switched-off request
        drafts one token now and then to re-estimate; a free drafter needs no probes, it is scored
        on its unverified proposals)."""
        if self.policy != "cost":
            return self.current
        best = self.best_k(evidence)
        if best > 0:
            self.idle_steps, self.probe_every = 0, 8
            return best
        if not probe:
            return 0
        self.idle_steps += 1
        if self.idle_steps >= self.probe_every:  # probe: one draft token, to re-estimate
            self.idle_steps = 0
            self.probe_every = min(2 * self.probe_every, 256)
            return 1
        return 0

    def best_k(self, evidence=None) -> int:
        """The k with the highest predicted tokens per plain-step time (0 unless it beats MARGIN)."""
        step = self.costs.verify_cost(1)
        draft = (self.costs.draft_per_token or 0.0) / step if step else 0.0
        estimate = self.estimate(evidence)
        best_k, best_rate = 0, MARGIN
        for k in range(1, self.k_max + 1):
            rate = estimate.expected_tokens(k) / (self.costs.relative(k + 1) + k * draft)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def update(self, drafted: int, accepted: int, evidence=None) -> None:
        """Record a verified draft of ``drafted`` tokens of which ``accepted`` were kept."""
        if drafted <= 0:
            return
        self.estimate(evidence).record(drafted, accepted)
        if self.policy == "heuristic":
            step = 2 if accepted == drafted else -1
            self.current = max(1, min(self.k_max, self.current + step))

    def shadow(self, proposal: list[int], emitted: list[int], evidence=None) -> None:
        """Score a free proposal that was not verified against what the target emitted instead."""
        if proposal and emitted:
            self.estimate(evidence).record(1, int(proposal[0] == emitted[0]))

    def __repr__(self) -> str:
        rates = {e: round(a.rate_first, 2) for e, a in self.acceptance.items()}
        return f"DraftLength({self.policy}, k_max={self.k_max}, first-token acceptance={rates})"
