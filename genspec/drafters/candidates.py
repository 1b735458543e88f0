"""The shared base of the model-free drafters: per request some state, per step candidate chains.

A :class:`CandidateDrafter` proposes, for each row, up to ``num_candidates`` chains (distinct first
tokens, or a tree's paths; one chain when ``num_candidates == 1``; several are verified as a token tree)
and the evidence behind the first. Subclasses implement only :meth:`CandidateDrafter.new_row` (the state of a
request that joins) and :meth:`CandidateDrafter.candidates` (the search); starting, forgetting and
building the :class:`~genspec.drafters.base.Draft` live here. Drafts are deterministic (``probs``
None), so the engine verifies them losslessly.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import replace

from genspec.drafters.base import (MAX_CANDIDATES, Draft, Drafter, DrafterCapabilities, DraftRequest, Option,
                                   RequestContext)
from genspec.drafters.enumeration import Enumeration
from genspec.errors import ConfigError

#: numbered lists are renumbered in lookup chains by default (:mod:`genspec.drafters.enumeration`). Chosen on
#: the prompts no run measures: the suffix hybrid was faster with it, the list answers taking far fewer target
#: calls and the others about as many (the manual's Hybrid page, how the defaults were chosen)
RENUMBER = True


#: chains per row at most (several: verified as a tree)
NUM_CANDIDATES = Option("num_candidates", int, 1, MAX_CANDIDATES)
#: renumber list items in the chains found (:data:`RENUMBER`)
RENUMBER_OPTION = Option("renumber", bool)


class CandidateDrafter(Drafter):
    """Model-free drafting, one request (row) at a time. ``num_candidates`` chains per row at most."""

    capabilities = DrafterCapabilities(free=True)
    #: what :meth:`for_target` adds to a subclass's own: ``num_drafts`` (the CLI's ``--num-drafts``) means
    #: ``num_candidates``; ``renumber`` list items
    options = (NUM_CANDIDATES, Option("num_drafts", int, 1, MAX_CANDIDATES), RENUMBER_OPTION)

    def __init__(self, num_candidates: int = 1):
        NUM_CANDIDATES.check(num_candidates, f"drafter {self.name!r}")
        self.capabilities = replace(self.capabilities, max_candidates=int(num_candidates))
        self._rows: dict[int, object] = {}
        #: rewrites list item numbers in the chains found (None: chains as found)
        self.enumeration: Enumeration | None = None

    @classmethod
    def for_target(cls, target, **options) -> "CandidateDrafter":
        """The registry's factory; ``num_drafts`` (the CLI's ``--num-drafts``) means ``num_candidates``;
        ``renumber`` (default :data:`RENUMBER`): renumber list items with ``target``'s tokenizer."""
        options = dict(options)
        if "num_drafts" in options:
            if "num_candidates" in options:
                raise ConfigError("give num_candidates or num_drafts, not both")
            options["num_candidates"] = options.pop("num_drafts")
        renumber = options.pop("renumber", RENUMBER)
        RENUMBER_OPTION.check(renumber, f"drafter {cls.name!r}")
        drafter = cls(**options)
        if renumber:
            drafter.enumeration = Enumeration.of_tokenizer(target.tokenizer)
        return drafter

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        super().check_options(options, owner)
        if "num_drafts" in options and "num_candidates" in options:
            raise ConfigError("give num_candidates or num_drafts, not both")

    @property
    def num_candidates(self) -> int:
        return self.capabilities.max_candidates

    @abstractmethod
    def new_row(self, context: RequestContext) -> object:
        """The search state of a request that joins (indexes of its prompt, ...)."""

    @abstractmethod
    def candidates(self, row: object, sequence: list[int], limit: int) -> tuple[list[list[int]], object]:
        """Up to ``num_candidates`` chains of at most ``limit`` tokens continuing ``sequence``, best first
        (distinct continuations, or the root-to-leaf paths of a tree: shared prefixes are merged into one
        node for the target pass), and the evidence behind the first (see :class:`Draft`)."""

    def start(self, contexts: list[RequestContext]) -> None:
        for context in contexts:
            self._rows[context.request_id] = self.new_row(context)

    def finish(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        found = []
        for request in requests:
            if request.request_id not in self._rows:  # proposed for without start: its sequence is its prompt
                self.start([RequestContext(request.request_id, list(request.sequence))])
            row = self._rows[request.request_id]
            chains, evidence = (self.candidates(row, request.sequence, request.max_tokens) if request.max_tokens > 0
                                else ([], None))
            if self.enumeration is not None and chains:
                chains = self._renumbered(request.sequence, chains, request.max_tokens)
            found.append((chains, evidence))
        return Draft.from_chains([chains for chains, _ in found], self.num_candidates,
                                 [evidence for _, evidence in found])

    def _renumbered(self, sequence: list[int], chains: list[list[int]], limit: int) -> list[list[int]]:
        out: list[list[int]] = []
        for chain in self.enumeration.renumber(sequence, chains):
            chain = chain[:limit]
            if chain not in out:
                out.append(chain)
        return out
