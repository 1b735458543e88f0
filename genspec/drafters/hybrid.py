"""``hybrid``: lookup where its evidence is strong, the trained draft head elsewhere, per row and per step.

Lookup drafts cost nothing and are nearly always right after a long match (on Spec-Bench with the
embedded model a 4-token match starts a correct draft 0.92 of the time, a 1-token match 0.22:
``python benchmarks/lookup_match_acceptance.py``), while the head's drafts cost a little and are right
about as often wherever the text goes. So each step, each row takes lookup's proposal when it matched
at least ``min_match`` tokens, and the head's otherwise.

The hybrid is a free drafter whose :attr:`~genspec.drafters.base.Drafter.fallback` is the head: the engine
sees lookup's proposal and its evidence before it plans (so a long match is drafted long, as lookup alone
would be, up to the lookup's own depth: 24 for ``suffix``), plans the other rows at the head's cost under
the evidence grade ``"head"`` (the policy learns the head's acceptance apart from lookup's), and asks the
head only for those rows. The head reads every step's target hidden states either way (they come with the
free proposal), so its cache stays in step.
"""
from __future__ import annotations

from genspec.drafters.base import Draft, Drafter, DraftRequest, RequestContext
from genspec.drafters.head import DEFAULT_TREE_NODES, HeadDrafter
from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.drafters.suffix import SuffixDrafter
from genspec.errors import ConfigError

#: the evidence grade of rows left to the head
HEAD_EVIDENCE = "head"
#: the lookups a hybrid can use, by ``lookup`` option
LOOKUPS = {"prompt-lookup": PromptLookupDrafter, "suffix": SuffixDrafter}
#: the default lookup, chosen on Spec-Bench prompts that ``genspec bench`` does not measure and the head
#: never trained on (each category's 3rd and 4th; embedded model, greedy, 128 tokens, 2 repeats, 2-core AMD
#: EPYC): suffix + head 2.27x [2.26-2.29] plain against 2.22x [2.17-2.27] with prompt lookup, ahead in both
#: repeats and fastest in 9 of 13 categories (``genspec bench --methods "hybrid,hybrid:lookup=suffix"
#: --skip-prompts 2 --num-prompts 2 --max-new-tokens 128 --repeats 2``, run while prompt lookup was the
#: default; benchmarks/results/hybrid_lookup_unmeasured)
DEFAULT_LOOKUP = "suffix"


class HybridDrafter(Drafter):
    """Options: ``path`` (the head), ``lookup`` (``suffix``, the default, or ``prompt-lookup``),
    ``min_match`` (the lookup match length that wins, default 3), ``tree_nodes`` / ``tree_top_k`` (the
    head's tree); other options go to the lookup (``max_ngram`` for prompt lookup, ``factor``,
    ``num_candidates``, ... for suffix)."""

    name = "hybrid"
    free = True
    reads_target_hidden = True

    def __init__(self, lookup: Drafter, head: HeadDrafter, min_match: int = 3):
        if int(min_match) != min_match or min_match < 1:
            raise ConfigError(f"min_match must be an integer >= 1, got {min_match}")
        if not lookup.free:
            raise ConfigError(f"the hybrid's lookup must be a free drafter; {lookup.name!r} is not")
        self.lookup, self.head, self.min_match = lookup, head, int(min_match)
        self.fallback = head
        self.max_candidates = max(lookup.max_candidates, head.max_candidates)
        self.samples_drafts = head.samples_drafts
        self.default_draft_tokens = lookup.default_draft_tokens

    @classmethod
    def for_target(cls, target, path: str | None = None, lookup: str = DEFAULT_LOOKUP, min_match: int = 3,
                   tree_nodes: int = DEFAULT_TREE_NODES, tree_top_k: int = 4, **lookup_options) -> "HybridDrafter":
        if lookup not in LOOKUPS:
            raise ConfigError(f"unknown lookup {lookup!r} for the hybrid; choose from {', '.join(LOOKUPS)}")
        return cls(LOOKUPS[lookup].for_target(target, **lookup_options),
                   HeadDrafter.for_target(target, path=path, tree_nodes=tree_nodes, tree_top_k=tree_top_k), min_match)

    def start(self, contexts: list[RequestContext]) -> None:
        self.lookup.start(contexts)
        self.head.start(contexts)

    def finish(self, request_ids: list[int]) -> None:
        self.lookup.finish(request_ids)
        self.head.finish(request_ids)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        """Lookup's proposal where it matched ``min_match`` tokens or more, an empty row (evidence
        ``"head"``) for the engine to hand to the head elsewhere. The head reads the new hidden states now."""
        self.head.propose([DraftRequest(r.request_id, r.sequence, 0, r.hidden) for r in requests])
        looked = self.lookup.propose([DraftRequest(r.request_id, r.sequence, r.max_tokens) for r in requests])
        strong = [(looked.evidence_of(i) or 0) >= self.min_match for i in range(len(requests))]
        rows = [looked.rows([i]) if s else Draft.empty(1) for i, s in enumerate(strong)]
        draft = Draft.stack(rows)
        evidence = tuple(looked.evidence_of(i) if s else HEAD_EVIDENCE for i, s in enumerate(strong))
        return Draft(draft.tokens, draft.lengths, draft.probs, evidence)
