"""The model interface every target and draft model implements.

A model holds a batch of token sequences (rows) in its own KV cache. Rows join (:meth:`add_rows`, which
prefills them alone while the other rows keep their caches) and leave (:meth:`remove_rows`) between
steps. ``forward`` appends a block of new tokens to every row (a chain, or a token tree with its
ancestor mask) and returns their logits; ``keep_block`` / ``commit_all`` / ``truncate`` say what of it
stays. Rows are independent: each has its own length.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from genspec.errors import ConfigError


@dataclass
class PrefixKV:
    """The first L decoder layers of a block, already computed by an early-exit draft that shares
    those layers' weights (LayerSkip-style reuse): per layer the keys and values of the block
    (``[B, kv_heads, n, head_dim]``), and the hidden states entering layer L (``[B, n, H]``). A target's
    :meth:`CausalLM.forward` with a prefix runs only layers L.. and copies these into its cache."""

    hidden: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor | None = None  # [B, n]: the block's real tokens it was computed for (None: any)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def fits(self, valid: torch.Tensor, tree_mask: torch.Tensor | None) -> bool:
        """Whether these layers are those of a chain block with real tokens ``valid`` ``[B, n]``: a target
        runs every layer of a block they do not fit (another batch, width or shape)."""
        return (tree_mask is None and tuple(self.hidden.shape[:2]) == tuple(valid.shape)
                and (self.valid is None or torch.equal(self.valid.to(valid.device), valid)))


def states_kept(length: int, hidden_last: int | None) -> int:
    """How many states of a ``length``-token prefix :meth:`CausalLM.add_rows` returns for ``hidden_last`` (its
    last ones)."""
    return length if hidden_last is None else min(length, max(hidden_last, 0))


def padded(widths: list[int]) -> list[tuple[int, int]]:
    """A step's rows padded to the widest: one block (``[3, 1, 1]`` runs as ``[(3, 3)]``)."""
    return [(len(widths), max(widths))] if widths else []


def equal_split(widths: list[int], sequences: list[int] | None = None) -> list[tuple[int, int]]:
    """The uniform blocks ``(rows, tokens)`` of a step whose rows hold ``widths`` tokens each, taken as llama.cpp
    splits a batch when every row has a cache stream of its own (``split_equal``, sequential): each micro-batch
    takes the same number of tokens from a run of rows whose sequence ids rise by one, starting at the lowest id
    with tokens left, until one of them runs out. ``sequences``: each row's sequence id (default: the row's
    index), the batch holding the rows in id order.

    ``[5, 2, 1, 1]`` runs as 4 rows x 1 token, then 2 rows x 1, then 1 row x 3; ``[5, 1, 5]`` as 3 x 1, then
    1 x 4 twice (the middle row ran out, so the outer two are no run); rows of 1 token on sequences 0, 1, 3 as
    2 x 1 and 1 x 1 (sequence 2 is missing)."""
    return list(_equal_split(tuple(widths), tuple(sequences) if sequences is not None else None))


@functools.lru_cache(maxsize=4096)
def _equal_split(widths: tuple[int, ...], sequences: tuple[int, ...] | None) -> tuple[tuple[int, int], ...]:
    """:func:`equal_split` on tuples, remembered: a draft-length plan prices a hundred or so candidate steps a
    batch step, most of them the same widths on the same sequences as in the steps before."""
    if sequences is None:
        ids, left = range(len(widths)), list(widths)
    else:
        order = sorted(range(len(widths)), key=sequences.__getitem__)
        ids, left = [sequences[r] for r in order], [widths[r] for r in order]
    shapes, first, count = [], 0, len(left)
    while True:
        while first < count and left[first] <= 0:  # rows before ``first`` have no tokens left
            first += 1
        if first == count:
            return tuple(shapes)
        end, take = first + 1, left[first]
        while end < count and left[end] > 0 and ids[end] == ids[end - 1] + 1:
            take = min(take, left[end])
            end += 1
        for i in range(first, end):
            left[i] -= take
        shapes.append((end - first, take))


class CausalLM(ABC):
    """A causal language model with a per-row KV cache.

    Shapes: ``B`` rows, ``n`` new tokens, ``V`` vocabulary, ``H`` hidden size.
    """

    vocab_size: int
    #: maximum sequence length (prompt + generated) or None if unbounded
    max_context: int | None = None
    #: what runs the model (``genspec.Backend``'s values: "torch", "llamacpp"; another adapter names itself)
    backend: str = "custom"
    #: a position's logits are bitwise the same whatever block or batch computes them (llama.cpp's exact kernels,
    #: ``genspec.Kernels``; a torch model made with ``exact=True``), so greedy speculation reproduces plain greedy
    #: decoding token for token and a seeded sample repeats. False: the kernels round a k-token block (or a row
    #: beside others) differently from one token, in the last bits (torch's default kernels: a BLAS sums a row's
    #: products in an order that depends on the number of rows) or more (llama.cpp's fast kernels), and a near-tie
    #: can flip a greedy token
    batch_invariant: bool = True
    #: a verify block's cost is not smooth in its width, so interpolating between a few measured widths misprices
    #: the others (llama.cpp's CPU kernels take 4 tokens at a time): engines made by :func:`genspec.load`,
    #: ``genspec bench`` and ``genspec serve`` then time every width a draft can fill at start
    #: (:func:`genspec.calibration.calibrate_engine`)
    uneven_verify_cost: bool = False
    #: the most tokens one row's block may hold in a :meth:`forward` (llama.cpp's batch is sized for verify blocks),
    #: or None if unbounded: a caller with a longer run of tokens to feed (a draft model catching up) feeds it in
    #: pieces
    max_block_tokens: int | None = None
    #: the most rows the model can hold at once (a fixed number of KV sequences), or None if unbounded;
    #: the engine caps its running batch by it
    max_rows: int | None = None
    device: torch.device = torch.device("cpu")
    #: a Hugging Face tokenizer, or None (then only token ids can be generated)
    tokenizer = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a sequence by default (none unless the model says)."""
        return ()

    # ------------------------------------------------------------------ rows
    @abstractmethod
    def reset(self, batch_size: int = 0) -> None:
        """Forget every sequence; hold ``batch_size`` empty rows."""

    @abstractmethod
    def add_rows(self, prefixes: list[list[int]], return_hidden: bool = False,
                 hidden_layers: tuple[int, ...] = (), hidden_last: int | None = None) -> list[torch.Tensor] | None:
        """Append one row per prefix, holding its tokens (a prefill run on the new rows only; the other
        rows keep their caches). Empty prefixes give empty rows. With ``return_hidden``, the final hidden
        states (the LM head's inputs) of each prefix, ``[len(prefix), H]`` per row (models without
        hidden states raise :class:`genspec.errors.ConfigError`), followed along the last axis by those of
        ``hidden_layers`` as in :meth:`forward`; with ``hidden_last``, those of each prefix's last
        ``hidden_last`` tokens only, ``[min(len(prefix), hidden_last), H]``."""

    @abstractmethod
    def remove_rows(self, rows: list[int]) -> None:
        """Drop the rows with these indices; the remaining rows keep their order."""

    @property
    @abstractmethod
    def lengths(self) -> torch.Tensor:
        """``[B]`` number of tokens held per row."""

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    # ------------------------------------------------------------------ blocks
    @abstractmethod
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, last_only: bool = False,
                prefix: PrefixKV | None = None, return_hidden: bool = False, hidden_layers: tuple[int, ...] = ()):
        """Append ``tokens`` ``[B, n]`` to each row and return logits ``[B, n, V]`` (with
        ``return_hidden``: ``(logits, hidden)``, the final hidden states ``[B, n, H]`` too; with
        ``hidden_layers`` as well, the outputs of those decoder layers follow them along the last axis,
        ``[B, n, H * (1 + len(hidden_layers))]``: layer l's is the residual stream after the first l layers,
        transformers' ``hidden_states[l]``, 1 <= l < the number of layers; EAGLE-3's fused features).

        ``valid`` ``[B, n]`` marks real tokens (padding is right-aligned per row and is not kept).
        ``tree_mask`` ``[B, n, n]`` bool: entry (i, j) says new token i may see new token j (its
        ancestor or itself); default causal (a chain). Token i's position is the row's length plus its
        depth (number of new ancestors, itself excluded). With ``last_only`` the logits are
        ``[B, 1, V]`` for each row's last valid token. ``prefix``: the block's first layers, computed
        by an early-exit draft (see :meth:`prefix_for`); only models that support it accept one, and they
        run every layer where it does not fit the block (:meth:`PrefixKV.fits`).
        """

    def block_shapes(self, widths: list[int]) -> list[tuple[int, int]]:
        """The uniform blocks ``(rows, tokens)`` a verify step runs as when its rows hold ``widths`` tokens each
        (one entry per row, >= 1): what the step costs, for the draft-length plan
        (:meth:`genspec.draft_length.CostModel.shapes_relative`). Default: every row padded to the widest
        (:func:`padded`)."""
        return padded(widths)

    def reserve_candidates(self, max_candidates: int) -> int:
        """Blocks of up to ``max_candidates`` candidate chains per row (token trees when above 1) may come;
        called before any row is added (the engine does so for its drafters), so a backend whose cache layout
        depends on it can set it up, dropping any rows it holds. Returns the most chains per row it will verify
        (the engine verifies each draft's first ones: a backend whose trees would lose what it guarantees takes
        chains only). Default: ``max_candidates`` (the backend takes any tree)."""
        return max_candidates

    def forward_transient(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                          tree_mask: torch.Tensor | None = None, last_only: bool = False,
                          prefix: PrefixKV | None = None, return_hidden: bool = False,
                          hidden_layers: tuple[int, ...] = ()):
        """:meth:`forward` for a caller that is done with the logits before it calls the model again (the
        engine's verify step): they may be a view of the model's own buffer, which its next call overwrites,
        so a backend that computes them in a buffer of its own skips a copy. Default: :meth:`forward`."""
        return self.forward(tokens, valid, tree_mask, last_only=last_only, prefix=prefix,
                            return_hidden=return_hidden, hidden_layers=hidden_layers)

    @abstractmethod
    def hidden_states(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                      tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`forward` without the LM head: final hidden states ``[B, n, H]`` and ``valid``
        (a drafter that only needs its cache filled skips the head)."""

    @abstractmethod
    def keep_block(self, keep: torch.Tensor) -> None:
        """After a ``forward``, keep only some of its tokens, in order: ``keep`` ``[B, m]`` holds
        indices into the last block (-1 = nothing), e.g. the accepted path of a tree or the first
        a + 1 tokens of a chain. The kept tokens must form a chain (each the child of the previous)."""

    @abstractmethod
    def commit_all(self, valid: torch.Tensor | None = None) -> None:
        """Keep every valid token of the last block (a prefill, a plain decode step, a draft model's sync)."""

    @abstractmethod
    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first ``lengths[b]`` tokens of row b (``lengths`` ``[B]``)."""

    # ------------------------------------------------------------------ what drafters on its features read
    #: the width of a final hidden state (the output layer's input) where the model gives them (``forward``'s
    #: ``return_hidden``), else None: heads, Medusa and the hybrid draft from them
    hidden_size: int | None = None
    #: the number type of those states
    dtype: torch.dtype = torch.float32
    #: the outputs of its decoder layers come with the final states (``forward``'s ``hidden_layers``), and its
    #: first layers can be run alone over committed tokens (a head's ``feature_layers`` / ``token_layers``)
    gives_layer_states: bool = False
    #: decoder layers, and the context it was trained for (what a trained head's fingerprint records)
    num_layers: int | None = None
    trained_context: int | None = None

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[..., H]``: what the first decoder layer reads for ``tokens`` ``[...]`` (the embedding rows, scaled
        as the model scales them: Gemma by the square root of ``H``). Models without hidden states refuse."""
        raise ConfigError(f"the {self.backend} backend's model gives no token embeddings")

    def output_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[len(token_ids), H]``: the output layer's rows of ``token_ids`` (float32)."""
        raise ConfigError(f"the {self.backend} backend's model gives no output-layer rows")

    def subset_head(self, token_ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function from final hidden states ``[..., H]`` to this model's logits of ``token_ids`` only,
        ``[..., S]`` (a draft head's truncated vocabulary): the output layer's rows and the model's soft cap."""
        raise ConfigError(f"the {self.backend} backend's model gives no output layer to draft from")

    # ------------------------------------------------------------------ prefix reuse (early exit)
    @property
    def prefix_source(self) -> "CausalLM | None":
        """The target whose first layers this (draft) model is, to which it can hand a :class:`PrefixKV`
        (early exit), or None."""
        return None

    def shares_prefix_with(self, target: "CausalLM") -> bool:
        """True if this (draft) model is ``target``'s first layers and can hand it a :class:`PrefixKV`."""
        return False

    def prefix_for(self, target: "CausalLM", start: torch.Tensor, valid: torch.Tensor) -> PrefixKV | None:
        """The first layers of ``target``'s block at positions ``start[b] + j`` (``valid`` ``[B, n]``),
        which this model has computed, or None (it cannot, or no longer holds them)."""
        return None
