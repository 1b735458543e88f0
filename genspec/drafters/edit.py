"""Aggressive decoding for edits (Sun et al. 2021; Ge et al. 2022): when the output is mostly a copy
of an input text (grammar correction, rewriting, code edits), the input itself is the draft.

The drafter keeps, per row, a pointer into the source: the source position the output is copying.
While the output keeps agreeing with the source the pointer just advances and the next ``k`` source
tokens are the draft. After a mismatch (the target wrote something else: an insertion, a deletion, a
substitution) the drafter re-aligns. It remembers the *anchor* (the source position after the last
token the output copied) and how many tokens the output wrote since; the output rejoins the source
somewhere in ``[anchor, anchor + written]`` (an insertion rejoins at the anchor, a substitution of
equal length at the far end, a deletion a little after). It looks the output's last n tokens up in
the source, longest n first, and takes the occurrence nearest to that interval; a short n-gram is a
weak clue, so it may only be ``window * 4 ** (n - far_ngram)`` tokens outside (n = 1: inside), while
n-grams of ``far_ngram`` tokens or more may jump anywhere. No clue: guess a substitution (continue
at ``anchor + written``). Drafts are deterministic (``probs=None``), so verification is lossless.

Without a source the row's prompt is the source (the text to rewrite is usually in the prompt);
the pointer then starts unknown and is found from the first generated tokens.

An output does not only copy its source: it may repeat itself (a list, a second draft of the text, a
base model looping). So the drafter also looks the last tokens up in the whole sequence, as prompt lookup
does, and drafts from there when that match is longer than the clue that placed the source pointer
(a continuing copy of the source always wins). On the grammar-correction prompts of
``genspec bench --categories edit`` the source alignment alone drafted worse than prompt lookup
(mean accepted length 2.07 vs 2.94) because Gemma 3 270M repeats its corrected paragraph.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from genspec.drafters.base import PATH, DrafterCapabilities, Option, RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngrams import (MAX_NGRAM, MAX_NGRAM_OPTION, MIN_NGRAM_OPTION, NGramIndex, check_ngram_range,
                                     copy_forward)
from genspec.errors import ConfigError
from genspec.textfiles import read_utf8_text

_END = -1  # appended to the indexed source so that an n-gram at its very end has a position too
_COPYING = 1 << 30  # clue length while the output keeps copying the source along the pointer
#: the longest n-gram re-aligned with by default
DEFAULT_MAX_NGRAM = 6
#: the largest ``window`` an option may ask for: a distance in tokens, and beyond any text's length the same as
#: anywhere
MAX_WINDOW = 1_000_000
#: a request's own edit source: text (tokenised with the model's tokenizer) or token ids
SOURCE = Option("source", (str, list, None), item=int, low=0)
#: the source of every request (a factory option; token ids must also be in the target's vocabulary)
EDIT_SOURCE = replace(SOURCE, name="edit_source")


@dataclass
class _Row:
    """Alignment of one output row to its source."""

    source: list[int]
    index: NGramIndex
    prompt_length: int
    pointers: list[int] = field(default_factory=list)  # source positions drafted from last time, best first
    seen: int | None = None  # sequence length at the last propose
    anchor: int | None = None  # source position after the last token the output copied
    written: int = 0  # output tokens since the anchor
    clue: int = 0  # length of the n-gram that placed the pointer (a large number while copying along)
    sequence_index: NGramIndex | None = None  # the whole sequence, for self-repeats


def read_source_file(path: str | Path) -> str:
    """The text of an ``--edit-source`` file (UTF-8)."""
    return read_utf8_text(path, "edit source file")


class EditDrafter(CandidateDrafter):
    """Input-guided aggressive decoding with re-alignment.

    ``source``: the token ids to align to, for every request (None: each request's prompt). A request
    may bring its own with the per-request option ``source`` (token ids, or text when the drafter has
    a ``tokenizer``). Options: ``max_ngram`` / ``min_ngram`` n-gram sizes used to re-align;
    ``far_ngram`` the shortest n-gram allowed to re-align farther than ``window`` tokens from the
    expected position; ``num_candidates`` > 1 adds, after a mismatch, other alignments (other matches;
    insertion, deletion, substitution guesses) as a tree.
    Evidence: the n-gram length that placed the pointer (``max_ngram + 1`` while copying the source).
    """

    name = "edit"
    capabilities = DrafterCapabilities(free=True, request_options=(SOURCE,))
    options = CandidateDrafter.options + (
        EDIT_SOURCE, Option("edit_source_file", (*PATH, None)), MAX_NGRAM_OPTION, MIN_NGRAM_OPTION,
        Option("far_ngram", int, 1, MAX_NGRAM), Option("window", int, 0, MAX_WINDOW))

    def __init__(self, source: list[int] | None = None, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1,
                 far_ngram: int = 4, window: int = 32, num_candidates: int = 1, tokenizer=None):
        self.check_options({"max_ngram": max_ngram, "min_ngram": min_ngram, "far_ngram": far_ngram, "window": window})
        super().__init__(num_candidates)
        self.tokenizer = tokenizer
        self.source = _as_token_ids(source, tokenizer)
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.far_ngram, self.window = int(far_ngram), int(window)
        self._shared_index: NGramIndex | None = None

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        super().check_options(options, owner)
        check_ngram_range(options.get("min_ngram", 1), options.get("max_ngram", DEFAULT_MAX_NGRAM), "edit re-alignment")
        if options.get("edit_source") is not None and options.get("edit_source_file") is not None:
            raise ConfigError("give the edit source as text or as a file, not both")

    @classmethod
    def for_target(cls, target, edit_source: str | list | None = None, edit_source_file: str | None = None,
                   **options) -> "EditDrafter":
        """The registry's factory. ``edit_source``: text (tokenised with ``target``'s tokenizer) or token
        ids; ``edit_source_file``: a UTF-8 file with the text."""
        if edit_source_file is not None:
            if edit_source is not None:
                raise ConfigError("give the edit source as text or as a file, not both")
            edit_source = read_source_file(edit_source_file)
        EDIT_SOURCE.check(edit_source, f"drafter {cls.name!r}")
        outside = [t for t in edit_source if t >= target.vocab_size] if isinstance(edit_source, (list, tuple)) else []
        if outside:
            raise ConfigError(f"edit source token id {outside[0]} is not in the model's vocabulary "
                              f"[0, {target.vocab_size})")
        # the source is the text being rewritten, its numbers included: not renumbered unless asked
        options.setdefault("renumber", False)
        return super().for_target(target, source=edit_source, tokenizer=target.tokenizer, **options)

    def new_row(self, context: RequestContext) -> _Row:
        own = _as_token_ids(context.options.get("source"), self.tokenizer)
        source = own if own is not None else self.source
        row = _Row(list(source) if source is not None else list(context.prompt),
                   self._index(source if source is not None else context.prompt, shared=own is None and source is not None),
                   len(context.prompt))
        if source is not None:  # the output starts by copying the source's beginning
            row.pointers, row.seen, row.anchor = [0], len(context.prompt), 0
        return row

    def _index(self, source: list[int], shared: bool) -> NGramIndex:
        """The source's n-gram index (one for all requests when they share the source: it is read-only)."""
        if shared and self._shared_index is not None:
            return self._shared_index
        index = NGramIndex(self.min_ngram, self.max_ngram)
        index.sync(list(source) + [_END])
        if shared:
            self._shared_index = index
        return index

    # ------------------------------------------------------------------ alignment
    def _locate(self, row: _Row, sequence: list[int]) -> list[int]:
        """Source positions to draft from, best first."""
        if row.seen is None or len(sequence) < row.seen:
            row.anchor, row.written = None, 0
            return self._realign(row, sequence)
        new = sequence[row.seen:]
        for pointer in row.pointers:  # still copying along one of last step's alignments?
            if row.source[pointer:pointer + len(new)] == new:
                row.anchor, row.written, row.clue = pointer + len(new), 0, _COPYING
                return [row.anchor]
        if row.pointers:  # the first tokens may still have agreed: the anchor moves up to the mismatch
            agreed = _common_prefix(row.source, row.pointers[0], new)
            if agreed:
                row.anchor, row.written = row.pointers[0] + agreed, 0
            new = new[agreed:]
        row.written += len(new)
        return self._realign(row, sequence)

    def _realign(self, row: _Row, sequence: list[int]) -> list[int]:
        """Where the output rejoins the source, best first: after the occurrence of its last n tokens
        (longest n first) nearest to ``[anchor, anchor + written]``, then the edit guesses."""
        output = sequence[row.prompt_length:]
        found = []
        row.clue = 0
        for n in range(min(self.max_ngram, len(output)), self.min_ngram - 1, -1):
            ends = row.index.positions.get(tuple(output[len(output) - n:]))
            if not ends:
                continue
            if row.anchor is None:  # no alignment yet: the most recent occurrence (prompt lookup)
                found.append(ends[-1])
                row.clue = max(row.clue, n)
                continue
            low, high = row.anchor, row.anchor + row.written
            nearest = min(_nearest(ends, low), _nearest(ends, high), key=lambda p: _outside(p, low, high))
            if n >= self.far_ngram or _outside(nearest, low, high) <= self.window * 4.0 ** (n - self.far_ngram):
                found.append(nearest)
                row.clue = max(row.clue, n)
        if row.anchor is not None:  # substitution, insertion, deletion of one more token
            guesses = (row.anchor + row.written, row.anchor, row.anchor + row.written + 1)
            found += [p for p in guesses if 0 <= p < len(row.source)]
        return list(dict.fromkeys(found))

    def candidates(self, row: _Row, sequence: list[int], limit: int) -> tuple[list[list[int]], int]:
        """Candidate chains and the evidence behind the first: the n-gram length that placed it
        (``max_ngram + 1`` while the output keeps copying the source)."""
        pointers = self._locate(row, sequence)
        chains, chosen = [], []
        for pointer in pointers:  # one chain per distinct next token (tree branches must differ)
            chain = row.source[pointer:pointer + limit]
            if chain and all(chain[0] != c[0] for c in chains):
                chains.append(chain)
                chosen.append(pointer)
                if len(chains) == self.num_candidates:
                    break
        row.pointers = chosen or pointers[:1]
        row.seen = len(sequence)
        evidence = min(row.clue, self.max_ngram + 1) if chains else 0
        repeat, n = self._self_repeat(row, sequence, limit)
        if repeat:  # a longer match than the source clue: draft it first (drop a source chain it shadows)
            chains = [repeat] + [c for c in chains if c[0] != repeat[0]][:self.num_candidates - 1]
            evidence = n
        return chains, evidence

    def _self_repeat(self, row: _Row, sequence: list[int], limit: int) -> tuple[list[int], int]:
        """What followed the latest earlier occurrence of the sequence's last n tokens (n >= 2) in the
        sequence itself, when that match is longer than the source clue, and n; else nothing."""
        if row.clue >= _COPYING:
            return [], 0
        if row.sequence_index is None:
            row.sequence_index = NGramIndex(2, self.max_ngram)
        index = row.sequence_index
        index.sync(sequence)
        for n in range(self.max_ngram, max(row.clue, 1), -1):
            matches = index.matches(n)
            if matches:
                return copy_forward(index.tokens, matches[-1], limit), n
        return [], 0


def _as_token_ids(source, tokenizer) -> list[int] | None:
    """Token ids of an edit source given as text or as ids."""
    if source is None:
        return None
    if isinstance(source, str):
        if tokenizer is None:
            raise ConfigError("a text edit source needs the model's tokenizer; pass token ids instead")
        return list(tokenizer(source, add_special_tokens=False)["input_ids"])
    if isinstance(source, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in source):
        return list(source)
    raise ConfigError("edit source must be text or a list of token ids")


def _common_prefix(source: list[int], start: int, tokens: list[int]) -> int:
    n = 0
    while n < len(tokens) and start + n < len(source) and source[start + n] == tokens[n]:
        n += 1
    return n


def _outside(position: int, low: int, high: int) -> int:
    """Distance from ``position`` to the interval ``[low, high]`` (0 inside)."""
    return max(low - position, position - high, 0)


def _nearest(sorted_positions: list[int], target: int) -> int:
    at = bisect_left(sorted_positions, target)
    if at == 0:
        return sorted_positions[0]
    if at == len(sorted_positions):
        return sorted_positions[-1]
    before, after = sorted_positions[at - 1], sorted_positions[at]
    return before if target - before <= after - target else after
