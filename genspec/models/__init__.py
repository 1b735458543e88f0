"""Target and draft models behind one interface (:class:`CausalLM`)."""
from genspec.models.base import CausalLM  # noqa: F401
from genspec.models.hf import HFCausalLM  # noqa: F401
