"""Calling a drafter for a group of requests: its offer, its costly draft, each checked, and the target's predictions
over its blocks for a drafter that reads them; a drafter that fails (or drafts a law with NaN or inf) fails only the
requests at fault, and the others go on."""
from __future__ import annotations

import time

import numpy as np
import torch

from genspec.drafters.base import BlockPredictions, Draft, DraftBlock, Drafter, DraftOffer, DraftRequest
from genspec.errors import GenerationError, NumericalError
from genspec.kernels import cpu_array, prefix_lengths, reduce_valid
from genspec.requests import Request


def offer(drafter: Drafter, requests: list[Request], room: list[int]) -> DraftOffer:
    """The drafter's offer for these requests (a failing one's offers nothing, :meth:`guarded`)."""
    rows = [DraftRequest(r.id, r.sequence, n) for r, n in zip(requests, room)]
    offer, _ = guarded(drafter, requests, rows, drafter.offer, DraftOffer.stack,
                        DraftOffer.free(Draft.empty(1)))
    kept = usable(drafter, requests, offer.proposal)
    return offer if kept is offer.proposal else DraftOffer(kept, offer.costly)

def propose(drafter: Drafter, requests: list[Request], limits: list[int]) -> tuple[Draft, float]:
    """The drafter's costly draft for these requests, and the seconds its reading took (:meth:`Drafter.read`,
    timed apart: the draft-length policy prices it per draft, not per position)."""
    rows = [DraftRequest(r.id, r.sequence, n, r.take_hidden()) for r, n in zip(requests, limits)]
    reading = 0.0

    def draft(part: list[DraftRequest]) -> Draft:
        nonlocal reading
        started = time.perf_counter()
        drafter.read(part)
        reading = time.perf_counter() - started
        return drafter.propose(part)

    drafted, whole = guarded(drafter, requests, rows, draft, Draft.stack, Draft.empty(1))
    return usable(drafter, requests, drafted), reading if whole else 0.0


def hand_predictions(drafter: Drafter, requests: list[Request], block: DraftBlock, predicted: torch.Tensor) -> None:
    """Hand the drafter what the target predicted over its requests' blocks (``predicted`` ``[B, N]``: the
    most likely token at each node of ``block``), per candidate chain (:class:`BlockPredictions`); requests
    that failed this step get nothing, and one whose drafter fails on its predictions fails alone."""
    live = [i for i, r in enumerate(requests) if r.finish_reason != "error"]
    if not live:
        return
    tokens, predicted = block.tokens.tolist(), predicted.tolist()
    rows = []
    for i in live:
        chains = block.chain_nodes(i)
        rows.append(BlockPredictions(requests[i].id, len(requests[i].sequence),
                                     tuple(tuple(tokens[i][n] for n in nodes) for nodes in chains),
                                     tuple(tuple(predicted[i][n] for n in [0, *nodes]) for nodes in chains)))
    guarded(drafter, [requests[i] for i in live], rows, drafter.read_predictions, lambda parts: None, None)


def unusable_rows(scores: torch.Tensor, valid: torch.Tensor) -> list[int]:
    """Rows of ``scores`` ``[B, ..., V]`` (logits or laws) with a NaN or +inf, or nothing but -inf, at a
    position where ``valid`` ``[B, ...]`` is True: nothing can be drawn from them. One max over the
    vocabulary, into which a NaN or +inf propagates (a lone -inf is a masked token and fine): a small share of
    the target pass it follows, where ``isfinite().all()`` costs many times more (the manual's Command line
    page, errors)."""
    array = cpu_array(scores)
    # NumPy's max where it can: quicker than torch's on a CPU,
    # over the valid positions only where the block is ragged
    lengths = prefix_lengths(valid, scores.shape) if array is not None and scores.dim() == 3 else None
    if lengths is not None:
        peak = torch.from_numpy(reduce_valid(array, lengths, np.max))
    else:
        peak = torch.from_numpy(np.asarray(array.max(-1))) if array is not None else scores.amax(-1)
    bad = ~torch.isfinite(peak) & valid.to(peak.device)
    return bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist()


def guarded(drafter: Drafter, requests: list[Request], rows: list[DraftRequest], call, stack, nothing):
    """``call(rows)`` for the drafter's rows, and whether that one call made it. If it fails, each request is
    called for alone, and a request whose own call fails fails alone (``finish_reason`` "error"; ``nothing``
    stands in for its row: it verifies nothing); the rows are then joined with ``stack``."""
    try:
        return call(rows), True
    except Exception:  # noqa: BLE001 - find the request(s) at fault; the others go on
        parts = []
        for request, row in zip(requests, rows):
            try:
                parts.append(call([row]))
            except Exception as exc:  # noqa: BLE001 - reported on the request, the engine goes on
                request.fail(GenerationError(f"drafter {drafter.name!r} failed: {type(exc).__name__}: {exc}"))
                parts.append(nothing)
        return stack(parts), False


def usable(drafter: Drafter, requests: list[Request], draft: Draft) -> Draft:
    """``draft`` without the rows whose draft law holds NaN or inf: those requests fail (the acceptance rule
    would not be lossless on them)."""
    if draft.probs is None:
        return draft
    drafted = torch.arange(draft.width) < draft.lengths.unsqueeze(-1)  # [B, M, k]
    bad = unusable_rows(draft.probs, drafted)
    for row in bad:
        requests[row].fail(NumericalError(
            f"drafter {drafter.name!r}: its draft law contains NaN or inf (computed in "
            f"{str(draft.probs.dtype).replace('torch.', '')}); nothing can be verified against it"))
    if bad:
        draft = draft.clipped([0 if i in bad else n for i, n in enumerate(draft.lengths.amax(1).tolist())])
    return draft
