"""Speculators behind one interface (:class:`Drafter`). Build one by name with :func:`genspec.build_drafter`."""
from genspec.drafters.base import Draft, Drafter, DraftRequest, RequestContext  # noqa: F401
from genspec.drafters.draft_model import DraftModelDrafter  # noqa: F401
from genspec.drafters.prompt_lookup import PromptLookupDrafter  # noqa: F401
