"""The acceptance rule as one validated value: its kind, epsilon, residual and delta.

A :class:`Rule` is concrete: "auto" (the engine's choice between the standard and the coupled rule) is a
request setting (:class:`genspec.config.GenerationConfig`), resolved when the request is admitted. The
functions of :mod:`genspec.acceptance.rules` take a Rule; rows verified together may carry one epsilon and
delta each (:meth:`Rule.batch`: ``[B]`` tensors), the kind and residual being shared.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from genspec.checks import finite
from genspec.errors import ConfigError


class RuleKind(StrEnum):
    """overaccept: keep y with probability min{1, (q(y) + eps)/p(y)} (eps 0 and the OPT residual: the
    standard, lossless rule); typical: Medusa's, keep y iff q(y) > min(eps, delta exp(-H(q))) (lossy);
    coupled: draft and target draw with shared noise, keep y iff they agree (lossless)."""

    OVERACCEPT = "overaccept"
    TYPICAL = "typical"
    COUPLED = "coupled"


class Residual(StrEnum):
    """The law drawn from after a rejection: "opt", Theorem 4's minimal-bias norm([q - b p]+); "uno", q
    itself (biased even at eps 0)."""

    OPT = "opt"
    UNO = "uno"


RULES = tuple(kind.value for kind in RuleKind)
RESIDUALS = tuple(residual.value for residual in Residual)
BIAS_RULES = (RuleKind.OVERACCEPT.value, RuleKind.TYPICAL.value)  # bias and rejection have closed forms (theory.pareto)


@dataclass(frozen=True)
class Rule:
    """An acceptance rule (docs/theory.md; :mod:`genspec.acceptance.rules`). ``kind`` and ``residual`` take
    their enums or the strings of their values; ``epsilon`` (over-acceptance, or typical acceptance's cap) and
    ``delta`` (typical acceptance's entropy factor, Medusa's default 0.3) are numbers >= 0, or ``[B]`` tensors
    of one value per row (:meth:`batch`). Invalid values raise a one-line
    :class:`~genspec.errors.ConfigError`."""

    kind: RuleKind = RuleKind.OVERACCEPT
    epsilon: float | torch.Tensor = 0.0
    residual: Residual = Residual.OPT
    delta: float | torch.Tensor = 0.3

    def __post_init__(self):
        object.__setattr__(self, "kind", _member(RuleKind, self.kind, "unknown acceptance rule", RULES))
        object.__setattr__(self, "residual", _member(Residual, self.residual, "unknown residual", RESIDUALS))
        for name in ("epsilon", "delta"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                values = value.to(torch.float64)
                if not bool(torch.isfinite(values).all()):
                    raise ConfigError(f"{name} must be a finite number, got {value}")
            else:
                values = finite(name, value)
                object.__setattr__(self, name, values)
            if not bool((torch.as_tensor(values) >= 0).all()):
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.kind is RuleKind.COUPLED and not _is_zero(self.epsilon):
            raise ConfigError(f"the coupled rule is lossless and takes no epsilon, got {self.epsilon}")

    @property
    def lossless(self) -> bool:
        """True only for the standard rule (over-acceptance with eps = 0, every row if per row, and the OPT
        residual) and the coupled rule (which has no eps or residual). Every other setting (UNO at eps = 0
        included) changes the output law."""
        if self.kind is RuleKind.COUPLED:
            return True
        return self.kind is RuleKind.OVERACCEPT and self.residual is Residual.OPT and _is_zero(self.epsilon)

    def report(self) -> dict:
        """The rule as reported in stats and JSON: rule, epsilon, delta (typical only), residual (not for
        the coupled rule, which has none), lossless."""
        return {"rule": self.kind.value, "epsilon": self.epsilon,
                "delta": self.delta if self.kind is RuleKind.TYPICAL else None,
                "residual": None if self.kind is RuleKind.COUPLED else self.residual.value, "lossless": self.lossless}

    @classmethod
    def batch(cls, rules: Sequence["Rule"]) -> "Rule":
        """One rule for rows verified together: their shared kind and residual, each row's epsilon and delta
        in ``[B]`` float64 tensors. The rows' rules are valid already: not validated again (the engine batches
        its groups' rules every step)."""
        kinds = {(r.kind, r.residual) for r in rules}
        if len(kinds) != 1:
            raise ValueError(f"rows verified together share a rule kind and residual, got {sorted(kinds)}")
        batched = object.__new__(cls)
        for name, value in (("kind", rules[0].kind), ("residual", rules[0].residual),
                            ("epsilon", torch.tensor([float(r.epsilon) for r in rules], dtype=torch.float64)),
                            ("delta", torch.tensor([float(r.delta) for r in rules], dtype=torch.float64))):
            object.__setattr__(batched, name, value)
        return batched

    def per_row(self, change: Callable[[torch.Tensor], torch.Tensor], names=("epsilon", "delta")) -> "Rule":
        """This rule with ``change`` applied to its per-row (tensor) parameters ``names``, e.g. an ``unsqueeze``
        that makes them broadcast against ``[B, k]``; numbers stay as they are. Not validated again."""
        copy = object.__new__(Rule)
        for name in ("kind", "epsilon", "residual", "delta"):
            value = getattr(self, name)
            changed = name in names and isinstance(value, torch.Tensor)
            object.__setattr__(copy, name, change(value) if changed else value)
        return copy


def _member(enum, value, what: str, choices: tuple[str, ...]):
    try:
        return enum(value)
    except ValueError:
        raise ConfigError(f"{what} {value!r}; choose from {', '.join(choices)}") from None


def _is_zero(epsilon: float | torch.Tensor) -> bool:
    """Whether ``epsilon`` (a number, or one per row) is 0 everywhere; a number is compared as one, without the
    tensor the per-row case needs (rules are asked this for every request at every step)."""
    if isinstance(epsilon, torch.Tensor):
        return bool((epsilon == 0).all())
    return epsilon == 0


STANDARD = Rule()  # the standard, lossless rule of speculative decoding
