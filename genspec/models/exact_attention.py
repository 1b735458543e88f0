"""Attention whose result for a query does not depend on the block or the batch it is computed in: the exact
torch models' (``HFCausalLM(..., exact=True)``), registered with transformers' attention interface.

Why: transformers' attention multiplies each row's queries with all the slots of genspec's cache at once, so a
query's reductions (the scores' softmax and the weighted sum of values) have as many terms as the batch has
slots, holes and other rows' padding included, in an order the BLAS picks for that shape. The same token's
attention as a one-token step, inside a 16-token block or beside 15 other rows then differs in the last bits.

How: each query's keys are those visible to it, taken in slot order (a row's cached slots are in position
order, and holes are never visible), and cut into chunks of ``KEY_CHUNK`` keys aligned at its first visible key,
so a query sees the same keys at the same offsets of the same chunks wherever it is computed. Queries are taken
``QUERY_ROWS`` at a time (padded), so every product is a GEMM of one fixed shape (``[g * QUERY_ROWS, D]`` times
``[D, KEY_CHUNK]`` for the scores, ``[g * QUERY_ROWS, KEY_CHUNK]`` times ``[KEY_CHUNK, D]`` for the values, ``g``
query heads per key/value head) and a row's result does not depend on the rows beside it. The softmax is taken
in two passes: the maximum over all the query's keys (exact in any order), then ``exp`` of each score less it
(an invisible key's is exactly 0), summed within each chunk and then chunk after chunk in order, as the weighted
values are. A key chunk past the query's last visible key adds exact zeros.

Example: a sliding window of 4 keys, a row holding positions 0..9, a block of 2 queries at positions 10 and 11.
The first sees positions 7..10, the second 8..11; the row's keys are 7..11. Each query's chunks start at its own
first key (7 for the first, 8 for the second), as they would in a one-token step, where the row's keys are just
that query's. Keys visible to a query but not in one run (a token tree's non-ancestors among its ancestors) are
in other places than in a chain, so a tree's logits agree with a chain's only to the last bits.
"""
from __future__ import annotations

import weakref

import torch

from genspec.errors import ConfigError

#: the name the attention goes by in transformers' attention interface (``config._attn_implementation``)
NAME = "genspec_exact"
#: keys per chunk of a query's reductions
KEY_CHUNK = 64
#: queries per product (padded with copies of the first when a group has fewer)
QUERY_ROWS = 4
#: the most elements the gathered keys of one pass hold (a long prompt's queries go in several passes)
PASS_ELEMENTS = 1 << 24


def use_exact_attention(model) -> None:
    """Make ``model``'s attention :func:`exact_attention` (in place: its config's attention implementation)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, exact_attention)
    # a mask transformers builds for it (a plain ``model(input_ids)``) is the eager attention's additive one
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
    model.config._attn_implementation = NAME


class _Plan:
    """Which keys and queries each product of a layer takes, for one mask (every layer with that mask shares it).

    A unit is up to ``QUERY_ROWS`` queries of one row whose visible keys start a whole number of chunks apart in
    the row's layout (the slots visible to any of its queries, in slot order); it takes that layout's keys from
    the first of them on, ``chunks * KEY_CHUNK`` of them, so each of its queries' chunks start at its first key."""

    def __init__(self, visible: torch.Tensor):
        batch, n, slots = visible.shape
        device = visible.device
        union = visible.any(1)  # [B, S]: the row's layout
        layout_length = union.sum(1)  # [B]
        layout = (~union).to(torch.int8).argsort(dim=1, stable=True)  # [B, S]: its slots first, in slot order
        rank = union.long().cumsum(1) - 1  # [B, S]: a visible slot's place in the layout
        count = visible.sum(2)  # [B, n]
        first_slot = visible.to(torch.int8).argmax(2)
        last_slot = slots - 1 - visible.flip(2).to(torch.int8).argmax(2)
        first = rank.gather(1, first_slot)
        last = rank.gather(1, last_slot)
        # a query seeing one key (a padded query, the first token of a prompt) gets that key's value whatever the
        # chunks' alignment: it joins the row's queries whose keys start at the row's first key
        first = torch.where(count > 1, first, torch.zeros_like(first))
        # units: the queries of a row whose first keys are a whole number of chunks apart, in order of their first
        # keys, QUERY_ROWS at a time; the chunks of a unit's layout before a query's first key add exact zeros to it
        row_of = torch.arange(batch, device=device).unsqueeze(1).expand(batch, n).reshape(-1)
        query_of = torch.arange(n, device=device).repeat(batch)
        first_of, last_of = first.reshape(-1), last.reshape(-1)
        key = row_of * KEY_CHUNK + first_of % KEY_CHUNK
        order = torch.argsort((key * (slots + 1) + first_of) * n + query_of)
        row_of, query_of, first_of, last_of, key = (row_of[order], query_of[order], first_of[order], last_of[order],
                                                   key[order])
        new_run = torch.ones_like(key, dtype=torch.bool)
        new_run[1:] = key[1:] != key[:-1]
        index = torch.arange(len(key), device=device)
        run_start = torch.cummax(torch.where(new_run, index, torch.zeros_like(index)), 0).values
        in_run = index - run_start
        unit_of = torch.cumsum((in_run % QUERY_ROWS == 0).long(), 0) - 1
        units = int(unit_of[-1]) + 1 if len(unit_of) else 0
        place = in_run % QUERY_ROWS
        #: per unit: its row, the first key of its layout, its number of key chunks
        self.rows = torch.zeros(units, dtype=torch.long, device=device).index_copy(0, unit_of, row_of)
        start = torch.full((units,), slots, dtype=torch.long, device=device).scatter_reduce(0, unit_of, first_of, "amin")
        end = torch.zeros(units, dtype=torch.long, device=device).scatter_reduce(0, unit_of, last_of, "amax")
        self.chunks = (end - start).clamp(min=0) // KEY_CHUNK + 1
        #: per unit and place: the query (a padded place repeats the unit's first), and whether it is real
        self.queries = torch.full((units, QUERY_ROWS), -1, dtype=torch.long, device=device)
        self.queries[unit_of, place] = query_of
        self.real = self.queries >= 0
        self.queries = torch.where(self.real, self.queries, self.queries[:, :1])
        width = int(self.chunks.max()) * KEY_CHUNK if units else 0
        #: per unit and key: the slot (a place past the row's layout takes any, unseen) and what each query sees
        at = start.unsqueeze(1) + torch.arange(width, device=device)
        inside = at < layout_length[self.rows].unsqueeze(1)
        self.slots = layout[self.rows.unsqueeze(1), at.clamp(max=slots - 1)]
        self.sees = (visible[self.rows.unsqueeze(1), self.queries].gather(
            2, self.slots.unsqueeze(1).expand(-1, QUERY_ROWS, -1)) & inside.unsqueeze(1) & self.real.unsqueeze(2))
        # a padded place, or a query that sees nothing (a left-padded prompt's padding in a plain transformers
        # forward), sees the unit's first key, so that its softmax stays finite (its result is never read)
        self.sees[:, :, 0] |= ~self.sees.any(2)


#: the plans of the masks still alive: id -> (the mask, its plan); a mask is made anew for each forward (by
#: genspec, or by transformers) and not changed after
_plans: dict[int, tuple[weakref.ref, _Plan]] = {}


def _plan(attention_mask: torch.Tensor | None, batch: int, n: int, slots: int, device) -> _Plan:
    """The plan of ``attention_mask`` (made once per mask tensor: a forward's layers pass the same one)."""
    if attention_mask is None:  # no mask: every query sees every key
        return _Plan(torch.ones(batch, n, slots, dtype=torch.bool, device=device))
    held = _plans.get(id(attention_mask))
    if held is not None and held[0]() is attention_mask:
        return held[1]
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or tuple(attention_mask.shape[2:]) != (n, slots):
        raise ConfigError(f"exact attention takes a mask [batch, 1, {n}, {slots}], got {list(attention_mask.shape)}")
    mask = attention_mask[:, 0].expand(batch, n, slots)
    if mask.dtype == torch.bool:
        visible = mask
    else:
        visible = mask == 0
        if bool((~visible & (mask > torch.finfo(mask.dtype).min)).any()):
            raise ConfigError("exact attention takes masks of 0 (seen) and the lowest value (unseen), not biases")
    plan = _Plan(visible)
    for stale in [k for k, (ref, _) in _plans.items() if ref() is None]:
        del _plans[stale]
    _plans[id(attention_mask)] = (weakref.ref(attention_mask), plan)
    return plan


def exact_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function (``eager_attention_forward``'s arguments and result: the output
    ``[B, n, H, D]`` and no weights) for queries ``[B, H, n, D]``, keys and values ``[B, H_kv, S, D]`` and an
    additive mask ``[B, 1, n, S]``, computed as the module docstring says. ``softcap``: the scores' soft cap
    (Gemma 2). Attention sinks and dropout are refused."""
    if dropout:
        raise ConfigError("exact attention runs no dropout (a model in training mode)")
    if kwargs.get("s_aux") is not None:
        raise ConfigError("exact attention has no attention sinks (this model's attention takes them)")
    batch, heads, n, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if scaling is None:
        scaling = module.head_dim ** -0.5
    plan = _plan(attention_mask, batch, n, slots, query.device)
    out = query.new_zeros(batch, n, heads, dim)
    units = len(plan.rows)
    per_unit = kv_heads * dim * int(plan.chunks.max()) * KEY_CHUNK if units else 1
    step = max(1, PASS_ELEMENTS // per_unit)
    keys_by_slot, values_by_slot = key.transpose(1, 2), value.transpose(1, 2)  # [B, S, H_kv, D]
    queries_by_place = query.transpose(1, 2)  # [B, n, H, D]
    for begin in range(0, units, step):
        part = slice(begin, min(units, begin + step))
        rows, chunks = plan.rows[part], int(plan.chunks[part].max())
        width = chunks * KEY_CHUNK
        slot_index = plan.slots[part, :width]
        sees = plan.sees[part, :, :width]  # [U, Q, K]
        count = len(rows)
        chunked = (count, kv_heads, chunks, KEY_CHUNK, dim)  # [U, H_kv, chunks, C, D]
        k = keys_by_slot[rows.unsqueeze(1), slot_index].permute(0, 2, 1, 3).reshape(chunked)
        v = values_by_slot[rows.unsqueeze(1), slot_index].permute(0, 2, 1, 3).reshape(chunked)
        # [U, Q, H, D] -> [U, H_kv, 1, g * Q, D]: a key/value head's query heads, each with the unit's queries
        q = queries_by_place[rows.unsqueeze(1), plan.queries[part]]
        q = q.view(count, QUERY_ROWS, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(count, kv_heads, 1, groups * QUERY_ROWS, dim)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling  # [U, H_kv, chunks, g * Q, C]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(count, kv_heads, chunks, groups, QUERY_ROWS, KEY_CHUNK)
        unseen = ~sees.view(count, QUERY_ROWS, chunks, KEY_CHUNK).transpose(1, 2)[:, None, :, None]
        scores = scores.masked_fill(unseen, -torch.inf)
        weights = torch.exp(scores - scores.amax(dim=(2, 5), keepdim=True))
        totals = weights.sum(-1)  # [U, H_kv, chunks, g, Q]
        weighted = torch.matmul(weights.view(count, kv_heads, chunks, groups * QUERY_ROWS, KEY_CHUNK).to(v.dtype), v)
        numerator, denominator = weighted[:, :, 0], totals[:, :, 0]
        for chunk in range(1, chunks):  # chunk after chunk, in order
            numerator = numerator + weighted[:, :, chunk]
            denominator = denominator + totals[:, :, chunk]
        result = (numerator.view(count, kv_heads, groups, QUERY_ROWS, dim)
                  / denominator.to(numerator.dtype).unsqueeze(-1))
        result = result.permute(0, 3, 1, 2, 4).reshape(count, QUERY_ROWS, heads, dim)  # [U, Q, H, D]
        real = plan.real[part]
        out[rows.unsqueeze(1).expand(-1, QUERY_ROWS)[real], plan.queries[part][real]] = result[real].to(out.dtype)
    return out, None
