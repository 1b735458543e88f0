"""Monte-Carlo simulation of speculative decoding on a Markov-chain pair, vectorised over runs.

The simulators run the algorithm itself: they draw the draft tokens from the draft chain and verify
them with :func:`genspec.acceptance.verify_multidraft`, the same acceptance code the engine uses on
real models (docs/theory.md, "How it is tested": one acceptance implementation serves the theory
simulators and the engine). With one candidate that function is the single-position SD rule; with K candidates it is
the recursive residual verifier; a candidate mask marks each run's live drafts.

Shapes: ``N`` runs, ``M`` drafts per round, ``V`` symbols, horizon ``T``. Tensors are torch float64
(``torch.from_numpy`` of the chain) and all randomness comes from one seeded ``torch.Generator``.

Drafts are drawn lazily, one position at a time. That has the law of drawing whole draft sequences
up front (Algorithm 4, step 1): a draft's next token depends only on its own current token (Markov),
and every live draft's current token equals the current output token (it agreed with the accepted
prefix), so the live drafts' next tokens are i.i.d. from p(. | x_n). It keeps memory at O(N M).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from genspec.acceptance import STANDARD, Rule, verify_multidraft
from genspec.randomness import Noise
from genspec.errors import ConfigError
from genspec.theory.budget import Cost, check
from genspec.theory.chains import ChainPair
from genspec.theory.exact import VARIANTS

DEFAULT_CHUNK = 100_000  # runs simulated together; bounds memory at a few hundred MB for V <= 100
# costs per run and position, measured (the manual's Theory toolkit page): seconds a + b V + c M + d V M
# (``_SIM_SECONDS``); memory: the sequences (8 bytes per token, kept twice while concatenated) and
# about 7 [chunk, V] float64 tensors
_SIM_SECONDS = (2e-7, 1.5e-7, 1.5e-7, 1.5e-8)
_SIM_ROW_TENSORS = 7


@dataclass
class Simulation:
    """Result of :func:`simulate`.

    ``rejections [N]`` N_rej per run; ``sequences [N, T + 1]`` the generated tokens x_0..x_T (x_0 = prompt).
    """

    rejections: np.ndarray
    sequences: np.ndarray

    @property
    def num_runs(self) -> int:
        return int(self.rejections.shape[0])

    @property
    def mean(self) -> float:
        return float(self.rejections.mean())

    @property
    def stderr(self) -> float:
        """Standard error of the mean, std / sqrt(N) (0 for a single run)."""
        if self.num_runs < 2:
            return 0.0
        return float(self.rejections.std(ddof=1) / math.sqrt(self.num_runs))


def simulation_cost(vocab_size: int, horizon: int, num_runs: int, batch: int = 1,
                    chunk_size: int = DEFAULT_CHUNK) -> Cost:
    """Estimated cost of :func:`simulate`: N runs x T positions, each drawing M candidates over V symbols."""
    base, per_symbol, per_draft, per_pair = _SIM_SECONDS
    seconds = num_runs * horizon * (base + per_symbol * vocab_size + per_draft * batch + per_pair * vocab_size * batch)
    rows = min(num_runs, chunk_size)
    return Cost(16 * num_runs * (horizon + 1) + 8 * rows * (_SIM_ROW_TENSORS * vocab_size + batch), seconds)


def simulate(chain: ChainPair, num_runs: int, batch: int = 1, variant: str = "batch", seed: int = 0,
             rule: Rule = STANDARD, chunk_size: int = DEFAULT_CHUNK,
             progress: Callable[[int], None] | None = None) -> Simulation:
    """Simulate ``num_runs`` independent generations of T tokens with M = ``batch`` drafts per round.

    ``variant``: "batch" (Algorithm 4: after an acceptance only the accepted draft continues) or
    "multidraft" (every draft agreeing with the accepted prefix stays live). ``batch = 1`` is standard
    SD. ``rule``: the standard rule by default (lossless); an over-acceptance ``epsilon > 0`` is lossy
    (Theorem 2), as is the UNO residual at eps = 0; kind "typical" is Medusa's typical acceptance.

    ``progress(k)`` is called after every simulated position with k = number of runs advanced.
    Refused (:class:`ConfigError`) above the theory toolkit's limits (:mod:`genspec.theory.budget`).
    """
    if num_runs < 1:
        raise ConfigError(f"number of simulated runs must be >= 1, got {num_runs}")
    if batch < 1 or int(batch) != batch:
        raise ConfigError(f"batch (drafts per round) must be an integer >= 1, got {batch}")
    if variant not in VARIANTS:
        raise ConfigError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    check(simulation_cost(chain.vocab_size, chain.horizon, num_runs, int(batch), chunk_size),
          f"simulating {num_runs} runs with M = {batch} on V = {chain.vocab_size}, T = {chain.horizon}")
    generator = torch.Generator().manual_seed(int(seed))
    tensors = _ChainTensors.from_chain(chain)
    rejections, sequences = [], []
    with single_thread():
        for start in range(0, num_runs, chunk_size):
            runs = min(chunk_size, num_runs - start)
            chunk_rejections, chunk_sequences = _simulate_chunk(tensors, runs, int(batch), variant, rule, generator,
                                                                progress)
            rejections.append(chunk_rejections)
            sequences.append(chunk_sequences)
    return Simulation(torch.cat(rejections).numpy(), torch.cat(sequences).numpy())


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread, then restore the setting. The simulator's tensors are many short rows
    (V values each); intra-op threads buy little there and, on a busy machine with few cores, cost a lot
    (the manual's Theory toolkit page)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class _ChainTensors:
    initial: torch.Tensor  # [V]
    draft: torch.Tensor  # [T, V, V]
    target: torch.Tensor  # [T, V, V]

    @classmethod
    def from_chain(cls, chain: ChainPair) -> "_ChainTensors":
        def as_tensor(array):
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64).copy())

        return cls(as_tensor(chain.initial), as_tensor(chain.draft), as_tensor(chain.target))


def _simulate_chunk(chain: _ChainTensors, runs: int, batch: int, variant: str, rule: Rule,
                    generator: torch.Generator, progress) -> tuple[torch.Tensor, torch.Tensor]:
    horizon = chain.draft.shape[0]
    sequences = torch.empty((runs, horizon + 1), dtype=torch.long)
    rejections = torch.zeros(runs, dtype=torch.long)
    state = sample_rows(chain.initial.expand(runs, -1), 1, generator).squeeze(1)  # x_0 ~ initial
    live = torch.full((runs,), batch, dtype=torch.long)  # the first position starts a round
    sequences[:, 0] = state
    for n in range(horizon):
        draft_rows = chain.draft[n][state]  # [N, V] p(. | x_n)
        target_rows = chain.target[n][state]  # [N, V] q(. | x_n)
        candidates = draw_candidates(draft_rows, batch, generator)  # [N, M], columns >= live unused
        accepted_index, token = verify_position(candidates, target_rows, draft_rows, live, rule, generator)
        rejections += (accepted_index < 0).long()
        live = next_live_drafts(candidates, accepted_index, token, live, batch, variant)
        state = token
        sequences[:, n + 1] = state
        if progress is not None:
            progress(runs)
    return rejections, sequences


def verify_position(candidates: torch.Tensor, target_rows: torch.Tensor, draft_rows: torch.Tensor,
                    live: torch.Tensor, rule: Rule, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every run's live candidates at one position with the shared acceptance code.

    Returns (accepted candidate index or -1 if all were rejected ``[N]``, emitted token ``[N]``).
    Runs with a single live draft (most of them after the first position of a round) are verified
    separately with one candidate column: same rule, but the M-stage loop only runs on the runs
    that need it, which roughly halves the time at M = 4.
    """
    accepted_index = torch.empty_like(live)
    token = torch.empty_like(live)
    single = live == 1
    groups = [(single, 1)] if candidates.shape[1] == 1 else [(single, 1), (~single, candidates.shape[1])]
    for rows, columns in groups:
        if not bool(rows.any()):
            continue
        mask = torch.arange(columns) < live[rows].unsqueeze(1)  # each run's live candidates
        verdict = verify_multidraft(candidates[rows, :columns], target_rows[rows], draft_rows[rows], mask, rule,
                                    Noise(generator=generator))
        accepted_index[rows] = verdict.accepted_index
        token[rows] = verdict.token
    return accepted_index, token


def sample_rows(probs: torch.Tensor, num_samples: int, generator: torch.Generator) -> torch.Tensor:
    """``num_samples`` i.i.d. draws from each row of ``probs`` ``[N, V]`` -> ``[N, num_samples]``.

    Inverse-CDF sampling (faster than torch.multinomial for many short rows). Scaling the uniforms by
    the row total keeps every draw strictly below the last cumulative value, so a token with zero
    probability is never drawn, even with rounding in the cumulative sums.
    """
    cumulative = probs.cumsum(-1)
    uniforms = torch.rand((probs.shape[0], num_samples), generator=generator, dtype=probs.dtype)
    return torch.searchsorted(cumulative, uniforms * cumulative[:, -1:], right=True)


def draw_candidates(draft_rows: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    """The live drafts' next tokens: ``batch`` i.i.d. draws from p(. | x_n) per run, ``[N, M]``."""
    return sample_rows(draft_rows, batch, generator)


def next_live_drafts(candidates: torch.Tensor, accepted_index: torch.Tensor, token: torch.Tensor,
                     live: torch.Tensor, batch: int, variant: str) -> torch.Tensor:
    """Number of drafts that continue to the next position, ``[N]``.

    After a rejection (``accepted_index < 0``) the next position starts a round with M fresh drafts.
    After an acceptance, ``batch`` keeps only the accepted draft; ``multidraft`` keeps every live draft
    whose token equals the emitted one (the accepted draft plus untried ones holding the same token;
    a rejected candidate cannot hold it, its residual mass is 0).
    """
    fresh = torch.full_like(live, batch)
    if variant == "batch":
        return torch.where(accepted_index < 0, fresh, torch.ones_like(live))
    columns = torch.arange(candidates.shape[1])
    agreeing = (candidates == token.unsqueeze(1)) & (columns < live.unsqueeze(1))
    agreeing &= columns != accepted_index.unsqueeze(1)
    return torch.where(accepted_index < 0, fresh, 1 + agreeing.sum(1))


# ---------------------------------------------------------------------------------------------
# a single rejection-based step with an arbitrary rule (Theorems 2, 4, 5)


def sample_rejection_rule(draft_probs: np.ndarray, keep_probs: np.ndarray, resample_probs: np.ndarray,
                          num_runs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Run the generic rejection-based rule of Theorems 2/4 ``num_runs`` times on one distribution pair:
    draw y ~ p (``draft_probs [V]``), keep it with probability b(y) (``keep_probs [V]``), otherwise
    emit a draw from P (``resample_probs [V]``).

    Returns (emitted tokens ``[N]``, rejected flags ``[N]``). Its output law is b p + R P.
    For the lossless and over-acceptance rules, build ``keep_probs`` with
    :func:`genspec.acceptance.acceptance_probability` and ``resample_probs`` with
    :func:`genspec.acceptance.residual_distribution`.
    """
    generator = torch.Generator().manual_seed(int(seed))

    def rows(values):
        return torch.as_tensor(np.asarray(values, dtype=np.float64)).expand(num_runs, -1)

    tokens, rejected = _rule_step(rows(draft_probs), rows(keep_probs), rows(resample_probs), generator)
    return tokens.numpy(), rejected.numpy()


def simulate_rule(chain: ChainPair, keep_probs: np.ndarray, resample_probs: np.ndarray, num_runs: int,
                  seed: int = 0) -> Simulation:
    """The generic rejection-based rule along a Markov-chain pair: at position n in state x, draw
    y ~ p_n(. | x), keep it with probability ``keep_probs[n, x, y]``, otherwise draw from
    ``resample_probs[n, x]`` (both ``[T, V, V]``); a rejection counts one. Theorem 2 compares rules
    of this form (``genspec theory optimality``)."""
    if num_runs < 1:
        raise ConfigError(f"number of simulated runs must be >= 1, got {num_runs}")
    generator = torch.Generator().manual_seed(int(seed))
    tensors = _ChainTensors.from_chain(chain)
    keep = torch.as_tensor(np.asarray(keep_probs, dtype=np.float64))
    resample = torch.as_tensor(np.asarray(resample_probs, dtype=np.float64))
    with single_thread():
        state = sample_rows(tensors.initial.expand(num_runs, -1), 1, generator).squeeze(1)
        sequences = torch.empty((num_runs, chain.horizon + 1), dtype=torch.long)
        sequences[:, 0] = state
        rejections = torch.zeros(num_runs, dtype=torch.long)
        for n in range(chain.horizon):
            state, rejected = _rule_step(tensors.draft[n][state], keep[n][state], resample[n][state], generator)
            rejections += rejected.long()
            sequences[:, n + 1] = state
    return Simulation(rejections.numpy(), sequences.numpy())


def _rule_step(draft_rows: torch.Tensor, keep_rows: torch.Tensor, resample_rows: torch.Tensor,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of the generic rule for every run (rows ``[N, V]``): (tokens ``[N]``, rejected ``[N]``)."""
    drafted = sample_rows(draft_rows, 1, generator).squeeze(1)
    kept = torch.rand(len(drafted), generator=generator, dtype=torch.float64) < keep_rows.gather(
        1, drafted.unsqueeze(1)).squeeze(1)
    redrawn = sample_rows(resample_rows, 1, generator).squeeze(1)
    return torch.where(kept, drafted, redrawn), ~kept
