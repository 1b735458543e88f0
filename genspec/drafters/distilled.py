"""``draft``: the distilled draft model (``genspec train draft``) drafting as any draft model does
(:class:`genspec.drafters.draft_model.DraftModelDrafter`: its own cache, chains sampled from its
processed law, multi-draft trees with ``num_drafts``). Its network is the one the saved directory holds: a
transformer with its KV cache, or a GRU or LSTM (``genspec train draft --arch gru|lstm``) whose cache is its
recurrent state after each token (:class:`genspec.speculators.recurrent.RecurrentLM`)."""
from __future__ import annotations

from genspec.drafters.draft_model import CONFIDENCE_THRESHOLD, NUM_DRAFTS, DraftModelDrafter
from genspec.drafters.trained import TRAINED_PATH, load_for_target


class DistilledDrafter(DraftModelDrafter):
    """Options: ``path`` (the draft's directory), ``num_drafts``, ``confidence_threshold``."""

    name = "draft"
    options = (TRAINED_PATH, NUM_DRAFTS, CONFIDENCE_THRESHOLD)

    @classmethod
    def for_target(cls, target, path: str | None = None, num_drafts: int = 1,
                   confidence_threshold: float = 0.0) -> "DistilledDrafter":
        draft, vocab_ids = load_for_target(target, path, "draft")
        model = draft.to(target.dtype).as_model(vocab_ids, target.vocab_size, target.tokenizer)
        return cls(model, num_drafts=num_drafts, confidence_threshold=confidence_threshold)
