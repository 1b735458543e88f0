"""``hybrid``: prompt lookup where its evidence is strong, the trained draft head elsewhere, per row and
per step.

Lookup drafts cost nothing and are nearly always right after a long match (on Spec-Bench with the
embedded model a 4-token match starts a correct draft 0.92 of the time, a 1-token match 0.22:
``python benchmarks/lookup_match_acceptance.py``), while the head's drafts cost a little and are right
about as often wherever the text goes. So each step, each row takes lookup's proposal when it matched
at least ``min_match`` tokens, and the head's otherwise. The head sees every step's target hidden states
either way (its cache stays in step).
"""
from __future__ import annotations

from genspec.drafters.base import Draft, Drafter, DraftRequest, RequestContext
from genspec.drafters.head import HeadDrafter
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.drafters.trained import FEATURE_HEAD_COST_PRIOR
from genspec.errors import ConfigError


class HybridDrafter(Drafter):
    """Options: ``path`` (the head), ``min_match`` (lookup's match length that wins, default 3),
    ``tree_nodes`` / ``tree_top_k`` (the head's tree), ``max_ngram`` (lookup's)."""

    name = "hybrid"
    free = False
    reads_target_hidden = True
    draft_cost_prior = FEATURE_HEAD_COST_PRIOR

    def __init__(self, lookup: PromptLookupDrafter, head: HeadDrafter, min_match: int = 3):
        if int(min_match) != min_match or min_match < 1:
            raise ConfigError(f"min_match must be an integer >= 1, got {min_match}")
        self.lookup, self.head, self.min_match = lookup, head, int(min_match)
        self.max_candidates = max(lookup.max_candidates, head.max_candidates)
        self.samples_drafts = head.samples_drafts

    @classmethod
    def for_target(cls, target, path: str | None = None, min_match: int = 3, tree_nodes: int = 0,
                   tree_top_k: int = 4, max_ngram: int = 4) -> "HybridDrafter":
        return cls(PromptLookupDrafter(max_ngram=max_ngram),
                   HeadDrafter.for_target(target, path=path, tree_nodes=tree_nodes, tree_top_k=tree_top_k), min_match)

    def start(self, contexts: list[RequestContext]) -> None:
        self.lookup.start(contexts)
        self.head.start(contexts)

    def finish(self, request_ids: list[int]) -> None:
        self.lookup.finish(request_ids)
        self.head.finish(request_ids)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        looked = self.lookup.propose([DraftRequest(r.request_id, r.sequence, r.max_tokens) for r in requests])
        strong = [(looked.evidence_of(i) or 0) >= self.min_match for i in range(len(requests))]
        headed = self.head.propose([DraftRequest(r.request_id, r.sequence, 0 if s else r.max_tokens, r.hidden)
                                    for r, s in zip(requests, strong)])
        rows = [looked.rows([i]) if s else headed.rows([i]) for i, s in enumerate(strong)]
        return Draft.stack(rows)
