"""Numbered lists for the lookup drafters: the next item gets the next number.

A lookup drafter copies what followed an earlier occurrence of the current context. In a numbered list
that copy is right about the item's text and wrong about its number: after ``"15.\\n"`` the longest match
is ``"5.\\n"``, followed by ``"6.\\n7.\\n"``, and the target writes ``"16.\\n17.\\n"``. On the embedded model
(Gemma 3 270M, greedy) such lists are common answers: writing's 3rd Spec-Bench prompt is a bare count
``"\\n1.\\n2.\\n3. ..."`` and rag's 2nd a list of three names in no fixed order, where lookup drafts stop at
every number. :class:`Enumeration` rewrites, in a lookup's chain, the number of each item that starts a
line as the number after the last item the sequence wrote (same delimiter: ``.``, ``)`` or ``:``), and
finishes a number the sequence has begun (``"\\n1"`` -> ``"6."``). It is only a draft: the target still
checks every token, so a list that does not count (nested lists starting over, years at line starts)
costs a rejected token, as the copy it replaces would have.

Only for tokenizers that write each digit as one token, as Gemma's does (checked by encoding
``"0123456789"``): elsewhere :meth:`Enumeration.of_tokenizer` returns None and chains are left as found.
"""
from __future__ import annotations

from typing import Callable

#: item delimiters: the token after an item's number (stripped of spaces)
DELIMITERS = frozenset({".", ")", ":"})
#: how far back (tokens) the last item is looked for
SCAN = 512
#: longest item number read, in digits
MAX_DIGITS = 6


class Enumeration:
    """Renumbers the items of lookup chains (module docstring). ``digit_ids[d]``: the token of digit d;
    ``decode``: one token's text (for line ends and delimiters, read lazily and cached)."""

    def __init__(self, digit_ids: list[int], decode: Callable[[int], str]):
        if len(digit_ids) != 10 or len(set(digit_ids)) != 10:
            raise ValueError("digit_ids must be the ten distinct tokens of the digits 0-9")
        self.digit_ids = list(digit_ids)
        self.digit_of = {token: digit for digit, token in enumerate(digit_ids)}
        self._decode = decode
        self._line_end: dict[int, bool] = {}
        self._delimiter: dict[int, bool] = {}

    @classmethod
    def of_tokenizer(cls, tokenizer) -> "Enumeration | None":
        """The enumeration of a Hugging Face tokenizer, or None when it does not write digits one token each
        (or there is no tokenizer)."""
        if tokenizer is None:
            return None
        ids = [tokenizer.convert_tokens_to_ids(str(digit)) for digit in range(10)]
        if any(not isinstance(i, int) for i in ids) or len(set(ids)) != 10:
            return None
        if list(tokenizer("0123456789", add_special_tokens=False)["input_ids"]) != ids:
            return None
        return cls(ids, lambda token: tokenizer.decode([token]))

    # ------------------------------------------------------------------ token classes
    def ends_line(self, token: int) -> bool:
        if token not in self._line_end:
            self._line_end[token] = self._decode(token).endswith("\n")
        return self._line_end[token]

    def is_delimiter(self, token: int) -> bool:
        if token not in self._delimiter:
            self._delimiter[token] = self._decode(token).strip() in DELIMITERS
        return self._delimiter[token]

    def _number(self, tokens: list[int]) -> int:
        return int("".join(str(self.digit_of[t]) for t in tokens))

    def _digits(self, number: int) -> list[int]:
        return [self.digit_ids[int(c)] for c in str(number)]

    # ------------------------------------------------------------------ the rewrite
    def last_item(self, sequence: list[int]) -> tuple[int, int] | None:
        """(number, delimiter token) of the last complete item in ``sequence``: a line starting with at most
        :data:`MAX_DIGITS` digits and a delimiter; None if none in the last :data:`SCAN` tokens."""
        low = max(0, len(sequence) - SCAN)
        i = len(sequence) - 1
        while i > low:
            token = sequence[i]
            if token not in self.digit_of and sequence[i - 1] in self.digit_of and self.is_delimiter(token):
                j = i - 1
                while j >= low and sequence[j] in self.digit_of:
                    j -= 1
                if j >= low and i - 1 - j <= MAX_DIGITS and self.ends_line(sequence[j]):
                    return self._number(sequence[j + 1:i]), token
                i = j + 1
            i -= 1
        return None

    def renumber(self, sequence: list[int], chains: list[list[int]]) -> list[list[int]]:
        """``chains`` (drafts continuing ``sequence``) with each item number starting a line replaced by the
        number after the previous item's; unchanged where there is no earlier item or no such number. The
        sequence is read once for all chains."""
        start = len(sequence)
        while start > 0 and sequence[start - 1] in self.digit_of:
            start -= 1
        if start == len(sequence) and not any(t in self.digit_of for chain in chains for t in chain):
            return chains  # the common case: no digits drafted, no number being written
        last = self.last_item(sequence)
        if last is None:
            return chains
        # the digits of an item number the sequence has begun ("" at a line start; None: not in one)
        written = None
        if 0 < start and self.ends_line(sequence[start - 1]) and len(sequence) - start <= MAX_DIGITS:
            written = "".join(str(self.digit_of[t]) for t in sequence[start:])
        return [self._rewrite(chain, *last, written) for chain in chains]

    def _rewrite(self, chain: list[int], number: int, delimiter: int, written: str | None) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(chain):
            if written is not None:
                j = i
                while j < len(chain) and chain[j] in self.digit_of:
                    j += 1
                expected = str(number + 1)
                if (j > i or written) and (j == len(chain) or chain[j] == delimiter) and expected.startswith(written):
                    out.extend(self._digits(number + 1)[len(written):])
                    number += 1
                    i = j
                written = None
                continue
            out.append(chain[i])
            if self.ends_line(chain[i]):
                written = ""
            i += 1
        return out
