"""``hybrid``: lookup where its evidence is strong, the trained draft head elsewhere, per row and per step.

Lookup drafts cost nothing and are nearly always right after a long match, seldom after a 1-token one (the
manual's Lookup page has the measurements), while the head's drafts cost a little and are right about as
often wherever the text goes. So each step, each row takes lookup's proposal when it matched
at least ``min_match`` tokens, and the head's otherwise.

The hybrid is a composite drafter, free and costly: its offer (:meth:`~genspec.drafters.base.Drafter.offer`)
holds lookup's proposal and its evidence where the match is strong, so the plan sees them before it decides
(a long match is drafted long, as lookup alone would be, up to the lookup's own depth: 24 for ``suffix``),
and a costly draft by the head (its ``fallback``) elsewhere, which the plan prices at the head's cost under
the evidence grade ``"head"`` (the policy learns the head's acceptance apart from lookup's); the head then
drafts only those rows. The target's hidden states reach the head with its drafts (the engine keeps them
until then), so its features stay complete.

A weak match is not worthless, only worse than the head on average: where lookup matched fewer than
``min_match`` tokens (but some), its best chain joins the head's tree as one more candidate
(``merge_weak``, :class:`HeadAndWeakLookup`), a few more tokens in the same verify pass, and the target
keeps whichever path it agrees with (several drafts verified together).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from genspec.drafters.base import (Draft, Drafter, DrafterCapabilities, DraftOffer, DraftRequest, Option, RequestContext,
                                   check_options)
from genspec.drafters.head import (DEFAULT_PROMPT_STATES, DEFAULT_TREE_FIRST, DEFAULT_TREE_NODES, DEFAULT_TREE_TOP_K,
                                   HeadDrafter)
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.drafters.suffix import SuffixDrafter
from genspec.drafters.trained import load_for_target
from genspec.errors import ConfigError

#: the evidence grade of rows left to the head
HEAD_EVIDENCE = "head"
#: the lookups a hybrid can use, by ``lookup`` option
LOOKUPS = {"prompt-lookup": PromptLookupDrafter, "suffix": SuffixDrafter}
#: the default lookup, chosen on Spec-Bench prompts that ``genspec bench`` does not measure and the head
#: never trained on: suffix + head was ahead of prompt lookup + head in both repeats and most categories (the
#: manual's Hybrid page, how the defaults were chosen)
DEFAULT_LOOKUP = "suffix"
#: weak lookups join the head's tree by default (:class:`HeadAndWeakLookup`), chosen on the prompts no run
#: measures: merging was faster than no merging, and than lowering ``min_match`` instead, also with the policy
#: scoring later positions unverified (:meth:`~genspec.draft_length.DraftLength.shadow`; the manual's Hybrid
#: page, how the defaults were chosen).
MERGE_WEAK = True
#: the hybrid's own options (the head's and the lookup's are theirs)
MIN_MATCH = Option("min_match", int, 1)
MERGE_WEAK_OPTION = Option("merge_weak", bool)


class HeadAndWeakLookup(Drafter):
    """The hybrid's fallback with ``merge_weak``: the head's draft of a row, plus, where the lookup matched
    at least one token but fewer than ``min_match``, the lookup's best chain (cut to the planned length)
    as one more candidate: both verified as one tree, so the target keeps whichever is right. Only for
    deterministic head drafts (its trees, or greedy chains): a draft that carries laws (the head's sampled
    chains) has no room for a point-mass candidate and is left as the head made it."""

    name = "head+weak-lookup"

    def __init__(self, head: HeadDrafter):
        self.head = head
        self.capabilities = replace(head.capabilities, max_candidates=head.capabilities.max_candidates + 1)
        self.weak: dict[int, list[int]] = {}  # request id -> this step's weak lookup chain (set by the hybrid)

    def read(self, requests: list[DraftRequest]) -> None:
        self.head.read(requests)

    def block_tokens(self, depth: int) -> int:
        # the head's tree (a 4-node tree makes a 4-token block at every depth; the default, a chain's depth,
        # priced its depth-1 draft at 1 token); a weak chain, in the rows that have one this step, adds up to
        # ``depth`` more, not priced: the interface has no row, and a few more tokens add little to a verify
        # block's cost (the manual's Draft length page, verify costs)
        return self.head.block_tokens(depth)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        draft = self.head.propose(requests)
        if draft.probs is not None:
            return draft
        rows = []
        for i, request in enumerate(requests):
            paths = draft.chains(i)
            extra = self.weak.get(request.request_id, [])[:request.max_tokens]
            if extra and not any(path[:len(extra)] == extra for path in paths):
                paths.append(extra)
            rows.append(paths)
        return Draft.from_chains(rows, self.capabilities.max_candidates, list(draft.evidence) if draft.evidence else None)


class HybridDrafter(Drafter):
    """Options: ``path`` (the head), ``lookup`` (``suffix``, the default, or ``prompt-lookup``),
    ``min_match`` (the lookup match length that wins, default 3), ``merge_weak`` (a shorter match's chain
    joins the head's tree, default true), ``tree_nodes`` / ``tree_top_k`` / ``tree_first`` (the head's tree),
    ``first_threshold`` (the head's, default 0 here whatever the head's own: the hybrid is not measured with
    it); other options go to the lookup (``max_ngram`` for prompt lookup, ``factor``, ``num_candidates``, ... for suffix)."""

    name = "hybrid"
    # and every option of the lookup (check_options sends them there)
    options = (Option("lookup", str, choices=tuple(LOOKUPS)), MIN_MATCH, MERGE_WEAK_OPTION, *HeadDrafter.options)

    def __init__(self, lookup: Drafter, head: HeadDrafter, min_match: int = 3, merge_weak: bool = MERGE_WEAK):
        check_options((MIN_MATCH, MERGE_WEAK_OPTION), {"min_match": min_match, "merge_weak": merge_weak},
                      f"drafter {self.name!r}")
        if not lookup.capabilities.free:
            raise ConfigError(f"the hybrid's lookup must be a free drafter; {lookup.name!r} is not")
        self.lookup, self.head, self.min_match = lookup, head, int(min_match)
        self.merger = HeadAndWeakLookup(head) if merge_weak else None
        self.fallback = self.merger or head  # drafts the rows lookup leaves
        costly = self.fallback.capabilities
        # the head's hidden states (with its layers): they reach it with its drafts
        self.capabilities = DrafterCapabilities(
            free=True, costly=True, draft_cost_prior=costly.draft_cost_prior,
            default_draft_tokens=lookup.capabilities.default_draft_tokens,
            max_candidates=max(lookup.capabilities.max_candidates, costly.max_candidates), reads_target_hidden=True,
            target_hidden_layers=costly.target_hidden_layers, prompt_states=head.capabilities.prompt_states,
            samples_drafts=costly.samples_drafts)

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        """Its own options and the head's here (those bound one another as the head's do), the others by the
        lookup they go to."""
        owner = owner or f"drafter {cls.name!r}"
        own, head = {o.name for o in cls.options}, {o.name for o in HeadDrafter.options}
        super().check_options({k: v for k, v in options.items() if k in own}, owner)
        HeadDrafter.check_options({k: v for k, v in options.items() if k in head}, owner)
        lookup = options.get("lookup", DEFAULT_LOOKUP)
        LOOKUPS[lookup].check_options({k: v for k, v in options.items() if k not in own}, f"{owner} (lookup {lookup!r})")

    @classmethod
    def for_target(cls, target, path: str | None = None, lookup: str = DEFAULT_LOOKUP, min_match: int = 3,
                   tree_nodes: int = DEFAULT_TREE_NODES, tree_top_k: int = DEFAULT_TREE_TOP_K,
                   tree_first: int = DEFAULT_TREE_FIRST,
                   first_threshold: float = 0.0, merge_weak: bool = MERGE_WEAK,
                   prompt_states: int | None = DEFAULT_PROMPT_STATES, **lookup_options) -> "HybridDrafter":
        if lookup not in LOOKUPS:
            raise ConfigError(f"unknown lookup {lookup!r} for the hybrid; choose from {', '.join(LOOKUPS)}")
        head, vocab_ids = load_for_target(target, path, "head", drafter=cls.name)  # refusals name the hybrid
        return cls(LOOKUPS[lookup].for_target(target, **lookup_options),
                   HeadDrafter(target, head, vocab_ids, tree_nodes=tree_nodes, tree_top_k=tree_top_k,
                               tree_first=tree_first, first_threshold=first_threshold, prompt_states=prompt_states),
                   min_match, merge_weak)

    def start(self, contexts: list[RequestContext]) -> None:
        self.lookup.start(contexts)
        self.head.start(contexts)

    def finish(self, request_ids: list[int]) -> None:
        self.lookup.finish(request_ids)
        self.head.finish(request_ids)

    def offer(self, requests: list[DraftRequest]) -> DraftOffer:
        """Lookup's proposal where it matched ``min_match`` tokens or more; elsewhere a costly draft by the
        fallback (evidence ``"head"``; with ``merge_weak`` the fallback learns this step's weaker lookup chains
        here)."""
        looked = self.lookup.propose(requests)
        strong = [(looked.evidence_of(i) or 0) >= self.min_match for i in range(len(requests))]
        if self.merger is not None:
            self.merger.weak = {r.request_id: looked.first_chain(i) for i, r in enumerate(requests) if not strong[i]}
        draft = Draft.stack([looked.rows([i]) if s else Draft.empty(1) for i, s in enumerate(strong)])
        evidence = tuple(looked.evidence_of(i) if s else HEAD_EVIDENCE for i, s in enumerate(strong))
        # a strong match with nothing to copy is drafted too (under the match's grade)
        costly = tuple(not (s and p) for s, p in zip(strong, draft.proposed()))
        return DraftOffer(Draft(draft.tokens, draft.lengths, draft.probs, evidence), costly)

    # the rows offered as costly are the fallback's: it reads, drafts, prices and catches up
    def read(self, requests: list[DraftRequest]) -> None:
        self.fallback.read(requests)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        return self.fallback.propose(requests)

    def block_tokens(self, depth: int) -> int:
        return self.fallback.block_tokens(depth)

    def catch_up_tokens(self, request_id: int, sequence: list[int]) -> int:
        return self.fallback.catch_up_tokens(request_id, sequence)
