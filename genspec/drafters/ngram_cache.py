"""N-gram cache drafting (llama.cpp's ``lookup`` caches): propose the *most frequent* continuation
of the last n-gram, several tokens ahead, from three tables.

- context: the row's own tokens (prompt and output) of this request;
- process: every token generated in this process so far, by any request and any drafter instance
  (a module-level store per tokenizer, so what one request generated helps the next: repeated
  questions, templates, code boilerplate);
- static: an optional corpus file, tokenised once with the target's tokenizer (or a
  ``genspec index build`` directory, whose tokens are reused as they are).

Why most frequent rather than most recent (prompt lookup): in a table pooled over many texts the
most recent occurrence is an accident, the most frequent one is the best guess. A continuation is
used only if it is frequent enough (``min_count``) and dominant enough (``min_ratio`` of the
n-gram's occurrences); longer n-grams are tried first, then context before process before static.
Drafts are deterministic (``probs=None``), so the engine verifies them losslessly.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from genspec.datastore import SEPARATOR, corpus_tokens
from genspec.drafters.base import PATH, Option, RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngrams import (MAX_NGRAM_OPTION, MIN_NGRAM_OPTION, check_ngram_range, common_prefix_length,
                                     hash_columns, hash_ngram)
from genspec.errors import InputFileError

#: the longest n-gram counted by default
DEFAULT_MAX_NGRAM = 4
#: the largest process table ``max_entries`` may ask for: an entry (an n-gram and its counts) holds a few hundred
#: bytes in Python's dicts, so about 4 GB when full
MAX_ENTRIES = 10_000_000


class CountTable:
    """Counts of ``n-gram -> next token`` for ``min_n <= n <= max_n`` with the leader kept per n-gram.

    ``entries[ngram] = [best_token, best_count, total, {token: count}]``; occurrences can be added
    and removed (a row rolled back), and a table stops taking *new* n-grams at ``max_entries``.
    """

    def __init__(self, min_n: int, max_n: int, max_entries: int | None = None):
        self.min_n, self.max_n = min_n, max_n
        self.max_entries = max_entries
        self.entries: dict[tuple[int, ...], list] = {}
        self.lock = threading.Lock()

    def add(self, tokens: list[int], start: int, end: int) -> None:
        """Count the n-grams before each position ``j`` in ``[start, end)`` as followed by ``tokens[j]``."""
        with self.lock:
            for j in range(max(start, 1), end):
                for n in range(self.min_n, min(self.max_n, j) + 1):
                    self._count(tuple(tokens[j - n:j]), tokens[j], +1)

    def remove(self, tokens: list[int], start: int, end: int) -> None:
        """Undo :meth:`add` for the positions in ``[start, end)``."""
        with self.lock:
            for j in range(max(start, 1), end):
                for n in range(self.min_n, min(self.max_n, j) + 1):
                    self._count(tuple(tokens[j - n:j]), tokens[j], -1)

    def _count(self, key: tuple[int, ...], token: int, delta: int) -> None:
        entry = self.entries.get(key)
        if entry is None:
            if delta < 0 or (self.max_entries is not None and len(self.entries) >= self.max_entries):
                return
            entry = self.entries[key] = [token, 0, 0, {}]
        counts = entry[3]
        if delta < 0 and token not in counts:
            return  # never counted (the table was full when it was seen)
        counts[token] = counts.get(token, 0) + delta
        entry[2] += delta
        if counts[token] <= 0:
            del counts[token]
        if not counts:
            del self.entries[key]
        elif delta > 0 and (token == entry[0] or counts[token] > entry[1]):
            entry[0], entry[1] = token, counts[token]
        elif delta < 0 and token == entry[0]:
            entry[0] = max(counts, key=counts.get)
            entry[1] = counts[entry[0]]

    def best(self, key: tuple[int, ...]) -> tuple[int, int, int] | None:
        """``(token, count, total)`` of the most frequent continuation of ``key``, or None."""
        entry = self.entries.get(key)
        return None if entry is None else (entry[0], entry[1], entry[2])

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)


class StaticTable:
    """Counts of ``n-gram -> next token`` over a fixed token array, built with numpy and kept as
    sorted hashed keys per n (``np.searchsorted`` looks them up): millions of corpus tokens fit in a
    few arrays instead of millions of Python objects. A hash collision only costs a wrong draft."""

    def __init__(self, tokens: np.ndarray, min_n: int, max_n: int, separator: int | None = None):
        self.min_n, self.max_n = min_n, max_n
        self.tables = {n: self._build(np.asarray(tokens, dtype=np.int64), n, separator)
                       for n in range(min_n, max_n + 1)}

    def _build(self, tokens: np.ndarray, n: int, separator: int | None):
        if len(tokens) <= n:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        count = len(tokens) - n
        columns = [tokens[i:i + count] for i in range(n)]
        following = tokens[n:]
        ok = np.ones(count, dtype=bool)
        if separator is not None:  # no n-gram across a document boundary
            for column in columns + [following]:
                ok &= column != separator
        keys, following = hash_columns(columns)[ok], following[ok]
        order = np.lexsort((following, keys))
        keys, following = keys[order], following[order]
        # runs of equal (key, next token): their counts
        new_pair = np.ones(len(keys), dtype=bool)
        new_pair[1:] = (keys[1:] != keys[:-1]) | (following[1:] != following[:-1])
        pair_start = np.flatnonzero(new_pair)
        pair_count = np.diff(np.append(pair_start, len(keys)))
        pair_key, pair_next = keys[pair_start], following[pair_start]
        # per key: the most frequent next token and the total
        new_key = np.ones(len(pair_key), dtype=bool)
        new_key[1:] = pair_key[1:] != pair_key[:-1]
        key_start = np.flatnonzero(new_key)
        totals = np.add.reduceat(pair_count, key_start) if len(key_start) else np.zeros(0, np.int64)
        group = np.cumsum(new_key) - 1
        rank = np.lexsort((-pair_count, group))  # within each key, the largest count first
        leader = rank[np.searchsorted(group[rank], np.arange(len(key_start)))]
        return pair_key[key_start], pair_next[leader], pair_count[leader], totals

    def best(self, key: tuple[int, ...]) -> tuple[int, int, int] | None:
        table = self.tables.get(len(key))
        if table is None or not len(table[0]):
            return None
        hashed = np.uint64(hash_ngram(key))
        at = int(np.searchsorted(table[0], hashed))
        if at == len(table[0]) or table[0][at] != hashed:
            return None
        return int(table[1][at]), int(table[2][at]), int(table[3][at])


#: process-wide tables of generated text, one per tokenizer (namespace)
_PROCESS_TABLES: dict[str, CountTable] = {}
_PROCESS_LOCK = threading.Lock()
#: static tables already built, by (path, size, mtime, namespace, n range)
_STATIC_TABLES: dict[tuple, StaticTable] = {}


def process_table(namespace: str, min_n: int, max_n: int, max_entries: int) -> CountTable:
    """The table of everything generated in this process with the tokenizer ``namespace``."""
    with _PROCESS_LOCK:
        table = _PROCESS_TABLES.get(namespace)
        if table is None or (table.min_n, table.max_n) != (min_n, max_n):
            table = _PROCESS_TABLES[namespace] = CountTable(min_n, max_n, max_entries)
        return table


def clear_process_tables() -> None:
    """Forget what every request so far generated (tests, benchmark repeats, or to free memory).
    Tables are emptied in place: drafters built earlier hold them and must forget too."""
    with _PROCESS_LOCK:
        for table in _PROCESS_TABLES.values():
            table.clear()


def tokenizer_namespace(target) -> str:
    """A process table per tokenizer: token ids mean nothing across tokenizers."""
    tokenizer = target.tokenizer
    if tokenizer is None:
        return f"vocab-{target.vocab_size}"
    return f"{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}"


def static_table(corpus: str | Path, tokenizer, min_n: int, max_n: int, namespace: str) -> StaticTable:
    """The static table of a corpus file (or directory), built once per process."""
    path = Path(corpus)
    try:
        stat = path.stat()
    except OSError as exc:
        raise InputFileError(f"n-gram cache corpus not found: {corpus}") from exc
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, namespace, min_n, max_n)
    if key not in _STATIC_TABLES:
        _STATIC_TABLES[key] = StaticTable(corpus_tokens(path, tokenizer), min_n, max_n, SEPARATOR)
    return _STATIC_TABLES[key]


class NGramCacheDrafter(CandidateDrafter):
    """Most-frequent-continuation drafting from the context, process and static n-gram tables.

    Options: ``min_ngram`` / ``max_ngram`` the n-gram sizes (longest first); ``min_count`` and
    ``min_ratio`` how frequent and how dominant a continuation must be; ``learn`` whether this
    drafter's requests feed the process table; ``namespace`` the process table to use (one per
    tokenizer); ``static`` a prebuilt :class:`StaticTable`; ``max_entries`` the process table's cap.
    Evidence: the n-gram length behind the draft's first token (0: no draft).
    """

    name = "ngram-cache"
    # its factory takes neither num_candidates (one chain) nor renumber: not CandidateDrafter's options
    options = (Option("corpus", (*PATH, None)), MIN_NGRAM_OPTION, MAX_NGRAM_OPTION, Option("min_count", int, 1),
               Option("min_ratio", float, 0.0, 1.0), Option("learn", bool), Option("namespace", (str, None)),
               Option("static", (StaticTable, None)), Option("max_entries", int, 1, MAX_ENTRIES))

    def __init__(self, min_ngram: int = 1, max_ngram: int = DEFAULT_MAX_NGRAM, min_count: int = 1,
                 min_ratio: float = 0.3, learn: bool = True, namespace: str = "default",
                 static: StaticTable | None = None, max_entries: int = 2_000_000):
        self.check_options({"min_ngram": min_ngram, "max_ngram": max_ngram, "min_count": min_count,
                            "min_ratio": min_ratio, "learn": learn, "namespace": namespace, "static": static,
                            "max_entries": max_entries})
        super().__init__()
        self.min_ngram, self.max_ngram = int(min_ngram), int(max_ngram)
        self.min_count, self.min_ratio = int(min_count), float(min_ratio)
        self.learn = learn
        self.process = process_table(namespace, self.min_ngram, self.max_ngram, int(max_entries))
        self.static = static

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        super().check_options(options, owner)
        check_ngram_range(options.get("min_ngram", 1), options.get("max_ngram", DEFAULT_MAX_NGRAM), "the n-gram cache")

    @classmethod
    def for_target(cls, target, corpus: str | None = None, namespace: str | None = None,
                   **options) -> "NGramCacheDrafter":
        """The registry's factory: the process table of ``target``'s tokenizer, and the static table
        of ``corpus`` (a text file, a directory of .txt/.jsonl, or a ``genspec index build`` output)."""
        namespace = namespace or tokenizer_namespace(target)
        drafter = cls(namespace=namespace, **options)
        if corpus is not None:
            drafter.static = static_table(corpus, target.tokenizer, drafter.min_ngram, drafter.max_ngram, namespace)
        return drafter

    def new_row(self, context: RequestContext) -> dict:
        return {"tokens": [], "prompt_length": len(context.prompt),
                "context": CountTable(self.min_ngram, self.max_ngram)}

    def _sync(self, row: dict, sequence: list[int]) -> None:
        """Bring the row's tables to ``sequence``: un-count a changed tail, count the new tokens.
        Only generated positions (after the prompt) go to the process table."""
        held = row["tokens"]
        keep = common_prefix_length(held, sequence)
        first_generated = row["prompt_length"]
        if keep < len(held):
            row["context"].remove(held, keep, len(held))
            if self.learn:
                self.process.remove(held, max(keep, first_generated), len(held))
            del held[keep:]
        start = len(held)
        held.extend(sequence[start:])
        row["context"].add(held, start, len(held))
        if self.learn:
            self.process.add(held, max(start, first_generated), len(held))

    def _next_token(self, row: dict, tail: list[int]) -> tuple[int, int] | None:
        """The most frequent continuation of the longest n-gram of ``tail`` found, with that n."""
        tables = [row["context"], self.process] + ([self.static] if self.static is not None else [])
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            key = tuple(tail[len(tail) - n:])
            for table in tables:
                found = table.best(key)
                if found is not None and found[1] >= self.min_count and found[1] >= self.min_ratio * found[2]:
                    return found[0], n
        return None

    def candidates(self, row: dict, sequence: list[int], limit: int) -> tuple[list[list[int]], int]:
        """One chain, built a token at a time, and its evidence (the n-gram length behind its first token)."""
        self._sync(row, sequence)
        tail, draft, evidence = row["tokens"][-self.max_ngram:], [], 0
        while len(draft) < limit:
            found = self._next_token(row, tail)
            if found is None:
                break
            token, n = found
            evidence = evidence or n
            draft.append(token)
            tail = tail[1:] + [token] if len(tail) == self.max_ngram else tail + [token]
        return ([draft] if draft else []), evidence
