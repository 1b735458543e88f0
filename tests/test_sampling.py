"""genspec's logits processing checked against transformers' own logits processors.

The lossless tests build their expected law with :func:`genspec.sampling.process_logits` itself, so a
bug there would cancel out. Here the reference is independent: transformers'
``RepetitionPenaltyLogitsProcessor`` (over ``input_ids``), then ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper`` -- the order ``generate`` applies them in -- and a softmax
of the processed scores (``-inf`` entries become probability 0).

Logits are continuous float64 draws (no exact ties), so which tokens survive top-k / top-p is decided
by the same comparisons on both sides and the probabilities must agree to float64 round-off, with the
same support. The one known disagreement -- top-p when a prefix's mass equals top_p exactly, where
last-bit rounding decides differently on each side -- is pinned by strict xfails below.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import genspec.sampling
from genspec.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    TokenHistory,
    process_logits,
    seen_mask,
)

ATOL64 = 1e-10
ATOL32 = 1e-6


# --------------------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a busy 2-core machine (restored after)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_case(seed: int, batch: int = 4, vocab: int | None = None, history: int = 24):
    """Random float64 logits ``[B, V]`` (continuous, varied sharpness per row) and ``input_ids``
    ``[B, L]`` full of repeats (the first half shuffled again as the second half), whose first id is
    the row's raw argmax."""
    gen = torch.Generator().manual_seed(seed)
    if vocab is None:
        vocab = int(torch.randint(50, 301, (1,), generator=gen))
    scale = torch.empty(batch, 1, dtype=torch.float64).uniform_(0.5, 4.0, generator=gen)
    logits = torch.randn(batch, vocab, dtype=torch.float64, generator=gen) * scale
    half = torch.randint(0, vocab, (batch, history // 2), generator=gen)
    shuffled = half[:, torch.randperm(history // 2, generator=gen)]
    input_ids = torch.cat([half, shuffled], dim=1)
    # the raw argmax is always in the history, so the penalty reshapes the top of the distribution
    input_ids[:, 0] = logits.argmax(-1)
    return logits, input_ids


def hf_processors(temperature: float | None, top_k: int, top_p: float, penalty: float) -> LogitsProcessorList:
    """The transformers pipeline for a genspec setting (``top_k == 0`` means no top-k warper, as in
    ``generate``; the other warpers are always present, also at their neutral values)."""
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=float(penalty))])
    if temperature is not None:
        procs.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        procs.append(TopKLogitsWarper(top_k=int(top_k)))
    procs.append(TopPLogitsWarper(top_p=float(top_p)))
    return procs


def hf_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature, top_k, top_p, penalty) -> torch.Tensor:
    scores = hf_processors(temperature, top_k, top_p, penalty)(input_ids, logits.clone())
    return torch.softmax(scores, dim=-1)


def genspec_probs(logits, input_ids, temperature, top_k, top_p, penalty) -> torch.Tensor:
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    return process_logits(logits, config, history=TokenHistory(seen=seen_mask(input_ids.tolist(), logits.shape[-1])))


def assert_same_law(probs: torch.Tensor, ref: torch.Tensor, atol: float = ATOL64, what: str = ""):
    assert probs.shape == ref.shape, what
    assert torch.isfinite(probs).all(), what
    support, ref_support = probs > 0, ref > 0
    if not torch.equal(support, ref_support):
        rows = (support != ref_support).any(-1).nonzero().flatten().tolist()
        raise AssertionError(f"support differs {what} in rows {rows}: genspec keeps "
                             f"{support.sum(-1).tolist()} tokens, transformers {ref_support.sum(-1).tolist()}")
    err = (probs.double() - ref).abs().max().item()
    assert err <= atol, f"max |genspec - transformers| = {err:.3g} > {atol} {what}"
    assert torch.allclose(probs.sum(-1).double(), torch.ones(probs.shape[:-1], dtype=torch.float64), atol=1e-6)


# ------------------------------------------------------------------------------ repetition penalty
@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.7, 2.5])
def test_repetition_penalty_matches_transformers_exactly(penalty):
    logits, input_ids = make_case(seed=11, batch=5, vocab=97)
    logits[:, :3] = 0.0  # exact zeros: neither side may move them
    input_ids[:, 1] = 0
    seen = seen_mask(input_ids.tolist(), logits.shape[-1])
    ours = apply_repetition_penalty(logits, seen, penalty)
    ref = RepetitionPenaltyLogitsProcessor(penalty=penalty)(input_ids, logits.clone())
    assert torch.equal(ours, ref)
    if penalty != 1.0:  # the comparison is not vacuous: seen logits really moved, unseen did not
        assert not torch.equal(ours, logits)
        assert torch.equal(ours[~seen], logits[~seen])
    # and through process_logits (penalty alone, temperature 1, no filters)
    assert_same_law(genspec_probs(logits, input_ids, 1.0, 0, 1.0, penalty),
                    torch.softmax(ref, -1), what=f"penalty={penalty}")


def test_seen_mask_rows_of_different_lengths_and_empty_history():
    """Rows with histories of different lengths (one empty): each row against transformers alone."""
    logits, _ = make_case(seed=12, batch=4, vocab=61)
    histories = [[3, 3, 7, 60, 0], [], [int(logits[2].argmax())] * 3, list(range(0, 61, 2))]
    seen = seen_mask(histories, 61)
    assert seen.sum(-1).tolist() == [len(set(h)) for h in histories]
    config = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3)
    ours = process_logits(logits, config, history=TokenHistory(seen=seen))
    for row, history in enumerate(histories):
        ids = torch.tensor([history], dtype=torch.long).reshape(1, len(history))
        ref = hf_probs(logits[row:row + 1], ids, 0.8, 20, 0.9, 1.3)
        assert_same_law(ours[row:row + 1], ref, what=f"row {row}")


# ---------------------------------------------------------------------------- each warper alone
@pytest.mark.parametrize("temperature", [0.1, 0.25, 0.5, 1.0, 1.5, 2.0])
def test_temperature_alone(temperature):
    logits, input_ids = make_case(seed=21)
    assert_same_law(genspec_probs(logits, input_ids, temperature, 0, 1.0, 1.0),
                    hf_probs(logits, input_ids, temperature, 0, 1.0, 1.0), what=f"T={temperature}")


@pytest.mark.parametrize("top_k", [1, 2, 5, "V-1", "V", "V+7"])
def test_top_k_alone(top_k):
    logits, input_ids = make_case(seed=22, vocab=113)
    vocab = logits.shape[-1]
    k = {"V-1": vocab - 1, "V": vocab, "V+7": vocab + 7}.get(top_k, top_k)
    ours = genspec_probs(logits, input_ids, 1.0, k, 1.0, 1.0)
    ref = hf_probs(logits, input_ids, None, k, 1.0, 1.0)
    assert_same_law(ours, ref, what=f"top_k={k}")
    assert ((ours > 0).sum(-1) == min(k, vocab)).all()


@pytest.mark.parametrize("ranking", ["whole rows", "selected per row"])
@pytest.mark.parametrize("top_p", [1e-9, 0.1, 0.5, 0.9, 0.99, 1.0])
def test_top_p_alone(monkeypatch, top_p, ranking):
    """Both ways of finding the nucleus (all rows ranked at once, for small vocabularies; the likeliest tokens
    selected row by row, for large ones) give transformers' law."""
    if ranking == "selected per row":
        monkeypatch.setattr(genspec.sampling, "NUCLEUS_SORT_VOCAB", 0)
    logits, input_ids = make_case(seed=23, batch=8)
    ours = genspec_probs(logits, input_ids, 1.0, 0, top_p, 1.0)
    assert_same_law(ours, hf_probs(logits, input_ids, None, 0, top_p, 1.0), what=f"top_p={top_p}")
    if top_p == 1e-9:  # both keep exactly the top token (transformers: min_tokens_to_keep=1)
        assert torch.equal(ours, torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double())


@pytest.mark.parametrize("share", [0.9, 0.5, 0.1])
def test_top_p_ranks_the_likeliest_tokens_first_and_widens_until_they_hold_top_p(monkeypatch, share):
    """top-p ranks only the tokens at least ``NUCLEUS_SHARE`` as likely as the top one, widening (the share
    squared, ..., then all) while they hold less than top_p. With a share this high the widening runs, per row
    of a batch mixing top_p values, a top_p 1 row and a greedy row: every row is still transformers' law."""
    monkeypatch.setattr(genspec.sampling, "NUCLEUS_SHARE", share)
    monkeypatch.setattr(genspec.sampling, "NUCLEUS_SORT_VOCAB", 0)  # the per-row selection at any vocabulary
    configs = [(1.0, 0, 0.1, 1.0), (1.0, 0, 0.5, 1.0), (1.0, 0, 0.9, 1.0), (1.0, 0, 0.99, 1.0),
               (1.0, 0, 1.0, 1.0), (0.0, 0, 0.9, 1.0), (0.7, 5, 0.9, 1.3)]
    logits, input_ids = make_case(seed=70 + int(share * 10), batch=len(configs), vocab=300)
    logits[:4] /= 8  # flat rows: their nucleus is far wider than the candidates
    ours = process_logits(logits, [SamplingConfig(*c) for c in configs],
                          history=TokenHistory(seen=seen_mask(input_ids.tolist(), 300)))
    for row, (temperature, top_k, top_p, penalty) in enumerate(configs):
        if temperature == 0:
            ref = torch.nn.functional.one_hot(logits[row:row + 1].argmax(-1), 300).double()
        else:
            ref = hf_probs(logits[row:row + 1], input_ids[row:row + 1], temperature, top_k, top_p, penalty)
        assert_same_law(ours[row:row + 1], ref, what=f"share={share} row {row} {configs[row]}")
    kept = ours[3][ours[3] > 0]  # top-p 0.99 on a flat row: the widening was needed
    assert kept.min() < share * kept.max(), kept


def test_top_p_on_a_large_vocabulary_matches_transformers():
    """A 50,000-token vocabulary: peaked rows with a small nucleus and flat rows with one of thousands of tokens
    (float64, so the comparison is exact to round-off)."""
    logits, input_ids = make_case(seed=80, batch=4, vocab=50_000)
    logits[2:] /= 16
    for top_p in (0.5, 0.9):
        ours = genspec_probs(logits, input_ids, 0.7, 0, top_p, 1.0)
        assert_same_law(ours, hf_probs(logits, input_ids, 0.7, 0, top_p, 1.0), what=f"top_p={top_p}")
        kept = (ours > 0).sum(-1)
        assert kept[2:].min() > 10_000, kept  # flat rows: a nucleus of most of the vocabulary


# ------------------------------------------------------------------------------------ combinations
GRID = [(t, k) for t in (0.1, 0.7, 1.0, 2.0) for k in (0, 1, 5, "V-1", "V")]


@pytest.mark.parametrize("temperature,top_k", GRID)
def test_combined_grid(temperature, top_k):
    """penalty + temperature + top-k + top-p, every top_p x penalty of the grid for this (T, k)."""
    for j, (top_p, penalty) in enumerate((p, r) for p in (0.1, 0.5, 0.9, 1.0) for r in (1.0, 1.3, 0.7)):
        logits, input_ids = make_case(seed=1000 + 100 * GRID.index((temperature, top_k)) + j)
        vocab = logits.shape[-1]
        k = {"V-1": vocab - 1, "V": vocab}.get(top_k, top_k)
        assert_same_law(genspec_probs(logits, input_ids, temperature, k, top_p, penalty),
                        hf_probs(logits, input_ids, temperature, k, top_p, penalty),
                        what=f"T={temperature} k={k} p={top_p} r={penalty} V={vocab}")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1),
       vocab=st.integers(50, 300),
       temperature=st.floats(0.1, 2.0, exclude_min=True),
       top_k=st.sampled_from([0, 1, 2, 5, 17, -1, -2]),  # -1 -> V, -2 -> V-1
       # not within 1e-9 of 1: there the tail's cumulative mass meets top_p within a few ulps (an exact
       # boundary, where the two libraries round differently: see test_top_p_exact_boundary)
       top_p=st.one_of(st.sampled_from([0.1, 0.5, 0.9, 1.0]), st.floats(0.01, 1.0 - 1e-9)),
       penalty=st.one_of(st.sampled_from([1.0, 1.3, 0.7]), st.floats(0.5, 2.0)))
def test_combined_random_settings(seed, vocab, temperature, top_k, top_p, penalty):
    logits, input_ids = make_case(seed, batch=3, vocab=vocab)
    k = {-1: vocab, -2: vocab - 1}.get(top_k, top_k)
    assert_same_law(genspec_probs(logits, input_ids, temperature, k, top_p, penalty),
                    hf_probs(logits, input_ids, temperature, k, top_p, penalty),
                    what=f"seed={seed} V={vocab} T={temperature} k={k} p={top_p} r={penalty}")


@pytest.mark.skipif(not hasattr(genspec.sampling, "per_row"), reason="process_logits takes one config for all rows")
@pytest.mark.parametrize("three_d", [False, True])
def test_per_row_configs_each_row_matches_transformers(three_d):
    """A batch mixing settings (one greedy row): every row equals transformers with its own settings."""
    configs = [(0.7, 5, 0.9, 1.3), (0.0, 0, 1.0, 2.5), (1.5, 0, 0.5, 0.7), (1.0, 0, 1.0, 1.0),
               (0.3, "V", 0.1, 1.3), (2.0, 1, 1.0, 0.7)]
    logits, input_ids = make_case(seed=61, batch=len(configs), vocab=90)
    configs = [(t, 90 if k == "V" else k, p, r) for t, k, p, r in configs]
    seen = seen_mask(input_ids.tolist(), 90)
    if three_d:  # [B, n, V]: the same logits at every position, the same history
        logits, seen = logits.unsqueeze(1).expand(-1, 3, -1), seen.unsqueeze(1).expand(-1, 3, -1)
    ours = process_logits(logits, [SamplingConfig(*c) for c in configs], history=TokenHistory(seen=seen))
    assert ours.shape == logits.shape
    for row, (temperature, top_k, top_p, penalty) in enumerate(configs):
        row_logits = logits[row, 0] if three_d else logits[row]
        got = ours[row] if three_d else ours[row:row + 1]
        if temperature == 0:
            penalised = RepetitionPenaltyLogitsProcessor(penalty)(input_ids[row:row + 1], row_logits[None].clone())
            ref = torch.nn.functional.one_hot(penalised.argmax(-1), 90).double()
            assert penalised.argmax() != row_logits.argmax()  # the penalty matters for this row
        else:
            ref = hf_probs(row_logits[None], input_ids[row:row + 1], temperature, top_k, top_p, penalty)
        assert_same_law(got, ref.expand_as(got), what=f"row {row} {configs[row]}")


# ---------------------------------------------------------------------- top-p at an exact boundary
# When a prefix of the sorted law has mass *exactly* top_p, the rule (keep the smallest prefix whose
# mass reaches top_p: drop a token iff the mass before it >= top_p) is decided by the last bit of a
# sum. genspec sums the mass before each token as a running total shifted by one, so a prefix that
# holds exactly top_p is found exactly; transformers compares ``cumsum(ascending) <= 1 - top_p``, which
# rounds either way (here it keeps a third token for (.5, .3, .2) at top_p 0.8, as 1 - 0.8 rounds
# to 0.19999999999999996 < 0.2).
@pytest.mark.parametrize("weights,top_p,dtype,kept", [
    ([5, 3, 2], 0.8, torch.float64, 2),
    ([4, 3, 1], 0.5, torch.float64, 1),
    ([9, 5, 1], 0.6, torch.float64, 1),
])
def test_top_p_exact_boundary_follows_the_rule(weights, top_p, dtype, kept):
    logits = torch.tensor([[float(torch.tensor(w, dtype=torch.float64).log()) for w in weights]], dtype=dtype)
    ids = torch.zeros(1, 0, dtype=torch.long)
    assert int((genspec_probs(logits, ids, 1.0, 0, top_p, 1.0) > 0).sum()) == kept
    # a hair away from the boundary, on either side, genspec and transformers agree
    for nudged in (top_p - 1e-6, top_p + 1e-6):
        assert_same_law(genspec_probs(logits, ids, 1.0, 0, nudged, 1.0),
                        hf_probs(logits.double(), ids, None, 0, nudged, 1.0), atol=ATOL32)


# ------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.7, 2.5])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.5)])
def test_greedy_is_one_hot_of_penalised_argmax(penalty, top_k, top_p):
    logits, input_ids = make_case(seed=31, batch=16, vocab=80)
    ours = genspec_probs(logits, input_ids, 0.0, top_k, top_p, penalty)
    penalised = RepetitionPenaltyLogitsProcessor(penalty=penalty)(input_ids, logits.clone())
    expected = torch.nn.functional.one_hot(penalised.argmax(-1), logits.shape[-1]).to(ours.dtype)
    assert ours.dtype == torch.float64
    assert torch.equal(ours, expected)
    if penalty == 2.5:  # the raw argmax is always seen, so a strong penalty must move some argmaxes
        assert (penalised.argmax(-1) != logits.argmax(-1)).any()


# -------------------------------------------------------------------------------------- 3-D input
@pytest.mark.parametrize("temperature,top_k,top_p,penalty",
                         [(0.7, 5, 0.9, 1.3), (1.3, 0, 0.5, 0.7), (0.0, 0, 1.0, 1.3), (1.0, 40, 1.0, 1.0)])
def test_3d_input_equals_rowwise(temperature, top_k, top_p, penalty):
    batch, n, vocab = 3, 5, 70
    gen = torch.Generator().manual_seed(41)
    logits = torch.randn(batch, n, vocab, dtype=torch.float64, generator=gen) * 2.0
    histories = [torch.randint(0, vocab, (12,), generator=gen).tolist() for _ in range(batch)]
    block = torch.randint(0, vocab, (batch, n), generator=gen)
    seen = TokenHistory(seen=seen_mask(histories, vocab)).along(block).seen  # [B, n, V], differs per position
    assert not torch.equal(seen[:, 0], seen[:, -1])
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    ours = process_logits(logits, config, history=TokenHistory(seen=seen))
    assert ours.shape == (batch, n, vocab)
    for i in range(n):
        assert torch.equal(ours[:, i], process_logits(logits[:, i].contiguous(), config, history=TokenHistory(seen=seen[:, i].contiguous())))
        if temperature > 0:  # and each position against transformers, with that position's history
            for b in range(batch):
                ids = torch.tensor([histories[b] + block[b, 1:i + 1].tolist()])
                ref = hf_probs(logits[b:b + 1, i], ids, temperature, top_k, top_p, penalty)
                assert_same_law(ours[b:b + 1, i], ref, what=f"position {i} row {b}")


# ------------------------------------------------------------------------------------------ float32
@pytest.mark.parametrize("temperature,top_k,top_p,penalty",
                         [(1.0, 0, 1.0, 1.0), (0.7, 5, 0.9, 1.3), (0.3, 0, 0.5, 0.7), (2.0, 50, 0.95, 1.3),
                          (0.1, 0, 0.9, 1.0), (1.0, 1, 1.0, 0.7)])
def test_float32_input_close_to_float64_reference(temperature, top_k, top_p, penalty):
    logits64, input_ids = make_case(seed=51, batch=8, vocab=200)
    logits32 = logits64.float()
    ours = genspec_probs(logits32, input_ids, temperature, top_k, top_p, penalty)
    assert ours.dtype == torch.float32
    # reference on the very same (float32-representable) values, computed in float64
    ref = hf_probs(logits32.double(), input_ids, temperature, top_k, top_p, penalty)
    err = (ours.double() - ref).abs().max().item()
    assert err <= ATOL32, f"max |float32 genspec - float64 transformers| = {err:.3g}"
    # no token outside the reference support; a kept token may only vanish by float32 underflow
    assert not ((ours > 0) & (ref == 0)).any()
    assert (ref[(ref > 0) & (ours == 0)] < 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_most_likely_is_torch_argmax(dtype):
    """NumPy's argmax (float CPU tensors) and torch's (the rest) agree with torch.argmax: first index of the
    largest value, ties and NaN included."""
    from genspec.kernels import most_likely

    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (3, 4, 50), generator=generator).to(dtype)  # many ties
    scores[1, 2, 17] = float("nan")
    scores[2, 0] = float("-inf")
    scores[2, 1, 3] = float("inf")
    for view in (scores, scores[:, 1:3], scores.transpose(0, 1)):
        chosen = most_likely(view)
        assert chosen.dtype == torch.long and torch.equal(chosen, view.argmax(-1))
    assert most_likely(torch.zeros(0, 5)).shape == (0,)
    mask = scores > 2
    assert torch.equal(most_likely(mask), mask.to(torch.uint8).argmax(-1))  # bool: the first True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_most_likely_over_a_ragged_block_reads_its_valid_positions_only(dtype):
    """Rows of different widths (valid first): the argmax at each valid position is torch's, padding gives 0 and
    is not read (a NaN there changes nothing); a valid mask that is no prefix falls back to every position."""
    from genspec.kernels import most_likely

    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 4, 30, generator=generator).to(dtype)
    valid = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    scores[1, 2, 7] = float("nan")
    expected = scores.float().argmax(-1).masked_fill(~valid, 0)
    assert torch.equal(most_likely(scores, valid), expected)
    assert torch.equal(most_likely(scores, torch.ones(3, 4, dtype=torch.bool)), scores.argmax(-1))
    holes = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(most_likely(scores, holes), scores.argmax(-1).masked_fill(~holes, 0))


def test_greedy_target_law_of_a_ragged_block_matches_the_padded_one():
    """The engine's greedy law with the block's valid mask: the same tokens at every valid node as without it."""
    from genspec.config import SamplingConfig
    from genspec.sampling import target_law

    logits = torch.randn(4, 5, 40, generator=torch.Generator().manual_seed(2))
    valid = torch.arange(5)[None] < torch.tensor([5, 1, 3, 2])[:, None]
    greedy = SamplingConfig(temperature=0.0)
    full, ragged = target_law(logits, greedy).tokens, target_law(logits, greedy, valid=valid).tokens
    assert torch.equal(ragged[valid], full[valid]) and not ragged[~valid].any()


def test_unusable_rows_finds_nan_inf_and_all_masked_rows():
    from genspec.drafting import unusable_rows

    logits = torch.randn(4, 3, 20)
    logits[1, 2, 5] = float("nan")
    logits[2, 0, 0] = float("inf")
    logits[3, 1] = float("-inf")
    logits[0, 1, 4] = float("-inf")  # a masked token: fine
    valid = torch.ones(4, 3, dtype=torch.bool)
    assert unusable_rows(logits, valid) == [1, 2, 3]
    valid[1, 2] = False  # the NaN sits where nothing is read
    assert unusable_rows(logits, valid) == [2, 3]
    assert unusable_rows(logits.double(), valid) == [2, 3]
    assert unusable_rows(logits.bfloat16(), valid) == [2, 3]
    ragged = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)  # rows of 3, 2, 1, 2
    assert unusable_rows(logits, ragged) == [2, 3]  # the NaN at [1, 2] is padding now, [3, 1] still read
    ragged[3, 1] = False
    assert unusable_rows(logits, ragged) == [2]
