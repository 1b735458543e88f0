"""How many tokens to draft at each step, per row.

- ``fixed``: always k.
- ``heuristic``: Hugging Face's schedule: +2 after a fully accepted draft, -1 otherwise (1 <= k <= k_max).
- ``cost``: pick the k that maximises expected tokens per second (Leviathan et al.), from a running
  estimate of the per-token acceptance rate alpha and the measured costs of drafting and of verifying
  a block of k + 1 tokens: E[tokens](k) = (1 - alpha^(k+1)) / (1 - alpha), time(k) = k * draft_cost +
  verify_cost(k + 1). k = 0 (plain decoding) is allowed, so speculation switches itself off where
  it does not pay: a k > 0 must promise at least ``MARGIN`` (10%) more tokens per second than plain
  decoding, because the estimate ignores engine overhead and timing noise (without the margin, prompt
  lookup on Spec-Bench's humanities prompts, acceptance 0.16, ran at 0.95x plain). A drafter that costs nothing keeps being scored on what it would have proposed;
  a costly one is probed with a single token after 8, 16, 32, ... idle steps.
"""
from __future__ import annotations

from genspec.errors import ConfigError

POLICIES = ("fixed", "heuristic", "cost")
#: how much faster than plain decoding the cost policy's estimate must be before it drafts at all
MARGIN = 1.1


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by a target call that verifies k drafts with acceptance alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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


class DraftLength:
    """Per-row draft-length policy. ``limit(row)`` before a step, ``update(...)`` after it."""

    def __init__(self, policy: str, k_max: int, batch: int, cost_model: CostModel | None = None,
                 prior_alpha: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9):
        if policy not in POLICIES:
            raise ConfigError(f"unknown draft length policy {policy!r}; choose from: {', '.join(POLICIES)}")
        self.policy = policy
        self.k_max = k_max
        self.current = [k_max] * batch
        self.costs = cost_model or CostModel()
        self.decay = decay
        # discounted counts of tested / accepted draft positions, seeded with a weak prior
        self.tested = [prior_weight] * batch
        self.accepted = [prior_alpha * prior_weight] * batch
        # a drafter switched off is probed with one token now and then, less often each time it fails
        self.idle_steps = [0] * batch
        self.probe_every = [8] * batch

    def alpha(self, row: int) -> float:
        return self.accepted[row] / self.tested[row]

    def limit(self, row: int) -> int:
        if self.policy != "cost":
            return self.current[row]
        best = self._best_k(row)
        if best > 0:
            self.idle_steps[row], self.probe_every[row] = 0, 8
            return best
        self.idle_steps[row] += 1
        if self.idle_steps[row] >= self.probe_every[row]:  # probe: one draft token, to re-estimate alpha
            self.idle_steps[row] = 0
            self.probe_every[row] = min(2 * self.probe_every[row], 256)
            return 1
        return 0

    def _best_k(self, row: int) -> int:
        step = self.costs.verify_cost(1)
        if step is None:  # nothing measured yet: speculate, measurements come with it
            return self.k_max
        draft = self.costs.draft_per_token or 0.0
        alpha = min(self.alpha(row), 0.999)
        best_k, best_rate = 0, MARGIN / step
        for k in range(1, self.k_max + 1):
            cost = self.costs.verify_cost(k + 1) + k * draft
            rate = expected_tokens(alpha, k) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def update(self, row: int, drafted: int, accepted: int) -> None:
        """Record a verified draft of ``drafted`` tokens of which ``accepted`` were kept."""
        if drafted <= 0:
            return
        tested = accepted + (1 if accepted < drafted else 0)  # positions actually put to the test
        self.tested[row] = self.decay * self.tested[row] + tested
        self.accepted[row] = self.decay * self.accepted[row] + accepted
        if self.policy == "heuristic":
            step = 2 if accepted == drafted else -1
            self.current[row] = max(1, min(self.k_max, self.current[row] + step))

    def shadow(self, row: int, proposal: list[int], emitted: list[int]) -> None:
        """Score a free proposal that was not verified against what the target emitted instead."""
        if proposal and emitted:
            self.update(row, 1, int(proposal[0] == emitted[0]))

    def __repr__(self) -> str:
        return f"DraftLength({self.policy}, k_max={self.k_max}, alpha={[round(self.alpha(r), 2) for r in range(len(self.tested))]})"

