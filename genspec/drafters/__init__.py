"""Speculators behind one interface (:class:`Drafter`). Build one by name with :func:`build_drafter`."""
from genspec.drafters.base import Draft, Drafter, TreeDraft  # noqa: F401
from genspec.drafters.draft_model import DraftModelDrafter  # noqa: F401
from genspec.drafters.prompt_lookup import PromptLookupDrafter  # noqa: F401
