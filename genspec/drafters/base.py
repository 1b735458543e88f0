"""The drafter interface: anything that guesses the next tokens.

Life cycle (llama.cpp's, per request): the engine calls :meth:`Drafter.start` when requests join
the batch; at every step, for the requests that use this drafter (each with its whole sequence so far),
:meth:`Drafter.offer` (free tokens, or a costly draft to come) before the draft-length plan,
:meth:`Drafter.propose` after it for the rows offered as costly (how many tokens each drafts) and, for a
drafter that reads them, :meth:`Drafter.read_predictions` after the target's pass; and
:meth:`Drafter.finish` when requests leave (joins and leaves come in groups, so a model-based drafter
prefills or frees them in one go). What the target kept is visible in the next call's sequences. A
drafter keeps its own state (its own KV cache, tables, ...) per request and never touches the target's.
"""
from __future__ import annotations

import math
import numbers
import os
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from genspec.acceptance import coupled_tokens, sample_with_uniforms
from genspec.errors import ConfigError
from genspec.kernels import most_likely
from genspec.models.base import CausalLM, PrefixKV
from genspec.randomness import RequestRandomness
from genspec.sampling import SamplingConfig

#: draft tokens per step at most (k) when neither the request nor the drafter says otherwise
DEFAULT_DRAFT_TOKENS = 8
#: the most candidate chains per row an option may ask for (``num_candidates``, ``num_drafts``): the target
#: verifies them all in one pass, so a row's verify block grows with each
MAX_CANDIDATES = 32
#: the most nodes a draft tree option may ask for (``tree_nodes``, the suffix drafter's ``max_nodes``): a row's
#: verify block holds every one
MAX_TREE_NODES = 128
#: what a path option takes: text, or a :class:`os.PathLike`
PATH = (str, os.PathLike)

#: how an error quotes a value (an edit source may be a whole text)
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist = 40, 40, 6


@dataclass(frozen=True)
class Option:
    """One option a drafter takes (``-O NAME=VALUE``, ``genspec.load(drafter=..., NAME=VALUE)``), declared once
    with the values it admits, on the drafter's class (:attr:`Drafter.options`): the registry checks what a user
    gives against it before anything loads (:meth:`Drafter.check_options`), and the manual lists it.

    ``kinds``: what a value may be, a type or a tuple of them: ``int`` (an integer, not a bool), ``float`` (a
    finite number; an integer too), ``bool``, ``str``, ``list`` (a list of ``item`` values), ``None``, or any
    class (a loaded model). ``low`` / ``high``: the range of a number, or of each item of a list (``low_open``
    / ``high_open``: that end excluded); every size-like option has a ``high``. ``choices``: the values a
    ``str`` may take. ``needed``: what to say when the option is missing (None: it may be left out)."""

    name: str
    kinds: type | tuple = object
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    item: type | None = None
    choices: tuple[str, ...] = ()
    needed: str | None = None

    def __post_init__(self):
        kinds = self.kinds if isinstance(self.kinds, tuple) else (self.kinds,)
        object.__setattr__(self, "kinds", tuple(type(None) if k is None else k for k in kinds))
        object.__setattr__(self, "choices", tuple(self.choices))

    def admits(self, value) -> bool:
        """Whether ``value`` is one this option takes."""
        for kind in self.kinds:
            if kind is list:
                if isinstance(value, (list, tuple)) and all(self._scalar(v, self.item) for v in value):
                    return True
            elif kind in (int, float, bool, str):
                if self._scalar(value, kind):
                    return True
            elif isinstance(value, kind):
                return True
        return False

    def _scalar(self, value, kind) -> bool:
        if kind is bool:
            return isinstance(value, bool)
        if kind is str:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if kind is int else numbers.Real):
            return False
        if kind is float and not math.isfinite(value):
            return False
        return self._in_range(value)

    def _in_range(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The values it takes, in words: "an integer from 1 to 32", "a number in [0, 1)", "a path"."""
        words = [self._words(kind) for kind in self.kinds if kind is not type(None)]
        return " or ".join(w for w in words if w) or "nothing"

    def _words(self, kind) -> str:
        if kind is list:
            if self.item in (int, float):
                return f"a list of {'integers' if self.item is int else 'numbers'}{self._range(self.item is int)}"
            return "a list of strings"
        if kind is bool:
            return "true or false"
        if kind is str:
            if self.choices:
                return "one of " + ", ".join(self.choices)
            return "a path" if os.PathLike in self.kinds else "text"
        if kind is int:
            return "an integer" + self._range(integer=True)
        if kind is float:
            return "a number" + self._range(integer=False)
        if kind is os.PathLike:
            return ""  # said with str: "a path"
        return f"a {kind.__name__}"

    def _range(self, integer: bool) -> str:
        low, high = _number(self.low), _number(self.high)
        if low is not None and high is not None:
            if integer and not (self.low_open or self.high_open):
                return f" from {low} to {high}"
            return f" in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low is not None:
            return f" {'>' if self.low_open else '>='} {low}"
        if high is not None:
            return f" {'<' if self.high_open else '<='} {high}"
        return ""

    def check(self, value, owner: str, what: str = "option") -> None:
        """Refuse ``value`` if this option does not take it (``owner`` says whose it is: ``drafter 'suffix'``)."""
        if value is None and self.needed is not None:
            raise ConfigError(f"{owner} needs {self.needed}")
        if not self.admits(value):
            raise ConfigError(f"{owner} {what} {self.name}={_SHORT.repr(value)}: expected {self.describe()}")


def _number(value: float | None) -> str | None:
    """A bound as a user would type it: ``100000000``, ``0.5``."""
    if value is None:
        return None
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def check_options(declared: Iterable[Option], given: Mapping[str, object], owner: str, what: str = "option") -> None:
    """Refuse the options ``given`` if one is not ``declared``, is declared but not with that value, or is
    declared as needed and missing; ``owner`` names who takes them (``drafter 'suffix'``), ``what`` what they
    are (``per-request option``)."""
    declared = {option.name: option for option in declared}
    for name, value in given.items():
        if name not in declared:
            takes = ", ".join(declared) or "none"
            raise ConfigError(f"{owner} does not take {what} {name}; it takes: {takes}")
        declared[name].check(value, owner, what)
    for option in declared.values():
        if option.needed is not None and given.get(option.name) is None:
            raise ConfigError(f"{owner} needs {option.needed}")


@dataclass(frozen=True)
class RequestContext:
    """What a drafter knows of a request when it joins.

    ``generator`` is the request's own random stream for drafting (a seeded request drafts the same
    whatever else is in the batch); ``options`` are per-request drafter options, among the drafter's
    :attr:`DrafterCapabilities.request_options`. ``hidden``: for a drafter that :attr:`~DrafterCapabilities.reads_target_hidden`,
    the target's hidden states (its LM head's inputs) of every prompt token but the last,
    ``[len(prompt) - 1, H]``, or of the last :attr:`~DrafterCapabilities.prompt_states` of them where it says so (followed by those of its :attr:`~DrafterCapabilities.target_hidden_layers`: ``[..., H * (1 +
    len(layers))]``); None for the others. ``noise``: for a request verified by the coupled rule,
    its per-position noise; a drafter that samples draws its token at output position t (``len(sequence)
    - len(prompt)``) from it (:func:`draw_tokens` does), so that draft and target are coupled. None for
    the others.
    """

    request_id: int
    prompt: list[int]
    sampling: SamplingConfig = SamplingConfig()
    generator: torch.Generator | None = None
    options: Mapping[str, object] = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    noise: RequestRandomness | None = None


@dataclass(frozen=True)
class DraftRequest:
    """One row of a :meth:`Drafter.offer` or :meth:`Drafter.propose` call: up to ``max_tokens`` tokens after
    ``sequence`` (prompt and generated tokens so far). ``max_tokens`` may be 0 (nothing wanted from this row).
    ``hidden``: for a drafter that :attr:`~DrafterCapabilities.reads_target_hidden`, in a :meth:`~Drafter.propose`
    call (an offer gets None), the target's hidden states of
    the tokens committed since this request's last proposal (or its start), ``[n, H]`` (wider with
    :attr:`~DrafterCapabilities.target_hidden_layers`, as in :class:`RequestContext`), in order; with
    the earlier ones they cover every token of ``sequence`` but the last. None for the others. The same
    states may come twice: when a batch's proposal raises, the engine proposes for each row alone with
    the same requests, so a drafter keeps at most ``len(sequence) - 1`` states."""

    request_id: int
    sequence: list[int]
    max_tokens: int
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class Draft:
    """Proposed continuations: ``M`` candidate chains per row (M = 1: a single chain).

    tokens: ``[B, M, k]`` (padding beyond ``lengths`` is arbitrary); lengths: ``[B, M]``;
    probs: ``[B, M, k, V]`` the (processed) draft law each token was drawn from, or None when the drafter
    is deterministic (its law is the point mass on the token; lossless verification still holds).
    Chains with M > 1 are independent candidates (draws, or distinct lookups); identical prefixes are
    merged into one tree node for the target pass, but each chain stays a candidate for the verifier.
    evidence: optional, per row, a small hashable grade of how well the proposal is backed (prompt
    lookup: the matched n-gram length); the cost-aware draft length learns acceptance per grade.
    prefix: an early-exit draft's (:attr:`DrafterCapabilities.early_exit`) first target layers over its
    verify block (per row ``[last token, draft tokens...]``), which the target's pass reuses where the block
    is this draft's (:class:`genspec.models.base.PrefixKV`); a draft cut or restacked drops it.
    A draft is never changed in place: :meth:`clipped` returns a new one.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    evidence: tuple | None = None
    prefix: PrefixKV | None = None

    @classmethod
    def empty(cls, batch: int) -> "Draft":
        return cls(torch.zeros(batch, 1, 0, dtype=torch.long), torch.zeros(batch, 1, dtype=torch.long))

    @classmethod
    def from_chains(cls, chains: list[list[list[int]]], num_chains: int = 1, evidence: list | None = None) -> "Draft":
        """A deterministic draft from per-row lists of up to ``num_chains`` candidate chains (token lists;
        missing chains have length 0), built with one tensor call (filling rows one by one costs three
        times as much, which matters at a few microseconds per step)."""
        rows = [row[:num_chains] + [[]] * (num_chains - len(row[:num_chains])) for row in chains]
        width = max((len(c) for row in rows for c in row), default=0)
        tokens = torch.tensor([[c + [0] * (width - len(c)) for c in row] for row in rows], dtype=torch.long)
        lengths = torch.tensor([[len(c) for c in row] for row in rows], dtype=torch.long)
        return cls(tokens.reshape(len(rows), num_chains, width), lengths.reshape(len(rows), num_chains),
                   evidence=None if evidence is None else tuple(evidence))

    @classmethod
    def stack(cls, drafts: list["Draft"]) -> "Draft":
        """One draft of the rows of several (padded to the most chains and the longest chain; a row
        without laws gets the point masses of its tokens, which is what its draft is)."""
        chains = max(d.num_chains for d in drafts)
        width = max(d.width for d in drafts)
        tokens = torch.cat([torch.nn.functional.pad(d.tokens, (0, width - d.width, 0, chains - d.num_chains))
                            for d in drafts])
        lengths = torch.cat([torch.nn.functional.pad(d.lengths, (0, chains - d.num_chains)) for d in drafts])
        probs = None
        with_laws = [d.probs for d in drafts if d.probs is not None]
        if with_laws:
            vocab, dtype = with_laws[0].shape[-1], with_laws[0].dtype
            laws = [d.probs if d.probs is not None else torch.nn.functional.one_hot(d.tokens, vocab).to(dtype)
                    for d in drafts]
            probs = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[2], 0, chains - p.shape[1]))
                               for p in laws])
        evidence = None
        if any(d.evidence is not None for d in drafts):
            evidence = tuple(e for d in drafts for e in (d.evidence or (None,) * d.batch))
        return cls(tokens, lengths, probs, evidence)

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_chains(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[2])

    def evidence_of(self, row: int):
        return None if self.evidence is None else self.evidence[row]

    def proposed(self) -> list[bool]:
        """Per row: was anything proposed?"""
        return (self.lengths.amax(dim=1) > 0).tolist()

    def rows(self, indices: list[int]) -> "Draft":
        """The draft of these rows only, in this order."""
        index = torch.tensor(indices, dtype=torch.long)
        return Draft(self.tokens[index], self.lengths[index], None if self.probs is None else self.probs[index],
                     None if self.evidence is None else tuple(self.evidence[i] for i in indices))

    def first_chain(self, row: int) -> list[int]:
        return self.tokens[row, 0, :int(self.lengths[row, 0])].tolist()

    def chains(self, row: int) -> list[list[int]]:
        """Row ``row``'s candidate chains that hold any token (a tree's root-to-leaf paths), in order."""
        return [self.tokens[row, m, :n].tolist() for m, n in enumerate(self.lengths[row].tolist()) if n]

    def clipped(self, limits: list[int]) -> "Draft":
        """The draft cut to ``limits[b]`` tokens per chain of row b (and to the longest chain left)."""
        lengths = torch.minimum(self.lengths, torch.tensor(limits, dtype=torch.long).unsqueeze(1))
        width = int(lengths.max()) if lengths.numel() else 0
        probs = None if self.probs is None else self.probs[:, :, :width]
        prefix = self.prefix if torch.equal(lengths, self.lengths) else None
        return Draft(self.tokens[:, :, :width], lengths, probs, self.evidence, prefix)

    def first_chains(self, count: int) -> "Draft":
        """The draft with each row's first ``count`` candidate chains only (itself when it has no more): each
        chain is a candidate on its own, so verifying fewer of them stays lossless."""
        if self.num_chains <= count:
            return self
        probs = None if self.probs is None else self.probs[:, :count]
        return Draft(self.tokens[:, :count], self.lengths[:, :count], probs, self.evidence, None)

    def drafted_tokens(self) -> list[int]:
        """Per row: draft tokens sent to the target (tree nodes: shared prefixes counted once)."""
        if self.num_chains == 1:
            return self.lengths[:, 0].tolist()
        return [len(nodes) for nodes, _ in self._trees()]

    def _trees(self):
        """Per row: the merged tree's nodes ``[(parent, token), ...]`` (node i + 1 of the block; node 0 is
        the last committed token) and, per chain, its node index per depth."""
        out = []
        for b in range(self.batch):
            nodes, index, paths = [], {}, []
            for m in range(self.num_chains):
                parent, path = 0, []
                for d in range(int(self.lengths[b, m])):
                    key = (parent, int(self.tokens[b, m, d]))
                    if key not in index:
                        nodes.append(key)
                        index[key] = len(nodes)
                    parent = index[key]
                    path.append(parent)
                paths.append(path)
            out.append((nodes, paths))
        return out

    def block(self, last_tokens: list[int], active: list[bool]) -> "DraftBlock":
        """The target's verify block: per row ``[last token, draft nodes...]`` (inactive rows: nothing)."""
        batch, k = self.batch, self.width
        lengths = self.lengths * torch.tensor(active, dtype=torch.long).unsqueeze(1)
        last = torch.tensor(last_tokens, dtype=torch.long).unsqueeze(1)
        if self.num_chains == 1:  # a chain: causal block, no tree mask
            valid = torch.arange(k + 1).unsqueeze(0) <= lengths[:, 0].unsqueeze(1)
            valid &= torch.tensor(active).unsqueeze(1)
            return DraftBlock(torch.cat([last, self.tokens[:, 0]], dim=1), valid, None, None, lengths)
        trees = Draft(self.tokens, lengths)._trees()
        width = 1 + max(len(nodes) for nodes, _ in trees)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        valid = torch.zeros(batch, width, dtype=torch.bool)
        tree_mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
        node_of = torch.zeros(batch, self.num_chains, k, dtype=torch.long)
        for b, (nodes, paths) in enumerate(trees):
            tokens[b, 0], valid[b, 0] = last_tokens[b], active[b]
            for i, (parent, token) in enumerate(nodes, start=1):
                tokens[b, i], valid[b, i] = token, True
                tree_mask[b, i] |= tree_mask[b, parent]
            for m, path in enumerate(paths):
                node_of[b, m, :len(path)] = torch.tensor(path, dtype=torch.long)
        return DraftBlock(tokens, valid, tree_mask, node_of, lengths)


@dataclass(frozen=True)
class DraftBlock:
    """A draft laid out for the target's verify pass: ``tokens`` / ``valid`` ``[B, N]`` (node 0: the last
    committed token), ``tree_mask`` ``[B, N, N]`` (None for a chain), ``node_of`` ``[B, M, k]`` the
    node of each chain token (None for a chain: token d at node d + 1), ``lengths`` ``[B, M]``."""

    tokens: torch.Tensor
    valid: torch.Tensor
    tree_mask: torch.Tensor | None
    node_of: torch.Tensor | None
    lengths: torch.Tensor

    def chain_nodes(self, row: int) -> list[list[int]]:
        """Row ``row``'s candidate chains as block nodes, in the draft's order (an empty chain: ``[]``)."""
        lengths = self.lengths[row].tolist()
        if self.node_of is None:
            return [list(range(1, lengths[0] + 1))]
        return [self.node_of[row, m, :n].tolist() for m, n in enumerate(lengths)]

    def reached(self, row: int, path: list[int]) -> int:
        """How deep row ``row``'s draft went along ``path``, the nodes it had accepted in order: the length
        of its longest candidate that begins with them (a chain: its length). A tree's other branches may
        go deeper without testing anything after the accepted path."""
        lengths = self.lengths[row].tolist()
        if self.node_of is None:
            return max(lengths)
        n = len(path)
        return max((length for m, length in enumerate(lengths)
                    if length >= n and self.node_of[row, m, :n].tolist() == path), default=n)


@dataclass(frozen=True)
class BlockPredictions:
    """What the target predicted over one request's verify block, for a drafter that
    :attr:`~DrafterCapabilities.reads_block_predictions` (:meth:`Drafter.read_predictions`).

    ``start``: the length of the request's sequence when it was drafted (the first draft token's index in
    it). ``chains``: the row's candidate chains as verified (the draft after the plan cut it; a
    :class:`Draft`'s chains in order, empty ones included); ``predicted[m]`` (``len(chains[m]) + 1``
    tokens): the target's most likely token after the sequence and the first d tokens of ``chains[m]``,
    for d = 0, 1, ... (d = 0: after the last committed token, the same in every chain). Most likely under
    the request's own processing (its repetition penalty; temperature, top-k and top-p keep the argmax), so
    for a greedy request the predictions along the kept path are the tokens it committed. Past the first
    rejected token they are the target's guesses after a wrong one: a Jacobi iteration's next guesses.
    """

    request_id: int
    start: int
    chains: tuple[tuple[int, ...], ...]
    predicted: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a drafter can do, declared once (:attr:`Drafter.capabilities`; a drafter whose options change
    them sets its own in ``__init__``, e.g. ``dataclasses.replace(self.capabilities, max_candidates=4)``).
    The engine reads these and the methods of :class:`Drafter`, nothing else.

    - ``free``: it can propose tokens at next to no cost (no model runs), before the draft-length plan
      decides: its :meth:`Drafter.offer` holds them, the plan weighs their evidence, and the policy scores
      what of them was not verified.
    - ``costly``: some of its drafts cost model time (default: not ``free``; a composite such as the hybrid
      is both): the engine measures that time per drafter (:class:`genspec.draft_length.DraftCost`) and the
      plan prices those drafts with it and with :meth:`Drafter.block_tokens`.
    - ``draft_cost_prior``: a costly drafter's time per draft position, in plain target steps, assumed until
      the engine has measured it: a model the size of half the target by default (early exit and layer skip
      also run the full head); heads on the target's features cost far less.
    - ``default_draft_tokens``: the most tokens a step drafts (k) when a request does not set
      ``num_draft_tokens``: the depth the drafter is designed for (the suffix drafter's match-proportional
      drafts go to 24, SuffixDecoding's).
    - ``max_candidates``: most candidate chains per row in a :class:`Draft` (1: always a single chain).
    - ``request_options``: per-request options a request may pass (``GenerationConfig.drafter_options``), each an
      :class:`Option` (a bare name: one that takes any value); the engine refuses, when a request is added, one
      not declared here or with a value its declaration does not admit.
    - ``reads_target_hidden``: it reads the target's hidden states (EAGLE-style heads): the engine asks the
      target for them and hands them over in :attr:`RequestContext.hidden` and :attr:`DraftRequest.hidden`;
      ``target_hidden_layers``: those states also hold the outputs of these target layers (1 <= l < its layer
      count, after the final states along the last axis: EAGLE-3's fused features; see :meth:`CausalLM.forward`);
      ``prompt_states``: how many of the prompt's last states it reads when a request joins (None: all). A target
      on the llamacpp backend runs its output layer for every state it gives, so a drafter that reads few says so.
    - ``samples_drafts``: for a sampled request it draws its drafts from a law it hands to the verifier (a
      draft model, a head's chain), with :func:`draw_tokens`. Under the standard rule a seeded request's
      tokens then depend on where its drafts stop, so the engine verifies seeded requests of such a drafter
      with the coupled rule (see :mod:`genspec.randomness`). False: its drafts are point masses (lookups,
      trees), verified so that the tokens are plain sampling's.
    - ``early_exit``: its drafts are the target's own first layers: a chain draft carries them over its
      verify block (:attr:`Draft.prefix`) and the target's pass reuses them where they fit
      (LayerSkip-style KV reuse, :class:`genspec.models.base.PrefixKV`).
    - ``reads_block_predictions``: it reads what the target predicted over its verify blocks, also past the
      first rejection (Lookahead decoding's Jacobi window): after each step's verification the engine hands
      it, per request, the target's most likely token at every node of the block
      (:meth:`Drafter.read_predictions`). For other drafters nothing of it is computed.
    """

    free: bool = False
    costly: bool | None = None
    draft_cost_prior: float = 0.5
    default_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    max_candidates: int = 1
    request_options: tuple[Option, ...] = ()
    reads_target_hidden: bool = False
    target_hidden_layers: tuple[int, ...] = ()
    prompt_states: int | None = None
    samples_drafts: bool = False
    early_exit: bool = False
    reads_block_predictions: bool = False

    def __post_init__(self):
        if self.costly is None:
            object.__setattr__(self, "costly", not self.free)
        if not (self.free or self.costly):
            raise ConfigError("a drafter's drafts are free, costly or both")
        if int(self.max_candidates) != self.max_candidates or self.max_candidates < 1:
            raise ConfigError(f"max_candidates must be an integer >= 1, got {self.max_candidates}")
        if int(self.default_draft_tokens) != self.default_draft_tokens or self.default_draft_tokens < 1:
            raise ConfigError(f"default_draft_tokens must be an integer >= 1, got {self.default_draft_tokens}")
        object.__setattr__(self, "request_options",
                           tuple(Option(o) if isinstance(o, str) else o for o in self.request_options))
        object.__setattr__(self, "target_hidden_layers", tuple(self.target_hidden_layers))
        if self.prompt_states is not None and (int(self.prompt_states) != self.prompt_states or self.prompt_states < 1):
            raise ConfigError(f"prompt_states must be None or an integer >= 1, got {self.prompt_states}")


@dataclass(frozen=True)
class DraftOffer:
    """What a drafter offers a step's rows before the draft-length plan decides how many tokens each
    drafts (:meth:`Drafter.offer`). Per row b, either tokens it proposed for free (row b of ``proposal``:
    the plan drafts at most their depth, then clips them; the policy scores what of their first chain was
    not verified), or, where ``costly[b]``, a draft it will make at a model's cost once the plan has decided
    its length (:meth:`Drafter.propose`; ``proposal``'s row b is then empty). Either way ``proposal``'s
    evidence grades the row (:class:`Draft`): the policy learns acceptance per grade."""

    proposal: Draft
    costly: tuple[bool, ...]

    @classmethod
    def free(cls, proposal: Draft) -> "DraftOffer":
        """Every row: the tokens of ``proposal``, at no cost."""
        return cls(proposal, (False,) * proposal.batch)

    @classmethod
    def to_draft(cls, batch: int, evidence: list | None = None) -> "DraftOffer":
        """Every row: a costly draft once the plan has decided its length (graded by ``evidence``)."""
        proposal = Draft.empty(batch)
        if evidence is not None:
            proposal = Draft(proposal.tokens, proposal.lengths, evidence=tuple(evidence))
        return cls(proposal, (True,) * batch)

    @classmethod
    def stack(cls, offers: list["DraftOffer"]) -> "DraftOffer":
        """One offer of the rows of several."""
        return cls(Draft.stack([o.proposal for o in offers]), tuple(c for o in offers for c in o.costly))

    @property
    def batch(self) -> int:
        return len(self.costly)

    def evidence_of(self, row: int):
        return self.proposal.evidence_of(row)

    def cap(self, row: int, room: int) -> int:
        """The most tokens row ``row`` can draft: its free proposal's depth, or for a costly draft ``room``."""
        return room if self.costly[row] else int(self.proposal.lengths[row].max())

    def first_chain(self, row: int) -> list[int]:
        """Row ``row``'s free proposal's first chain before the plan clipped it (empty for a costly row)."""
        return self.proposal.first_chain(row)


class Drafter(ABC):
    """Base class of every speculator. Subclasses set ``name``, declare :attr:`capabilities` and implement
    :meth:`propose`.

    A step (:meth:`genspec.engine.SpeculativeEngine.step`): :meth:`offer` for the requests of this drafter
    (before the draft-length plan: free tokens, or a costly draft to come), the plan decides every row's
    length for the whole batch, then :meth:`read` and :meth:`propose` for the rows offered as costly, with
    the planned lengths. A composite drafter (the hybrid) combines the offers of its parts in :meth:`offer`
    and sends :meth:`read` / :meth:`propose` / :meth:`block_tokens` / :meth:`catch_up_tokens` to the part
    that makes its costly drafts."""

    name: str = "drafter"
    capabilities: DrafterCapabilities = DrafterCapabilities()
    #: the options :meth:`for_target` takes, each declared once with the values it admits (:class:`Option`)
    options: tuple[Option, ...] = ()

    @classmethod
    def for_target(cls, target: CausalLM, **options) -> "Drafter":
        """Build this drafter for ``target`` with user options (the registry's factory, so
        ``genspec.load(drafter=NAME, **options)`` and ``-O KEY=VALUE`` reach it), those of :attr:`options`."""
        return cls(**options)

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        """Refuse, without a target (so before anything loads), options :meth:`for_target` does not take: a
        name :attr:`options` does not declare, a value its declaration does not admit, a needed one missing
        (``owner``: who takes them in the error, default ``drafter 'NAME'``). A drafter whose options bound one
        another (``min_ngram <= max_ngram``) or go to a part it builds (the hybrid's lookup) checks that here too.
        The registry calls it before the model loads and before it builds; a constructor may call it on its own
        arguments."""
        check_options(cls.options, options, owner or f"drafter {cls.name!r}")

    def start(self, contexts: list[RequestContext]) -> None:
        """Requests join the batch."""

    def finish(self, request_ids: list[int]) -> None:
        """Requests left the batch (finished or cancelled): forget their state."""

    def offer(self, requests: list[DraftRequest]) -> DraftOffer:
        """This step's offer for these requests, before the plan (``max_tokens``: the room each has left;
        ``hidden`` is None: the target's states come with :meth:`propose`). Default: a free drafter proposes
        now (:meth:`propose`) and offers those tokens; a costly one offers to draft the planned lengths."""
        if self.capabilities.free:
            return DraftOffer.free(self.propose(requests))
        return DraftOffer.to_draft(len(requests))

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> Draft:
        """One :class:`Draft` row per request, in the order given, of up to ``max_tokens`` tokens each."""

    def read(self, requests: list[DraftRequest]) -> None:
        """Take in what each request committed since this drafter last drafted for it, before a costly
        :meth:`propose` (a head's pass over the new committed pairs, its token layers): the reading a
        draft needs whatever its depth. The engine times it apart, so the draft-length policy prices it once
        per draft, not per position (:class:`genspec.draft_length.DraftCost`). :meth:`propose` must work
        without it (it reads what was not read). Default: nothing (all drafting time is priced per position)."""

    def read_predictions(self, predictions: list[BlockPredictions]) -> None:
        """Take in what the target predicted over this step's verify blocks (one :class:`BlockPredictions`
        per request of this drafter that did not fail this step), after verification and before the next
        :meth:`offer`. Called only for a drafter that declares
        :attr:`~DrafterCapabilities.reads_block_predictions`. The same request's predictions may come twice
        (when the call raises, the engine calls again for each request alone). Default: nothing."""

    def block_tokens(self, depth: int) -> int:
        """The most draft tokens a costly draft ``depth`` tokens deep puts in one row's verify block: a
        chain's depth (the default), a tree's nodes. The draft-length policy prices a depth by the verify
        block it makes (:func:`genspec.draft_length.plan`)."""
        return depth

    def catch_up_tokens(self, request_id: int, sequence: list[int]) -> int:
        """How many tokens of ``sequence`` the drafter must still read before it can make a costly draft for
        this request (a draft model's cache lag; 0 for drafters that read nothing, the default). The
        draft-length policy weighs that reading before it probes a costly drafter
        (:func:`genspec.draft_length.probe_affordable`)."""
        return 0


def ragged_tokens(chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token chunks of different lengths as a right-padded block ``[B, width]`` and its validity mask (what a
    drafter's own model reads in one pass)."""
    width = max(1, max(len(c) for c in chunks))
    tokens = torch.zeros(len(chunks), width, dtype=torch.long)
    valid = torch.zeros(len(chunks), width, dtype=torch.bool)
    for row, chunk in enumerate(chunks):
        tokens[row, :len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        valid[row, :len(chunk)] = True
    return tokens, valid


def request_uniforms(contexts: list[RequestContext], count: int, drawing: list[bool]) -> torch.Tensor:
    """``[R, count]`` uniforms for drafting, each row from its request's draft generator; only rows that
    are drawing and sampled consume any (so a row's stream does not depend on its neighbours)."""
    out = torch.zeros(len(contexts), count, dtype=torch.float64)
    for row, context in enumerate(contexts):
        if drawing[row] and not context.sampling.greedy:
            out[row] = torch.rand(count, generator=context.generator, dtype=torch.float64)
    return out


def draw_tokens(laws: torch.Tensor, contexts: list[RequestContext], positions: list[int],
                drawing: list[bool]) -> torch.Tensor:
    """One draft token per row ``[R]`` from its law ``laws`` ``[R, V]``: greedy rows take the argmax; rows
    coupled to their verifier (``context.noise``) the coupled draw with their noise of output position
    ``positions[r]``; other sampled rows an inverse-CDF draw from their request's draft stream (only rows
    that are ``drawing`` consume any)."""
    coupled = [on and c.noise is not None and not c.sampling.greedy for on, c in zip(drawing, contexts)]
    uniforms = request_uniforms(contexts, 1, [on and not c for on, c in zip(drawing, coupled)])[:, 0]
    greedy = torch.tensor([c.sampling.greedy for c in contexts], device=laws.device)
    tokens = torch.where(greedy, most_likely(laws), sample_with_uniforms(laws, uniforms.to(laws.device)))
    for row, context in enumerate(contexts):
        if coupled[row]:
            tokens[row] = coupled_tokens(laws[row], context.noise.race(positions[row], laws.shape[-1]).to(laws.device))
    return tokens
