"""Turning logits into the probabilities that are sampled and verified.

Speculative decoding keeps its acceptance high only if the draft and the target distributions are
processed the same way (logit bias, repetition / presence / frequency penalties, temperature, top-k,
top-p) *before* the acceptance rule compares them; the output's law is the target's processed law.
:func:`process_logits` is that one processing function; every model-based drafter calls it for its
draft, and :func:`target_law` for the target's block (the same processing, or only the argmax when
every row is greedy). Settings may differ per row (a batch mixes requests): a row's
probabilities depend only on its own logits, settings and history, never on its neighbours'.

The penalties read a row's history, a :class:`TokenHistory` built once per call by
:meth:`TokenHistory.of` (and for the positions of a verify block by :meth:`TokenHistory.along`):

- ``repetition_penalty`` (CTRL, as in transformers and vLLM) looks at every token of the sequence, prompt
  included: a seen token's logit is divided by the penalty when positive, multiplied when negative;
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI's) look at the generated tokens only: a token
  that occurred c times in the output loses ``presence * (c > 0) + frequency * c`` from its logit. With
  presence 0.5 and frequency 0.1, a token generated three times loses 0.5 + 0.3 = 0.8;
- ``logit_bias`` (OpenAI's) adds a fixed amount to given tokens' logits whatever the history: -100 bans
  a token, +100 all but forces it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genspec.acceptance.rules import TargetLaw
from genspec.checks import finite, integer
from genspec.errors import ConfigError
from genspec.kernels import cpu_array, most_likely

#: the range OpenAI's API takes for ``presence_penalty`` and ``frequency_penalty``
PENALTY_RANGE = (-2.0, 2.0)
#: the range OpenAI's API takes for a ``logit_bias`` value
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax); verification is token match.
    ``top_p == 0`` keeps only the most likely token: greedy too (OpenAI's API accepts it).

    ``top_k == 0`` and ``top_p == 1`` disable those filters; ``repetition_penalty == 1``,
    ``presence_penalty == frequency_penalty == 0`` and an empty ``logit_bias`` (a mapping token id ->
    amount, stored as sorted pairs) disable theirs (the module's docstring says what each does).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if finite("temperature", self.temperature) < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        integer("top_k", self.top_k, minimum=0)
        if not (0.0 <= finite("top_p", self.top_p) <= 1.0):
            raise ConfigError(f"top_p must be in [0, 1], got {self.top_p}")
        if finite("repetition_penalty", self.repetition_penalty) <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not low <= finite(name, getattr(self, name)) <= high:
                raise ConfigError(f"{name} must be in [{low:g}, {high:g}], got {getattr(self, name)}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_p == 0

    @property
    def reads_history(self) -> bool:
        """Does this row's processing depend on the tokens before it (a penalty is set)?"""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """``bias`` (a mapping token id -> amount, or its pairs) as sorted pairs, each checked."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = list(pairs)
        checked = {}
        for token, amount in pairs:
            checked[integer("logit_bias token id", token, minimum=0)] = finite("logit_bias value", amount)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"logit_bias must map token ids to numbers, got {bias!r:.80}") from None
    low, high = LOGIT_BIAS_RANGE
    outside = [amount for amount in checked.values() if not low <= amount <= high]
    if outside:
        raise ConfigError(f"logit_bias values must be in [{low:g}, {high:g}], got {outside[0]}")
    return tuple(sorted(checked.items()))


def per_row(sampling: SamplingConfig | Sequence[SamplingConfig], batch: int) -> list[SamplingConfig]:
    """``sampling`` as a list of one config per row."""
    if isinstance(sampling, SamplingConfig):
        return [sampling] * batch
    rows = list(sampling)
    if len(rows) != batch:
        raise ValueError(f"{len(rows)} sampling configs for {batch} rows")
    return rows


def _row_tensor(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """``[B, 1, ..., 1]`` so that it broadcasts over every dimension of ``like`` after the first."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).reshape(-1, *[1] * (like.dim() - 1))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): logits of tokens already seen are divided by the
    penalty when positive, multiplied when negative. ``seen`` is a bool mask shaped like ``logits``;
    ``penalty`` is one number, or a sequence with one per row."""
    if isinstance(penalty, (int, float)):
        if penalty == 1.0:
            return logits
        factor = penalty
    else:
        penalty = list(penalty)
        if all(p == 1.0 for p in penalty):
            return logits
        factor = _row_tensor(penalty, logits)
    penalised = torch.where(logits > 0, logits / factor, logits * factor)
    return torch.where(seen, penalised, logits)


def seen_mask(sequences: Sequence[Sequence[int]], vocab_size: int, device=None) -> torch.Tensor:
    """``[B, V]`` bool: which tokens occur in each row's sequence (what the repetition penalty reads)."""
    mask = torch.zeros(len(sequences), vocab_size, dtype=torch.bool, device=device)
    for row, sequence in enumerate(sequences):
        if len(sequence):
            mask[row, torch.as_tensor(list(sequence), dtype=torch.long, device=device)] = True
    return mask


@dataclass(frozen=True)
class TokenHistory:
    """What the penalties read of each row's tokens so far, shaped like the logits they adjust
    (``[B, V]``, or ``[B, N, V]`` at a block's positions): ``seen`` (bool) which tokens occur in the
    sequence, prompt included (the repetition penalty); ``counts`` (float) how often each occurs in the
    generated tokens (presence and frequency penalties). Either is None when no row needs it."""

    seen: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    @classmethod
    def of(cls, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], sampling, vocab_size: int,
           device=None) -> "TokenHistory | None":
        """The history of rows whose tokens so far are ``sequences`` (prompt then output; row r's prompt
        holds its first ``prompt_lengths[r]`` tokens), for their ``sampling`` settings (one or one per
        row); None when no row has a penalty."""
        rows = per_row(sampling, len(sequences))
        if not any(c.reads_history for c in rows):
            return None
        seen = counts = None
        if any(c.repetition_penalty != 1.0 for c in rows):
            seen = seen_mask(sequences, vocab_size, device)
        if any(c.presence_penalty != 0.0 or c.frequency_penalty != 0.0 for c in rows):
            counts = torch.zeros(len(sequences), vocab_size, dtype=torch.float32, device=device)
            for row, (sequence, start) in enumerate(zip(sequences, prompt_lengths)):
                output = list(sequence)[start:]
                if output:
                    counts[row].index_add_(0, torch.as_tensor(output, dtype=torch.long, device=device),
                                           torch.ones(len(output), device=device))
        return cls(seen, counts)

    def along(self, block_tokens: torch.Tensor, ancestors: torch.Tensor | None = None) -> "TokenHistory":
        """The history at each position of a verify block ``[B, n]`` whose token 0 is the last token of the
        sequences this history was built from: position i adds the block tokens among its ancestors, itself
        included (``ancestors`` ``[B, n, n]`` bool, a token tree's ancestor mask; default a chain, tokens 1..i).
        A block token counts as generated: it would be the output's if kept."""
        reference = self.seen if self.seen is not None else self.counts
        batch, n = block_tokens.shape
        one_hot = torch.zeros(batch, n, reference.shape[-1], dtype=torch.float32, device=reference.device)
        one_hot.scatter_(-1, block_tokens.unsqueeze(-1).to(reference.device), 1.0)
        one_hot[:, 0] = 0.0  # token 0 is already in the sequence
        if ancestors is None:
            ancestors = torch.ones(n, n, dtype=torch.bool, device=reference.device).tril().expand(batch, n, n)
        in_block = ancestors.to(reference.device, torch.float32) @ one_hot  # [B, n, V]: times among ancestors
        return TokenHistory(None if self.seen is None else self.seen.unsqueeze(1) | (in_block > 0),
                            None if self.counts is None else self.counts.unsqueeze(1) + in_block)

    def at(self, index) -> "TokenHistory":
        """The history of the rows (and positions) ``index`` picks, as a tensor index picks them."""
        return TokenHistory(None if self.seen is None else self.seen[index],
                            None if self.counts is None else self.counts[index])


def adjust_logits(logits: torch.Tensor, sampling, history: TokenHistory | None = None) -> torch.Tensor:
    """``logits`` ``[B, ..., V]`` after each row's logit bias and, from ``history``, its repetition,
    presence and frequency penalties (the module's docstring): the scores temperature, top-k and top-p
    then work on. Rows without any of these keep their logits bit for bit."""
    rows = per_row(sampling, logits.shape[0])
    if any(c.logit_bias for c in rows):
        bias = torch.zeros(logits.shape[0], logits.shape[-1], dtype=logits.dtype, device=logits.device)
        for row, config in enumerate(rows):
            if config.logit_bias:
                tokens, amounts = zip(*config.logit_bias)
                keep = [i for i, t in enumerate(tokens) if t < logits.shape[-1]]  # the engine checks ids fit
                bias[row, [tokens[i] for i in keep]] = torch.tensor([amounts[i] for i in keep], dtype=logits.dtype,
                                                                    device=logits.device)
        logits = logits + bias.reshape(logits.shape[0], *[1] * (logits.dim() - 2), logits.shape[-1])
    if history is None:
        return logits
    if history.seen is not None:
        logits = apply_repetition_penalty(logits, history.seen, [c.repetition_penalty for c in rows])
    if history.counts is not None:
        presence = _row_tensor([c.presence_penalty for c in rows], logits)
        frequency = _row_tensor([c.frequency_penalty for c in rows], logits)
        counts = history.counts.to(logits.dtype)
        logits = logits - presence * (counts > 0) - frequency * counts
    return logits


#: top-p looks for the nucleus among the tokens at least this share as likely as the most likely one first (then
#: among those at least its square, ..., then all, while they hold less than top_p). Ranking a whole 262,144-token
#: row costs a sizeable share of a llama.cpp step, selecting by share and the softmax over the nucleus a small
#: fraction of that (the manual's Backends page has the measurements)
NUCLEUS_SHARE = 1e-4
#: vocabularies up to this size rank whole rows for top-p, all rows at once: the per-row selection's Python
#: dominated the tests' 20,000-row chi-square batches (vocabulary 12), which the whole-row ranking keeps quick
NUCLEUS_SORT_VOCAB = 4096


def _softmax_in_nucleus(scores: torch.Tensor, limit: list[float]) -> torch.Tensor:
    """The softmax of ``scores`` ``[R, V]`` over each row's nucleus: ranked by score, a token is dropped when
    the tokens ranked above it already hold ``limit`` of the mass (the top token always stays); a row with
    ``limit`` 1 keeps every token. Only the likeliest tokens are ranked (:data:`NUCLEUS_SHARE`), widened until
    they hold ``limit``: every token below them is then dropped, exactly as a full ranking would drop it."""
    if scores.shape[-1] <= NUCLEUS_SORT_VOCAB:
        return _softmax_in_sorted_nucleus(scores, limit)
    probs = torch.zeros_like(scores)
    whole = [row for row, top_p in enumerate(limit) if top_p >= 1.0]
    if whole:
        probs[whole] = scores[whole].softmax(-1)
    for row, top_p in enumerate(limit):
        if top_p < 1.0:
            index, weights = _row_nucleus(scores[row], top_p)
            probs[row, index] = weights
    return probs


def _softmax_in_sorted_nucleus(scores: torch.Tensor, limit: list[float]) -> torch.Tensor:
    """:func:`_softmax_in_nucleus` for every row at once by ranking whole rows: the quicker way for a small
    vocabulary, where a row costs less than the per-row selection's Python (the tests' 20,000-row batches)."""
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    shares = (ranked - ranked[:, :1]).exp()
    held = (shares / shares.sum(-1, keepdim=True)).cumsum(-1)
    bound = torch.tensor([p if p < 1.0 else math.inf for p in limit], dtype=held.dtype, device=held.device)
    drop = ~_in_nucleus(held, bound.unsqueeze(-1))  # a row with top_p 1 drops nothing
    dropped = torch.zeros_like(drop).scatter_(-1, order, drop)
    return scores.masked_fill(dropped, -math.inf).softmax(-1)


def _in_nucleus(held: torch.Tensor, limit) -> torch.Tensor:
    """Which ranked tokens top-p keeps, from ``held`` ``[..., n]``, the running total of the ranked tokens' mass:
    those the tokens ranked above hold less than ``limit`` of (the total shifted by one: exact where a prefix holds
    exactly top_p, which "total minus self" rounds either way). A prefix of the ranking, the top token always in."""
    return torch.nn.functional.pad(held[..., :-1], (1, 0)) < limit


def _at_least(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """The indices of ``scores`` ``[V]`` >= ``threshold`` (on a CPU through NumPy, whose ``flatnonzero`` is the
    quicker on a 262,144-token row)."""
    array = cpu_array(scores)
    if array is not None:
        return torch.from_numpy(np.flatnonzero(array >= threshold))
    return (scores >= threshold).nonzero().flatten()


def _row_nucleus(scores: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's nucleus (:func:`_softmax_in_nucleus`): the indices of its tokens in ``scores`` ``[V]`` and their
    law, the softmax over them (the rest of the row has probability 0: no 262,144-token mask or softmax)."""
    shift = scores.max()
    total = (scores - shift).exp().sum()
    share = NUCLEUS_SHARE
    while True:  # the tokens at least ``share`` as likely as the top one: score >= top score + log(share)
        index = _at_least(scores, float(shift) + math.log(share)) if share else torch.arange(len(scores))
        ranked, order = scores[index].sort(descending=True, stable=True)
        held = ((ranked - shift).exp() / total).cumsum(0)
        if not share or bool(held[-1] >= limit):
            break
        share = share * share if share > 1e-30 else 0.0
    kept = int(_in_nucleus(held, limit).sum())
    return index[order[:kept]].to(scores.device), ranked[:kept].softmax(0)


def process_logits(logits: torch.Tensor, sampling, history: TokenHistory | None = None) -> torch.Tensor:
    """The law tokens are drawn from, ``[B, ..., V]``, from raw logits of the same shape.

    ``sampling``: a :class:`SamplingConfig` for every row or one per row. Per row: logit bias and
    penalties (:func:`adjust_logits`, the penalties from ``history``), then temperature, top-k, top-p
    (nucleus), softmax; computed in float32 at least (float64 stays float64). A greedy row (temperature 0) gets
    the one-hot of its (penalised) argmax, the law greedy decoding samples from.
    """
    rows = per_row(sampling, logits.shape[0])
    logits = adjust_logits(logits, rows, history)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    greedy = [c.greedy for c in rows]
    if all(greedy):
        return torch.nn.functional.one_hot(most_likely(logits), logits.shape[-1]).to(dtype)
    scores = logits / _row_tensor([c.temperature if not c.greedy else 1.0 for c in rows], logits)
    vocab = scores.shape[-1]
    top_k = [c.top_k if (0 < c.top_k < vocab and not c.greedy) else 0 for c in rows]
    if any(top_k):
        largest = torch.topk(scores, max(top_k), dim=-1).values
        index = _row_tensor([max(k - 1, 0) for k in top_k], scores).long().expand(*scores.shape[:-1], 1)
        kth = largest.gather(-1, index)
        kth = torch.where(_row_tensor(top_k, scores) > 0, kth, torch.full_like(kth, -math.inf))
        scores = scores.masked_fill(scores < kth, -math.inf)
    top_p = [c.top_p if not c.greedy else 1.0 for c in rows]
    if any(p < 1.0 for p in top_p):
        positions = scores[0].numel() // vocab  # the rows' laws at each of their block positions
        flat = [p for p in top_p for _ in range(positions)]
        probs = _softmax_in_nucleus(scores.reshape(-1, vocab), flat).reshape(scores.shape)
    else:
        probs = scores.softmax(-1)
    if any(greedy):
        one_hot = torch.nn.functional.one_hot(most_likely(logits), vocab).to(dtype)
        probs = torch.where(_row_tensor(greedy, scores).bool(), one_hot, probs)
    return probs


def target_law(logits: torch.Tensor, sampling, history: TokenHistory | None = None,
               valid: torch.Tensor | None = None) -> TargetLaw:
    """What the acceptance rule judges a block by, from the target's raw logits ``[B, N, V]`` at its nodes:
    :func:`process_logits`'s laws, or, when every row is greedy, only the (penalised) argmax, for which no
    ``[B, N, V]`` law is built. ``valid`` ``[B, N]``: the block's real nodes; an argmax of unadjusted logits
    reads only those (the others' token is 0, which no rule reads)."""
    rows = per_row(sampling, logits.shape[0])
    if not all(c.greedy for c in rows):
        return TargetLaw(probs=process_logits(logits, rows, history))
    adjusted = adjust_logits(logits, rows, history)
    return TargetLaw(tokens=most_likely(adjusted, valid if adjusted is logits else None))
