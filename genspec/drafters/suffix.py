"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024, as in Arctic Inference and vLLM): draft what
followed the longest suffix of the sequence, in the request itself and in every earlier request of the
process, as a tree of the most frequent continuations.

Two stores of tokens, both :class:`SuffixCache`:

- the request's own: its prompt and output, extended with the tokens committed at every step;
- the process's: the prompt and output of every request that finished in this process (one per tokenizer
  namespace, like the n-gram cache's process table), bounded by a cap in tokens, the oldest requests
  evicted first (FIFO).

A proposal finds the longest suffix of the sequence (at most ``max_match`` tokens) that occurred in either
store; the occurrences of that suffix (in both stores when they match equally long) are the evidence, and
what followed each one is a vote: a continuation's probability is the share of occurrences it follows
(SuffixDecoding's frequency scores). The draft tree takes the most likely nodes first (best-first on that
probability) while a node's probability is at least ``min_prob``, up to ``max_nodes`` nodes and
``num_candidates`` leaves; its depth is at most ``factor`` x the match length (a long match is long
evidence: SuffixDecoding's match-proportional draft length). The evidence reported to the draft-length
policy is the match length (bucketed), so the cost policy learns acceptance per match length. Proposals
are deterministic (point-mass drafts), so the engine verifies them losslessly.

Why hash chains and not a suffix tree: a Python suffix tree or a depth-capped trie of a 1 M-token cache is
tens of millions of Python objects. :class:`SuffixCache` keeps tokens in a numpy ring buffer and, per
anchor length a (1, 4 and 12 tokens), LZ77's hash chains: ``head[hash(a tokens)]`` is the latest position
after those tokens and ``prev[position]`` the one before it with the same hash. Appending is O(anchors)
vectorised, evicting the oldest request is O(1) (positions are global and only grow: a chain ends where
it reaches an evicted position), and a lookup walks at most ``max_scan`` positions of one chain (the most
recent occurrences first) and extends each match with one numpy comparison. The manual's Lookup page
(SuffixDecoding) has what a 1 M-token cache costs.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from genspec.drafters.base import MAX_CANDIDATES, MAX_TREE_NODES, DrafterCapabilities, Option, RequestContext
from genspec.drafters.candidates import CandidateDrafter
from genspec.drafters.ngram_cache import tokenizer_namespace
from genspec.drafters.ngrams import MAX_SCAN, common_prefix_length, hash_columns, hash_ngram
from genspec.errors import ConfigError

#: token value of a document boundary in a :class:`SuffixCache` (never a real token, never matched)
BOUNDARY = -1
#: anchor lengths of the hash chains: a lookup tries the longest anchor the sequence's suffix has first
ANCHORS = (12, 4, 1)
#: the draft tree's node budget: as deep as the drafter's own depth (24), so a repeating answer, where every
#: occurrence agrees, is drafted as one chain that deep and the cost policy decides how much of it pays (a
#: budget of 12 stops such chains at 12 tokens, all kept, step after step: the small model loops often). On the
#: prompts no run measures the suffix hybrid is faster with 24 than with 12, greedy and sampled (the manual's
#: Hybrid page, how the defaults were chosen)
DEFAULT_MAX_NODES = 24
#: evidence levels: a match of m tokens is reported as the largest of these that is <= m
MATCH_LEVELS = (1, 2, 3, 4, 6, 9, 16)
#: the longest suffix ``max_match`` may ask for (a lookup compares that many tokens per occurrence read)
MAX_MATCH = 1024
#: the largest process cache ``cache_tokens`` may ask for: 28 bytes a token (its int32 tokens and one int64 chain
#: link per anchor), so about 2.8 GB when full
MAX_CACHE_TOKENS = 100_000_000
#: the largest draft depth per matched token ``factor`` may ask for (the draft's depth is also at most k)
MAX_FACTOR = 64.0


def match_level(length: int) -> int:
    """The evidence level of a match of ``length`` tokens (0: no match)."""
    level = 0
    for bound in MATCH_LEVELS:
        if length >= bound:
            level = bound
    return level


class SuffixCache:
    """Documents of tokens, searchable for the longest match of a sequence's suffix and what followed it.

    Storage: ``tokens`` ``[capacity]`` (int32 ring buffer, :data:`BOUNDARY` before each document but the
    first), and per anchor length a of :data:`ANCHORS` the hash chains ``head[a]`` ``[2^bits]`` and
    ``prev[a]`` ``[capacity]`` (int64 positions). Positions are global offsets that only grow; the live
    ones are ``[start, end)``, stored at ``offset % capacity``. Position j is chained under the hash of
    ``tokens[j - a:j]`` (the a tokens before it), so every chained position has a continuation.

    ``max_tokens`` None: the cache grows without bound (a request's own text). Otherwise it grows up to
    ``max_tokens`` and then evicts whole documents, oldest first, to make room (a document longer than
    the cap keeps its last tokens). Not thread-safe: :class:`SuffixDrafter` locks the process caches.
    """

    def __init__(self, max_tokens: int | None = None, table_bits: int | None = None, initial: int = 1024):
        if max_tokens is not None and (int(max_tokens) != max_tokens or max_tokens < 16):
            raise ConfigError(f"the suffix cache's size must be an integer >= 16 tokens, got {max_tokens}")
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        if table_bits is None:  # about one bucket per token of the cap (2^20 for 1 M), at least 2^10
            table_bits = min(22, max(10, int(np.ceil(np.log2(self.max_tokens or initial)))))
        self.bits = int(table_bits)
        self.initial = initial
        self.clear()

    def clear(self) -> None:
        """Forget every document (and give the memory back)."""
        self.capacity = self.initial if self.max_tokens is None else min(self.initial, self.max_tokens)
        self.tokens = np.full(self.capacity, BOUNDARY, dtype=np.int32)
        self.prev = [np.full(self.capacity, -1, dtype=np.int64) for _ in ANCHORS]
        self.head = [np.full(1 << self.bits, -1, dtype=np.int64) for _ in ANCHORS]
        self._prev_at = [memoryview(p) for p in self.prev]  # single reads: Python ints are quicker than numpy's
        self.start = 0
        self.end = 0
        self.documents: deque[tuple[int, int]] = deque()  # (first offset, end offset) per document, oldest first

    def __len__(self) -> int:
        """Live positions (tokens and document boundaries)."""
        return self.end - self.start

    def nbytes(self) -> int:
        return self.tokens.nbytes + sum(p.nbytes for p in self.prev) + sum(h.nbytes for h in self.head)

    # ---------------------------------------------------------------- writing
    def add_document(self, tokens) -> None:
        """Append a new document (a boundary first if the cache holds anything), evicting the oldest
        documents if the cap requires it."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not len(tokens):
            return
        if self.max_tokens is not None and len(tokens) + 1 > self.max_tokens:
            tokens = tokens[len(tokens) + 1 - self.max_tokens:]
        needed = len(tokens) + (1 if self.end > 0 else 0)
        self._make_room(needed)
        if self.end > 0:
            self._write(np.array([BOUNDARY]))
        self.documents.append((self.end, self.end + len(tokens)))
        self._write(tokens)

    def extend(self, tokens) -> None:
        """Append tokens to the last document (a new one if the cache is empty)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not len(tokens):
            return
        if not self.documents:
            self.add_document(tokens)
            return
        self._make_room(len(tokens))
        if not self.documents:  # the cap evicted the last document too: these tokens start a new one
            self.add_document(tokens)
            return
        first, _ = self.documents[-1]
        self.documents[-1] = (first, self.end + len(tokens))
        self._write(tokens)

    def _make_room(self, needed: int) -> None:
        live = self.end - self.start
        if live + needed > self.capacity and (self.max_tokens is None or self.capacity < self.max_tokens):
            # grow (before the first eviction, so no position has wrapped: offset == slot)
            size = max(2 * self.capacity, live + needed)
            self._grow(size if self.max_tokens is None else min(size, self.max_tokens))
        while self.end - self.start + needed > self.capacity and self.documents:  # FIFO eviction
            self.documents.popleft()
            self.start = self.documents[0][0] if self.documents else self.end
        if not self.documents:
            self.start = self.end

    def _grow(self, capacity: int) -> None:
        tokens = np.full(capacity, BOUNDARY, dtype=np.int32)
        tokens[:self.end] = self.tokens[:self.end]
        self.tokens = tokens
        for i, old in enumerate(self.prev):
            grown = np.full(capacity, -1, dtype=np.int64)
            grown[:self.end] = old[:self.end]
            self.prev[i] = grown
        self._prev_at = [memoryview(p) for p in self.prev]
        self.capacity = capacity

    def _write(self, tokens: np.ndarray) -> None:
        """Store ``tokens`` at ``[end, end + n)`` and chain the new positions under every anchor."""
        low, high = self.end, self.end + len(tokens)
        self.tokens[np.arange(low, high) % self.capacity] = tokens
        self.end = high
        for anchor, head, prev in zip(ANCHORS, self.head, self.prev):
            positions = np.arange(max(low, self.start + anchor), high)
            if not len(positions):
                continue
            columns = [self.tokens[(positions - anchor + i) % self.capacity] for i in range(anchor)]
            usable = self.tokens[positions % self.capacity] != BOUNDARY
            for column in columns:
                usable &= column != BOUNDARY
            positions = positions[usable]
            if not len(positions):
                continue
            buckets = (hash_columns([c[usable] for c in columns]) >> np.uint64(64 - self.bits)).astype(np.int64)
            order = np.argsort(buckets, kind="stable")  # positions stay increasing within a bucket
            buckets, positions = buckets[order], positions[order]
            first = np.ones(len(buckets), dtype=bool)
            first[1:] = buckets[1:] != buckets[:-1]
            last = np.ones(len(buckets), dtype=bool)
            last[:-1] = first[1:]
            links = np.empty(len(positions), dtype=np.int64)
            links[1:] = positions[:-1]
            links[first] = head[buckets[first]]
            prev[positions % self.capacity] = links
            head[buckets[last]] = positions[last]

    # ---------------------------------------------------------------- reading
    def find(self, context: list[int], max_match: int, max_scan: int) -> tuple[int, np.ndarray]:
        """``(m, positions)``: the longest suffix of ``context`` (at most ``max_match`` tokens) found
        among the ``max_scan`` most recent occurrences of its longest anchor that occurs, and the
        positions after each occurrence of that length. ``(0, [])`` if nothing matches."""
        for index, anchor in enumerate(ANCHORS):
            if len(context) < anchor or max_match < anchor:
                continue
            bucket = hash_ngram(context[len(context) - anchor:]) >> (64 - self.bits)
            found, position, prev_at = [], int(self.head[index][bucket]), self._prev_at[index]
            while position >= self.start and len(found) < max_scan:
                found.append(position)
                position = prev_at[position % self.capacity]
            if not found:
                continue
            lengths = self.match_lengths(np.array(found, dtype=np.int64), context, max_match)
            best = int(lengths.max())
            if best >= anchor:  # not just a hash collision
                return best, np.array(found, dtype=np.int64)[lengths == best]
        return 0, np.zeros(0, dtype=np.int64)

    def match_lengths(self, positions: np.ndarray, context: list[int], max_match: int) -> np.ndarray:
        """``[r]``: how many tokens before each position equal the end of ``context`` (at most ``max_match``)."""
        width = min(max_match, len(context))
        at = positions[:, None] - 1 - np.arange(width)[None, :]
        tail = np.array(context[len(context) - width:][::-1], dtype=np.int64)
        equal = (at >= self.start) & (self.tokens[at % self.capacity] == tail[None, :])
        return np.where(equal.all(axis=1), width, np.argmin(equal, axis=1))

    def continuations(self, positions: np.ndarray, depth: int, periodic: bool = False) -> np.ndarray:
        """``[r, depth]``: the tokens from each position on, -1 after a document's end. ``periodic``: a
        continuation that runs into the end of the cache repeats itself (LZ77's overlapping copy: text
        that repeats with period ``end - position`` goes on repeating), as prompt lookup does."""
        at = positions[:, None] + np.arange(depth)[None, :]
        if periodic:
            at = np.where(at < self.end, at, positions[:, None] + (at - positions[:, None]) % (self.end - positions[:, None]))
        follow = np.where(at < self.end, self.tokens[at % self.capacity], BOUNDARY).astype(np.int64)
        follow[np.cumsum(follow == BOUNDARY, axis=1) > 0] = BOUNDARY  # nothing after a boundary
        return follow


def frequency_tree(follow: np.ndarray, max_nodes: int, max_leaves: int, min_prob: float) -> list[list[int]]:
    """Draft tree of the continuations ``follow`` ``[r, D]`` (-1 = none), one vote each: the probability of
    a node is the share of rows that start with its path. Nodes are taken most probable first (ties: the
    shallower, then the smaller token id) while that probability is at least ``min_prob``, up to
    ``max_nodes`` nodes and ``max_leaves`` leaves. Returns the tree as chains (root-to-leaf paths), the
    most frequent path first (each node's most frequent child), then the others in depth-first order."""
    rows, depth = follow.shape if follow.ndim == 2 else (0, 0)
    if rows == 0 or depth == 0:
        return []
    parent, token, count, children = [-1], [-1], [rows], [[]]
    heap, tick, leaves = [], itertools.count(), 0

    def offer(node: int, members: np.ndarray, level: int) -> None:
        if level >= depth:
            return
        column = follow[members, level]
        values, counts = np.unique(column[column >= 0], return_counts=True)
        for value, votes in zip(values.tolist(), counts.tolist()):
            if votes >= min_prob * rows:
                heapq.heappush(heap, (-votes, level, value, next(tick), node, members[column == value]))

    offer(0, np.arange(rows), 0)
    while heap and len(parent) - 1 < max_nodes:
        votes, level, value, _, node, members = heapq.heappop(heap)
        new_leaf = node == 0 or bool(children[node])  # else it replaces its parent as a leaf
        if new_leaf and leaves >= max_leaves:
            continue
        leaves += new_leaf
        parent.append(node)
        token.append(value)
        count.append(-votes)
        children.append([])
        children[node].append(len(parent) - 1)
        offer(len(parent) - 1, members, level + 1)
    chains, stack = [], [(0, [])]
    while stack:  # depth-first, most frequent child first
        node, path = stack.pop()
        if node and not children[node]:
            chains.append(path)
        for child in sorted(children[node], key=lambda c: (count[c], -token[c])):  # popped in reverse
            stack.append((child, path + [token[child]]))
    return chains


# ------------------------------------------------------------------------------- process-wide caches
_PROCESS_CACHES: dict[str, SuffixCache] = {}
_PROCESS_LOCK = threading.Lock()


def process_cache(namespace: str, max_tokens: int) -> SuffixCache:
    """The suffix cache of every finished request in this process with the tokenizer ``namespace``."""
    with _PROCESS_LOCK:
        cache = _PROCESS_CACHES.get(namespace)
        if cache is None or cache.max_tokens != max_tokens:
            cache = _PROCESS_CACHES[namespace] = SuffixCache(max_tokens)
        return cache


def clear_suffix_caches() -> None:
    """Forget every earlier request (tests, benchmark repeats, or to free memory). Caches are emptied in
    place: drafters built earlier hold them and forget too."""
    with _PROCESS_LOCK:
        for cache in _PROCESS_CACHES.values():
            cache.clear()


@dataclass
class _Row:
    """A request's own suffix cache and the tokens it holds."""

    cache: SuffixCache
    tokens: list[int] = field(default_factory=list)
    sampled: bool = False


class SuffixDrafter(CandidateDrafter):
    """SuffixDecoding: frequency-scored draft trees from the request's own text and the process's
    earlier requests (module docstring).

    Options: ``num_candidates`` most leaves of the draft tree (1: a chain) for greedy requests and
    ``sampled_candidates`` for sampled ones (several continuations verified as one tree: one of them
    is likelier to be the token the target draws); ``max_nodes`` most nodes of the tree; ``min_prob``
    least share of the matched occurrences a node's path must have; ``factor`` draft depth per matched
    token (2 by default, tuned on prompts ``genspec bench`` does not measure: the manual's Lookup page; the
    cost policy already cuts a draft whose later tokens fail, so a depth cap of one token per matched token
    stopped good drafts early); ``max_match`` longest suffix matched; ``max_scan`` most recent occurrences read per lookup;
    ``cache_tokens`` the process cache's cap (FIFO eviction of whole requests); ``learn`` whether this
    drafter's finished requests go to the process cache; ``namespace`` which process cache (one per
    tokenizer by default). Evidence: the match length's level (:func:`match_level`; 0: no draft).
    """

    name = "suffix"
    #: SuffixDecoding's own depth (vLLM's ``suffix_decoding_max_tree_depth`` defaults to 24): its drafts
    #: grow with the match, so a long match is drafted far (within ``max_nodes``), and the cost policy cuts
    #: what does not pay. A shallower depth is slower on repeated traffic (the manual's Lookup page; checked on
    #: the measured prompts: a check of SuffixDecoding's default, not a tuning)
    capabilities = DrafterCapabilities(free=True, default_draft_tokens=24)
    options = CandidateDrafter.options + (
        Option("sampled_candidates", int, 1, MAX_CANDIDATES), Option("max_nodes", int, 1, MAX_TREE_NODES),
        Option("min_prob", float, 0.0, 1.0), Option("factor", float, 0.0, MAX_FACTOR, low_open=True),
        Option("max_match", int, 1, MAX_MATCH), Option("max_scan", int, 1, MAX_SCAN),
        Option("cache_tokens", int, 16, MAX_CACHE_TOKENS), Option("learn", bool), Option("namespace", (str, None)))

    def __init__(self, num_candidates: int = 2, sampled_candidates: int = 4, max_nodes: int = DEFAULT_MAX_NODES,
                 min_prob: float = 0.1, factor: float = 2.0, max_match: int = 32, max_scan: int = 256,
                 cache_tokens: int = 1_000_000, learn: bool = True, namespace: str = "default"):
        self.check_options({"num_candidates": num_candidates, "sampled_candidates": sampled_candidates,
                            "max_nodes": max_nodes, "min_prob": min_prob, "factor": factor, "max_match": max_match,
                            "max_scan": max_scan, "cache_tokens": cache_tokens, "learn": learn,
                            "namespace": namespace})
        super().__init__(max(int(num_candidates), int(sampled_candidates)))
        self.greedy_leaves, self.sampled_leaves = int(num_candidates), int(sampled_candidates)
        self.max_nodes, self.min_prob, self.factor = int(max_nodes), float(min_prob), float(factor)
        self.max_match, self.max_scan = int(max_match), int(max_scan)
        self.learn = learn
        self.cache = process_cache(namespace, int(cache_tokens))

    @classmethod
    def for_target(cls, target, namespace: str | None = None, **options) -> "SuffixDrafter":
        """The registry's factory: the process cache of ``target``'s tokenizer."""
        return super().for_target(target, namespace=namespace or tokenizer_namespace(target), **options)

    def new_row(self, context: RequestContext) -> _Row:
        bits = min(16, max(10, int(np.ceil(np.log2(2 * len(context.prompt) + 1024)))))
        return _Row(SuffixCache(None, table_bits=bits), sampled=not context.sampling.greedy)

    def finish(self, request_ids: list[int]) -> None:
        """Requests left: their prompt and output go to the process cache (the oldest are evicted)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None and self.learn and row.tokens:
                with _PROCESS_LOCK:
                    self.cache.add_document(row.tokens)

    @staticmethod
    def _sync(row: _Row, sequence: list[int]) -> None:
        """Bring the row's cache to ``sequence``: append what was committed since (rebuild after a rollback,
        which only a caller proposing on uncommitted text causes)."""
        keep = common_prefix_length(row.tokens, sequence)
        if keep < len(row.tokens):
            row.cache = SuffixCache(None, table_bits=row.cache.bits)
            row.tokens, keep = [], 0
        row.cache.extend(sequence[keep:])
        row.tokens.extend(sequence[keep:])

    def candidates(self, row: _Row, sequence: list[int], limit: int) -> tuple[list[list[int]], int]:
        self._sync(row, sequence)
        context = sequence[-self.max_match:]
        own, own_at = row.cache.find(context, self.max_match, self.max_scan)
        with _PROCESS_LOCK:
            shared, shared_at = self.cache.find(context, self.max_match, self.max_scan) if len(self.cache) else (0, None)
            length = max(own, shared)
            if length == 0:
                return [], 0
            depth = min(limit, max(1, int(self.factor * length)))
            follow = [self.cache.continuations(shared_at, depth)] if shared == length else []
        if own == length:  # both stores' occurrences vote when they match equally long
            follow.insert(0, row.cache.continuations(own_at, depth, periodic=True))
        leaves = self.sampled_leaves if row.sampled else self.greedy_leaves
        chains = frequency_tree(np.concatenate(follow), self.max_nodes, leaves, self.min_prob)
        return chains, (match_level(length) if chains else 0)
