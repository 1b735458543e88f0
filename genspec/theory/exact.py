"""Exact expected rejections on a Markov-chain pair, float64, pure NumPy (docs/theory.md).

Reminder: p = DRAFT = ``draft``, q = TARGET = ``target``. All functions take a
:class:`~genspec.theory.chains.ChainPair` (``initial [V]``, ``draft [T, V, V]``, ``target [T, V, V]``).

- :func:`expected_rejections_sd`            Theorem 1 (standard speculative decoding).
- :func:`expected_rejections`               M drafts per round, variant ``batch`` (Algorithm 4) or
                                            ``multidraft`` (token tree), by dynamic programming.
- :func:`expected_rejections_theorem3`      Theorem 3's closed formula (f recursion, f(empty) = 1).
- :func:`expected_rejections_limit`         Proposition 1: the M -> infinity limit.
- :func:`single_step_improvement`           TV(q, p) - prod_{m<=M} TV(q^m, p) and its closed forms.

The acceptance rule itself (keep probability min{1, q/p}, residual norm([q - p]_+)) is not written
here: :func:`keep_probability`, :func:`accepted_mass` and :func:`residual_law` evaluate the engine's
:func:`genspec.acceptance.acceptance_probability` / :func:`genspec.acceptance.residual_distribution`
on float64 arrays, so the exact laws below are the laws of the code that generates text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from genspec.acceptance import acceptance_probability, residual_distribution
from genspec.errors import ConfigError
from genspec.theory.budget import Cost, check
from genspec.theory.chains import ChainPair

VARIANTS = ("batch", "multidraft")

# the residual recursion q^{j+1} = norm([q^j - p]+) reaches a fixed point after finitely many stages
# (docs/theory.md, Prop. 1); near-ties in q^j/p can need many stages, hence the generous cap.
_FIXED_POINT_MAX_STAGES = 100_000
_FIXED_POINT_ATOL = 1e-14

# costs, measured (the manual's Theory toolkit page): a verifier stage (one Python iteration over [V, V]
# arrays) takes a fixed time plus a time per V^2 entry and keeps bytes per M V^2; the multi-draft DP's binomial
# tables [M, V, V, M] take a time per entry per position and bytes per M^2 V^2 at their peak
_STAGE_SECONDS, _STAGE_SECONDS_PER_ENTRY, _STAGE_BYTES_PER_ENTRY = 2e-4, 1e-7, 18
_BINOMIAL_SECONDS_PER_ENTRY, _BINOMIAL_BYTES_PER_ENTRY = 1.2e-7, 42


# ---------------------------------------------------------------------------------------------
# distributions


def total_variation(a, b):
    """TV(a, b) = 1/2 sum_x |a(x) - b(x)| over the last axis: ``[..., V] -> [...]`` (arrays or lists; two
    torch tensors give a tensor)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return 0.5 * (a - b).abs().sum(-1)
    return 0.5 * np.abs(np.asarray(a) - np.asarray(b)).sum(axis=-1)


def positive_part(values: np.ndarray) -> np.ndarray:
    """[v]_+ elementwise."""
    return np.maximum(values, 0.0)


def normalize(values: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """norm(v) = v / sum v over the last axis; rows that sum to 0 get ``fallback``'s row instead
    (a zero residual is only reached with probability 0, so any law will do there)."""
    totals = values.sum(axis=-1, keepdims=True)
    safe = np.where(totals > 0, totals, 1.0)
    return np.where(totals > 0, values / safe, fallback)


# ---------------------------------------------------------------------------------------------
# the acceptance rule, evaluated by genspec.acceptance (the engine's code) on float64 arrays


def _tensor(values) -> torch.Tensor:
    """float64 array -> tensor sharing its memory (copied only if read-only, e.g. a ChainPair's)."""
    array = np.ascontiguousarray(values, dtype=np.float64)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def keep_probability(target_probs, draft_probs, epsilon: float = 0.0) -> np.ndarray:
    """b(y) = min{1, (q(y) + eps) / p(y)} elementwise (eps = 0: the lossless rule), computed by
    :func:`genspec.acceptance.acceptance_probability`. Where p(y) = 0 it is 1 if q(y) + eps > 0, else 0."""
    return acceptance_probability(_tensor(target_probs), _tensor(draft_probs), epsilon).numpy()


def accepted_mass(target_probs, draft_probs) -> np.ndarray:
    """p(y) b(y) = min{p(y), q(y)}: probability that the standard rule drafts y and keeps it."""
    draft = np.asarray(draft_probs, dtype=np.float64)
    return draft * keep_probability(target_probs, draft)


def residual_law(target_probs, draft_probs, residual: str = "opt") -> np.ndarray:
    """The law drawn from after a rejection, over the last axis, computed by
    :func:`genspec.acceptance.residual_distribution`: "opt" = norm([q - p]_+) (q where [q - p]_+ is
    all zero), "uno" = q."""
    return residual_distribution(_tensor(target_probs), _tensor(draft_probs), residual).numpy()


# ---------------------------------------------------------------------------------------------
# the recursive residual verifier (docs/theory.md, "Batch speculative decoding")


@dataclass
class VerifierStages:
    """Exact outcome law of the recursive residual verifier with K candidates i.i.d. from p.

    Rows are states (``S`` of them, e.g. all V states of one position).

    - ``accepted[j]``   ``[S, V]``  probability that stage j+1 accepts token y
                                    (= prod_{i<=j} r_i * min{p(y), q^{j+1}(y)}), j = 0..K-1;
    - ``all_rejected[j]`` ``[S]``   probability that the first j stages all reject (= prod_{i<=j} r_i), j = 0..K;
    - ``residual[j]``   ``[S, V]``  q^{j+1}, the target law after j rejections (residual[0] = q), j = 0..K;
    - ``stage_rejection[j]`` ``[S]`` r_{j+1} = TV(q^{j+1}, p), j = 0..K-1.
    """

    accepted: np.ndarray  # [K, S, V]
    all_rejected: np.ndarray  # [K + 1, S]
    residual: np.ndarray  # [K + 1, S, V]
    stage_rejection: np.ndarray  # [K, S]

    @property
    def num_stages(self) -> int:
        return self.accepted.shape[0]

    def output_law(self) -> np.ndarray:
        """``[S, V]``: law of the emitted token; equals q exactly (the verifier is lossless)."""
        return self.accepted.sum(axis=0) + self.all_rejected[-1][:, None] * self.residual[-1]


def residual_step(target_law: np.ndarray, draft_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One verifier stage against the current law q^j: ``[S, V]`` inputs.

    Returns (acceptance mass p b = min{p, q^j} ``[S, V]``, rejection probability
    r_j = sum_y p(y) (1 - b(y)) = TV(q^j, p) ``[S]``, next law q^{j+1} = norm([q^j - p]_+) ``[S, V]``),
    with b and the residual from the shared rule (:func:`accepted_mass`, :func:`residual_law`).
    """
    accept = accepted_mass(target_law, draft_probs)
    rejection = (draft_probs - accept).sum(axis=-1)  # p b <= p elementwise, so r_j >= 0
    return accept, rejection, residual_law(target_law, draft_probs)


def verifier_stages(target_probs: np.ndarray, draft_probs: np.ndarray, num_stages: int) -> VerifierStages:
    """Run the recursive residual verifier's exact law for ``num_stages`` candidates.

    ``target_probs``, ``draft_probs``: ``[S, V]`` (one row per state) or ``[V]``.
    """
    target_probs = np.atleast_2d(np.asarray(target_probs, dtype=np.float64))
    draft_probs = np.atleast_2d(np.asarray(draft_probs, dtype=np.float64))
    states, vocab = target_probs.shape
    accepted = np.empty((num_stages, states, vocab))
    all_rejected = np.empty((num_stages + 1, states))
    residual = np.empty((num_stages + 1, states, vocab))
    stage_rejection = np.empty((num_stages, states))
    all_rejected[0] = 1.0
    residual[0] = target_probs
    for j in range(num_stages):
        accept, rejection, next_law = residual_step(residual[j], draft_probs)
        accepted[j] = all_rejected[j][:, None] * accept
        stage_rejection[j] = rejection
        all_rejected[j + 1] = all_rejected[j] * rejection
        residual[j + 1] = next_law
    return VerifierStages(accepted, all_rejected, residual, stage_rejection)


@dataclass
class VerifierOutcome:
    """Totals of the verifier: ``accepted [S, V]`` (summed over stages), ``rejected [S]``
    (all stages reject), ``residual [S, V]`` (law of the token drawn after that)."""

    accepted: np.ndarray
    rejected: np.ndarray
    residual: np.ndarray


def verifier_outcome(target_probs: np.ndarray, draft_probs: np.ndarray, num_stages) -> VerifierOutcome:
    """Totals of the verifier with ``num_stages`` candidates; ``math.inf`` gives the M -> infinity
    limit (Prop. 1): iterate the residual to its fixed point and sum the geometric tail exactly."""
    if math.isinf(num_stages):
        return _limit_outcome(target_probs, draft_probs)
    stages = verifier_stages(target_probs, draft_probs, int(num_stages))
    return VerifierOutcome(stages.accepted.sum(axis=0), stages.all_rejected[-1], stages.residual[-1])


def _limit_outcome(target_probs: np.ndarray, draft_probs: np.ndarray) -> VerifierOutcome:
    """Infinitely many candidates.

    A fixed point q* of q -> norm([q - p]_+) is p restricted to a set S and renormalised, with
    r* = 1 - p(S) (or any law outside p's support, r* = 1). Once there, every further stage accepts
    min{p, q*} = p 1_S = (1 - r*) q*, so the remaining stages together accept all the remaining mass,
    distributed as q*: nothing is rejected in the limit unless r* = 1.
    """
    law = np.atleast_2d(np.asarray(target_probs, dtype=np.float64)).copy()
    draft_probs = np.atleast_2d(np.asarray(draft_probs, dtype=np.float64))
    accepted = np.zeros_like(law)
    reach = np.ones(law.shape[0])  # probability that all stages so far rejected
    for _ in range(_FIXED_POINT_MAX_STAGES):
        accept, rejection, next_law = residual_step(law, draft_probs)
        # r* = 1 is tested as "no acceptance mass at all" (exact zeros), not as rejection >= 1, which
        # rounding can miss
        never_accepted = accept.sum(axis=-1) == 0
        settled = np.all(np.abs(next_law - law) <= _FIXED_POINT_ATOL, axis=-1) | never_accepted | (reach == 0)
        if settled.all():
            break
        moving = ~settled
        accepted[moving] += reach[moving, None] * accept[moving]
        reach[moving] *= rejection[moving]
        law[moving] = next_law[moving]
    else:  # pragma: no cover - needs ties in q/p far below float resolution
        raise ArithmeticError("residual recursion did not reach a fixed point")
    # geometric tail at the fixed point: all of the remaining mass is accepted (if r* < 1)
    accept, _, _ = residual_step(law, draft_probs)
    absorbed = accept.sum(axis=-1) > 0
    accepted[absorbed] += reach[absorbed, None] * law[absorbed]
    rejected = np.where(absorbed, 0.0, reach)
    return VerifierOutcome(accepted, rejected, law)


# ---------------------------------------------------------------------------------------------
# Theorem 1: standard speculative decoding


def expected_rejections_sd(chain: ChainPair) -> float:
    """Theorem 1: E[N_rej] = sum_n E_{x_{n-1} ~ target}[TV(p_n, q_n)].

    ``m = initial; for n = 0..T-1: add sum_i m(i) TV(draft[n][i], target[n][i]); m <- m target[n]``.
    """
    marginal = chain.initial
    total = 0.0
    for n in range(chain.horizon):
        total += float(marginal @ total_variation(chain.draft[n], chain.target[n]))
        marginal = marginal @ chain.target[n]
    return total


# ---------------------------------------------------------------------------------------------
# M drafts per round: exact dynamic programs


def rejections_cost(vocab_size: int, horizon: int, batch, variant: str = "batch") -> Cost:
    """Estimated cost of :func:`expected_rejections` (and :func:`expected_rejections_theorem3` for
    ``batch``): T positions of an M-stage verifier on [V, V] arrays, plus for ``multidraft`` the
    binomial tables of M^2 V^2 entries per position. The M -> infinity limit costs what the residual's
    fixed point needs, whatever the arguments: 0 here."""
    if math.isinf(batch):
        return Cost()
    entries = vocab_size ** 2
    cost = Cost(_STAGE_BYTES_PER_ENTRY * batch * entries,
                horizon * batch * (_STAGE_SECONDS + _STAGE_SECONDS_PER_ENTRY * entries))
    if variant == "multidraft":
        cost = Cost(max(cost.bytes, _BINOMIAL_BYTES_PER_ENTRY * batch ** 2 * entries),
                    cost.seconds + _BINOMIAL_SECONDS_PER_ENTRY * horizon * batch ** 2 * entries)
    return cost


def _check_rejections_cost(chain: ChainPair, batch, variant: str) -> None:
    check(rejections_cost(chain.vocab_size, chain.horizon, batch, variant),
          f"exact E[N_rej] with M = {batch} ({variant}) on V = {chain.vocab_size}, T = {chain.horizon}")


def expected_rejections(chain: ChainPair, batch: int = 1, variant: str = "batch") -> float:
    """Exact E[N_rej] with ``batch`` = M drafts per round; ``variant`` is "batch" or "multidraft".

    ``batch`` may be ``math.inf`` for the Prop. 1 limit. M = 1 is standard SD in both variants.
    Refused (:class:`ConfigError`) above the theory toolkit's limits (:mod:`genspec.theory.budget`).
    """
    _check_batch(batch)
    _check_rejections_cost(chain, batch, variant)
    if variant == "batch":
        return _batch_dp(chain, batch)
    if variant == "multidraft":
        if math.isinf(batch):
            return _multidraft_limit(chain)
        return _multidraft_dp(chain, int(batch))
    raise ConfigError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def expected_rejections_limit(chain: ChainPair, variant: str = "batch") -> float:
    """Proposition 1: lim_{M -> inf} E[N_rej] (strictly positive for ``batch`` as soon as some
    non-first position of a round can reject; generically 0 for ``multidraft``, whose live drafts
    also grow without bound)."""
    return expected_rejections(chain, math.inf, variant)


def rejections_curve(chain: ChainPair, batches, variant: str = "batch") -> np.ndarray:
    """E[N_rej] for each M in ``batches``: ``[len(batches)]``."""
    return np.array([expected_rejections(chain, m, variant) for m in batches])


def _check_batch(batch) -> None:
    if not (math.isinf(batch) or (float(batch).is_integer() and batch >= 1)):
        raise ConfigError(f"batch (drafts per round) must be an integer >= 1, got {batch}")


def _batch_dp(chain: ChainPair, batch) -> float:
    """Variant ``batch`` (Algorithm 4). Masses per state at each position:

    - fresh(x):  a round starts here, M new drafts are verified by the recursive residual verifier;
    - single(x): the one kept draft continues and is verified by plain SD.
    """
    fresh = chain.initial.copy()
    single = np.zeros_like(fresh)
    total = 0.0
    for n in range(chain.horizon):
        rejected, fresh, single = _batch_dp_step(fresh, single, chain.draft[n], chain.target[n], batch)
        total += rejected
    return total


def _batch_dp_step(fresh: np.ndarray, single: np.ndarray, draft: np.ndarray, target: np.ndarray,
                   batch) -> tuple[float, np.ndarray, np.ndarray]:
    """One position of the batch DP: (expected rejections there, next fresh, next single).

    A round start runs the M-stage verifier; a single kept draft runs the same verifier with one
    stage (plain SD: accepted mass min{p, q}, rejection TV(p, q), then the residual)."""
    round_start = verifier_outcome(target, draft, batch)
    sd_accept, sd_rejection, sd_residual = residual_step(target, draft)
    rejected = float(fresh @ round_start.rejected) + float(single @ sd_rejection)
    next_single = fresh @ round_start.accepted + single @ sd_accept
    next_fresh = (fresh * round_start.rejected) @ round_start.residual + (single * sd_rejection) @ sd_residual
    return rejected, next_fresh, next_single


def batch_dp_masses(chain: ChainPair, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch DP's masses per position: (fresh ``[T, V]``, single ``[T, V]``) at positions
    1..T (row n = the state x_n from which token n+1 is verified). fresh + single = target marginal."""
    fresh = chain.initial.copy()
    single = np.zeros_like(fresh)
    fresh_rows, single_rows = [], []
    for n in range(chain.horizon):
        fresh_rows.append(fresh)
        single_rows.append(single)
        _, fresh, single = _batch_dp_step(fresh, single, chain.draft[n], chain.target[n], batch)
    return np.array(fresh_rows), np.array(single_rows)


def expected_rejections_theorem3(chain: ChainPair, batch: int) -> float:
    """Theorem 3's closed formula (variant ``batch``):

    E[N_rej] = sum_n E_q[TV(p_n, q_n)] - sum_n E_f[TV(q_n, p_n) - prod_{m<=M} TV(q^m_n, p_n)],

    f(x_{1:n}) = h(x_n|x_{n-1}) [q(x_{1:n-1}) - f(x_{1:n-1})] + (prod_m r_m) q^{M+1}(x_n|x_{n-1}) f(x_{1:n-1}),
    h = [q - p]_+ unnormalised and f(empty prefix) = 1. Because the chains are Markov, f is summed
    over prefixes by their last state: ``f_marginal[x]`` = sum over x_{1:n-1} ending in x.
    """
    _check_batch(batch)
    _check_rejections_cost(chain, batch, "batch")
    marginal = chain.initial.copy()  # q(x_{1:n-1}) summed by last state
    f_marginal = chain.initial.copy()  # f(empty) = 1, spread over the prompt token x_0
    first_term = 0.0
    correction = 0.0
    for n in range(chain.horizon):
        draft, target = chain.draft[n], chain.target[n]
        tv = total_variation(draft, target)
        stages = verifier_stages(target, draft, int(batch))
        all_rejected = stages.all_rejected[-1]  # prod_{m<=M} r_m = prod_m TV(q^m, p)
        first_term += float(marginal @ tv)
        correction += float(f_marginal @ (tv - all_rejected))
        h = positive_part(target - draft)
        f_marginal = (marginal - f_marginal) @ h + (f_marginal * all_rejected) @ stages.residual[-1]
        marginal = marginal @ target
    return first_term - correction


def _multidraft_dp(chain: ChainPair, batch: int) -> float:
    """Variant ``multidraft``: exact DP over (state x, K live drafts), K = 1..M.

    With K live drafts the verifier runs K stages. Acceptance of y at stage j leaves
    K' = 1 + Binomial(K - j, p(y)) live drafts (the untried drafts that hold y); if all K reject,
    N_rej += 1 and the next position starts a round with M fresh drafts.

    ``live[k - 1, x]`` is the probability of being at state x with k live drafts.
    """
    vocab = chain.vocab_size
    live = np.zeros((batch, vocab))
    live[batch - 1] = chain.initial
    total = 0.0
    for n in range(chain.horizon):
        draft, target = chain.draft[n], chain.target[n]
        stages = verifier_stages(target, draft, batch)
        binomial = _untried_holding_table(draft, batch)  # [M, V, V, M]
        next_live = np.zeros_like(live)
        for k in range(1, batch + 1):
            rejected = live[k - 1] * stages.all_rejected[k]  # [V]
            total += float(rejected.sum())
            next_live[batch - 1] += rejected @ stages.residual[k]
        next_live += _accepted_live_counts(live, stages.accepted, binomial)
        live = next_live
    return total


def _untried_holding_table(draft: np.ndarray, batch: int) -> np.ndarray:
    """``[M, V, V, M]``: entry [u, x, y, i] = P(Binomial(u, p(y|x)) = i), u untried drafts."""
    untried = np.arange(batch)[:, None, None, None]
    holding = np.arange(batch)[None, None, None, :]
    from scipy import stats  # here, not at import: the engine imports the theory's formulas, not scipy

    return stats.binom.pmf(holding, untried, draft[None, :, :, None])


def _accepted_live_counts(live: np.ndarray, accepted: np.ndarray, binomial: np.ndarray) -> np.ndarray:
    """Mass moved to (y, K') by acceptances: ``[M, V]`` indexed [K' - 1, y].

    sum over K, stage j <= K and states x of live[K, x] * accepted_j(x, y) * P(Bin(K - j, p(y|x)) = K' - 1).
    Grouping by u = K - j (untried drafts) makes it O(V^2 M^2) per position instead of O(V^2 M^3).
    """
    batch = live.shape[0]
    out = np.zeros((batch, live.shape[1]))
    for untried in range(batch):
        stages_used = batch - untried  # j = 1..M-u, K = j + u
        # weight[x, y] = sum_j live[j + u, x] * accepted_j(x, y)
        weight = np.einsum("jx,jxy->xy", live[untried:untried + stages_used], accepted[:stages_used])
        out += np.einsum("xy,xyi->iy", weight, binomial[untried])
    return out


def _multidraft_limit(chain: ChainPair) -> float:
    """M -> infinity for ``multidraft``: after an acceptance, 1 + Binomial(inf, p(y)) drafts stay live,
    so every position is verified by infinitely many candidates and rejects with probability
    lim prod_j r_j (0 unless the residual's fixed point lies outside the draft's support)."""
    marginal = chain.initial
    total = 0.0
    for n in range(chain.horizon):
        outcome = verifier_outcome(chain.target[n], chain.draft[n], math.inf)
        total += float(marginal @ outcome.rejected)
        marginal = marginal @ chain.target[n]
    return total


# ---------------------------------------------------------------------------------------------
# single-step batch improvement


def single_step_improvement(draft_probs: np.ndarray, target_probs: np.ndarray, batch: int) -> float:
    """TV(q, p) - prod_{m<=M} TV(q^m, p): rejection probability saved at a round's first position."""
    stages = verifier_stages(target_probs, draft_probs, batch)
    return float(stages.stage_rejection[0, 0] - stages.all_rejected[-1, 0])


def uniform_improvement(ratio: float, batch: int) -> float:
    """Closed form: draft uniform on V tokens, target uniform on V / ratio of them (ratio >= 1):
    (1 - 1/r) - (1 - 1/r)^M."""
    miss = 1.0 - 1.0 / ratio
    return miss - miss ** batch


def bernoulli_improvement(draft_one: float, target_one: float, batch: int) -> float:
    """Closed form: draft p(token 1) = u, target q(token 1) = v:
    |u - v| (1 - u^{M-1}) if v <= u, else |u - v| (1 - (1 - u)^{M-1}).
    The base is the draft's mass on the token the target under-weights."""
    u, v = draft_one, target_one
    base = u if v <= u else 1.0 - u
    return abs(u - v) * (1.0 - base ** (batch - 1))


def uniform_pair(vocab_size: int, ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """(draft uniform on V, target uniform on the first V / ratio tokens); V must be divisible by ratio."""
    if vocab_size % ratio:
        raise ConfigError(f"vocab {vocab_size} is not a multiple of ratio {ratio}")
    draft = np.full(vocab_size, 1.0 / vocab_size)
    target = np.zeros(vocab_size)
    target[: vocab_size // ratio] = ratio / vocab_size
    return draft, target


def bernoulli_pair(draft_one: float, target_one: float) -> tuple[np.ndarray, np.ndarray]:
    """(draft, target) over tokens {0, 1} with mass u, v on token 1."""
    return np.array([1.0 - draft_one, draft_one]), np.array([1.0 - target_one, target_one])
