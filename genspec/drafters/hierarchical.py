"""Hierarchical speculation (TriForce-style): a stack of drafters, each drafting for the next and
the last for the target; every model-based level verifies the level below it losslessly."""
from __future__ import annotations

from genspec.drafters.base import Drafter
from genspec.drafters.draft_model import DraftModelDrafter
from genspec.errors import ConfigError

#: the levels of ``--drafter hierarchical`` without ``-O levels=...``, from the first (cheapest) up
DEFAULT_LEVELS = ("prompt-lookup", "quantized")


def cannot_verify(name: str) -> str:
    """The refusal of level ``name`` above another: it does not run a model, so it cannot verify one."""
    return (f"level {name!r} cannot verify another drafter: only model-based levels (draft-model, early-exit, "
            "layer-skip, quantized) can")


class HierarchicalDrafter:
    """Stacks drafters the registry built by name (:class:`genspec.drafters.registry.HierarchicalStack`);
    it is not a drafter class of its own: the top level is, named ``hierarchical``."""

    name = "hierarchical"

    @classmethod
    def stack(cls, levels: list[tuple[str, Drafter]]) -> Drafter:
        """``levels[0]`` drafts for ``levels[1]``, ..., the last level drafts for the target (pairs of
        name and drafter). Every level but the first must be model-based (it verifies the one below)."""
        drafter = None
        for depth, (name, level) in enumerate(levels):
            if depth > 0:
                if not isinstance(level, DraftModelDrafter):
                    raise ConfigError(cannot_verify(name))
                level.inner = drafter
            drafter = level
        drafter.name = cls.name
        return drafter
