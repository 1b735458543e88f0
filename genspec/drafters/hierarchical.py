"""Hierarchical speculation (TriForce-style): a stack of drafters, each drafting for the next and
the last for the target; every model-based level verifies the level below it losslessly."""
from __future__ import annotations

from genspec.drafters.base import Drafter
from genspec.drafters.draft_model import DraftModelDrafter
from genspec.errors import ConfigError


class HierarchicalDrafter:
    """The registry entry ``hierarchical``: builds the stack (it is not a drafter class of its own; the
    top level is, named ``hierarchical``)."""

    name = "hierarchical"

    @classmethod
    def for_target(cls, target, levels: list[str] | str = ("prompt-lookup", "quantized"),
                   draft_model: str | None = None) -> Drafter:
        """``levels[0]`` drafts for ``levels[1]``, ..., the last level drafts for the target. Every level
        but the first must be model-based (it verifies the one below)."""
        from genspec.api import DRAFTERS, build_drafter

        names = levels.split(",") if isinstance(levels, str) else list(levels)
        if len(names) < 2:
            raise ConfigError("hierarchical drafting needs at least two levels, e.g. prompt-lookup,quantized")
        drafter = None
        for depth, name in enumerate(names):
            if name in (cls.name, "none") or name not in DRAFTERS:
                raise ConfigError(f"unknown or unstackable level {name!r} in hierarchical levels")
            options = {"draft_model": draft_model} if name == "draft-model" else {}
            level = build_drafter(name, target, **options)
            if depth > 0:
                if not isinstance(level, DraftModelDrafter):
                    raise ConfigError(f"level {name!r} cannot verify another drafter: only model-based levels "
                                      "(draft-model, early-exit, layer-skip, quantized) can")
                level.inner = drafter
            drafter = level
        drafter.name = cls.name
        return drafter
