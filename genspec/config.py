"""What to generate: :class:`GenerationConfig`, composed of typed parts that each validate themselves.

- ``sampling``: :class:`~genspec.sampling.SamplingConfig` (temperature, top-k, top-p, repetition penalty);
- ``stopping``: :class:`Stopping` (token budget, stop strings, end-of-sequence tokens);
- ``speculation``: :class:`Speculation` (drafter, its per-request options, draft depth, draft-length policy);
- ``acceptance_rule``: the :class:`~genspec.acceptance.Rule`, or with ``auto_rule`` the engine's choice at
  admission (:meth:`GenerationConfig.resolved`);
- ``seed``, ``measure_bias`` and ``logprobs`` (report the target's log-probabilities of the generated tokens),
  which concern several parts.

Users call the flat keyword constructor, ``GenerationConfig(max_new_tokens=32, temperature=0.7, rule="typical",
epsilon=0.09)``, and read the flat names back (``config.temperature``); closed sets of values are enums that
also take their strings.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

from genspec.acceptance import STANDARD, Rule, RuleKind
from genspec.checks import integer
from genspec.draft_length import POLICIES, DraftLengthPolicy
from genspec.drafters.base import DEFAULT_DRAFT_TOKENS
from genspec.errors import ConfigError
from genspec.sampling import SamplingConfig

AUTO = "auto"  # GenerationConfig's rule: the engine picks the rule (GenerationConfig.resolved)
#: the most alternatives a request may ask log-probabilities of at each position (OpenAI's chat API's limit)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Stopping:
    """When a request ends: after ``max_new_tokens``, at a token completing one of ``stop_strings`` (one
    string or several), or at one of ``eos_token_ids`` (None: the model's own)."""

    max_new_tokens: int = 64
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "max_new_tokens", integer("max_new_tokens", self.max_new_tokens, minimum=1))
        eos = self.eos_token_ids
        if eos is not None:
            if isinstance(eos, (str, bytes)) or not isinstance(eos, Iterable):
                raise ConfigError(f"eos_token_ids must be a sequence of token ids, got {eos!r}")
            object.__setattr__(self, "eos_token_ids", tuple(integer("eos_token_ids", t, minimum=0) for t in eos))
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings or ())
        if any(not isinstance(s, str) or not s for s in stops):
            # an empty stop string is found in any text: the request would stop after its first token
            raise ConfigError(f"stop strings must be non-empty text, got {list(stops)!r}")
        object.__setattr__(self, "stop_strings", stops)


@dataclass(frozen=True)
class Speculation:
    """How a request drafts. ``drafter`` names one of the engine's drafters (None: the engine's default;
    ``"none"``: no speculation); ``drafter_options`` are per-request options that drafter accepts (its
    ``request_options``, e.g. the edit drafter's ``source``); ``num_draft_tokens`` the depth it drafts at
    most (None: the drafter's own, :meth:`GenerationConfig.resolved`); ``draft_length`` the policy that
    picks each step's length."""

    drafter: str | None = None
    drafter_options: dict = field(default_factory=dict)
    num_draft_tokens: int | None = None
    draft_length: DraftLengthPolicy = DraftLengthPolicy.COST

    def __post_init__(self):
        if self.num_draft_tokens is not None:
            object.__setattr__(self, "num_draft_tokens", integer("num_draft_tokens (k)", self.num_draft_tokens, minimum=1))
        try:
            object.__setattr__(self, "draft_length", DraftLengthPolicy(self.draft_length))
        except ValueError:
            raise ConfigError(f"draft_length must be one of {POLICIES}, got {self.draft_length!r}") from None


#: the flat keywords of GenerationConfig, by the part that holds them
_PARTS = {"sampling": [f.name for f in fields(SamplingConfig)], "stopping": [f.name for f in fields(Stopping)],
          "speculation": [f.name for f in fields(Speculation)]}
_PART_OF = {name: part for part, names in _PARTS.items() for name in names}
_RULE_SETTINGS = ("rule", "epsilon", "residual", "delta")


@dataclass(init=False)
class GenerationConfig:
    """What to generate. ``temperature == 0`` is greedy.

    Acceptance (:mod:`genspec.acceptance`): ``rule`` "overaccept" keeps a draft token with probability
    b = min{1, (q + eps)/p}; with ``epsilon`` 0 and ``residual`` "opt" that is the standard, lossless
    rule. "coupled" (lossless) draws draft and target with shared noise and keeps matching tokens: a
    seeded request then gives the same tokens under every draft-length policy, whatever its drafter
    (:mod:`genspec.randomness`), for a lower acceptance than the standard rule's 1 - TV. "auto" (the
    default) is "coupled" for a seeded, sampled, lossless request whose drafter samples its drafts
    (``DrafterCapabilities.samples_drafts``) and "overaccept" otherwise (:meth:`resolved`; the stats report the rule
    used). ``epsilon > 0``, or ``residual`` "uno" (resample from q, biased even at eps 0),
    or ``rule`` "typical" (Medusa: keep y iff q(y) > min(eps, delta exp(-H(q)))) are lossy: the output
    no longer has the target's law (:attr:`lossless` False, reported in the stats). Lossy rules need
    sampling (temperature > 0): greedy decoding is exact token matching. ``measure_bias``: record the
    rule's exact bias and rejection per judged draft position (``genspec.theory.pareto``; chain drafts
    only, temperature > 0). ``logprobs``: None, or report with each generated token the target's
    log-probability of it and of the ``logprobs`` most likely tokens there (0: the token's alone; at most
    :data:`MAX_TOP_LOGPROBS`), :class:`~genspec.records.TokenLogprob`.

    Takes the flat keywords of its parts (``max_new_tokens``, ``temperature``, ``rule``, ``epsilon``, ...,
    read back under the same names) and/or the parts themselves; a flat keyword overrides its part's value
    (so :func:`dataclasses.replace` with flat names works).
    """

    sampling: SamplingConfig
    stopping: Stopping
    speculation: Speculation
    acceptance_rule: Rule  # the rule; with auto_rule, the standard rule the engine may make coupled
    auto_rule: bool
    seed: int | None
    measure_bias: bool
    logprobs: int | None

    def __init__(self, *, sampling: SamplingConfig | None = None, stopping: Stopping | None = None,
                 speculation: Speculation | None = None, acceptance_rule: Rule | None = None,
                 auto_rule: bool | None = None, seed: int | None = None, measure_bias: bool = False,
                 logprobs: int | None = None, **settings):
        unknown = sorted(set(settings) - set(_PART_OF) - set(_RULE_SETTINGS))
        if unknown:
            raise ConfigError(f"unknown generation setting(s) {', '.join(unknown)}; GenerationConfig takes "
                              f"{', '.join([*_PART_OF, *_RULE_SETTINGS, 'seed', 'measure_bias', 'logprobs'])}")
        parts = {"sampling": sampling or SamplingConfig(), "stopping": stopping or Stopping(),
                 "speculation": speculation or Speculation()}
        for part, names in _PARTS.items():
            changes = {name: settings[name] for name in names if name in settings}
            if changes:
                parts[part] = replace(parts[part], **changes)
        self.sampling, self.stopping, self.speculation = parts["sampling"], parts["stopping"], parts["speculation"]
        self.acceptance_rule, self.auto_rule = _acceptance(acceptance_rule, auto_rule, settings)
        self.seed = None if seed is None else integer("seed", seed, minimum=0)  # NumPy's SeedSequence takes ints >= 0
        self.measure_bias = measure_bias
        if logprobs is not None and integer("logprobs", logprobs, minimum=0) > MAX_TOP_LOGPROBS:
            raise ConfigError(f"logprobs must be at most {MAX_TOP_LOGPROBS}, got {logprobs}")
        self.logprobs = None if logprobs is None else int(logprobs)
        if measure_bias and self.acceptance_rule.kind is RuleKind.COUPLED:
            raise ConfigError("bias measurement needs the overaccept or typical rule (the coupled rule is "
                              "lossless and its rejection has no closed form)")
        if self.sampling.greedy and (not self.lossless or measure_bias):
            raise ConfigError(f"{'bias measurement' if self.lossless else 'a lossy acceptance rule'} needs "
                              f"temperature > 0: at temperature 0 decoding is greedy token matching, which is exact")

    @property
    def rule(self) -> RuleKind | str:
        """The rule's kind, or "auto" before :meth:`resolved`."""
        return AUTO if self.auto_rule else self.acceptance_rule.kind

    @property
    def epsilon(self) -> float:
        return self.acceptance_rule.epsilon

    @property
    def residual(self):
        return self.acceptance_rule.residual

    @property
    def delta(self) -> float:
        return self.acceptance_rule.delta

    @property
    def lossless(self) -> bool:
        """True iff the output has exactly the target's law (the standard or the coupled rule)."""
        return self.acceptance_rule.lossless

    @property
    def acceptance(self) -> dict:
        """The acceptance rule as reported in stats and JSON: rule, epsilon, delta (typical only),
        residual, lossless (:meth:`genspec.acceptance.Rule.report`)."""
        report = self.acceptance_rule.report()
        if self.auto_rule:
            report["rule"] = AUTO
        return report

    def resolved(self, samples_drafts: bool, default_draft_tokens: int = DEFAULT_DRAFT_TOKENS) -> "GenerationConfig":
        """This config made concrete for a drafter that does (or not) sample its drafts and drafts
        ``default_draft_tokens`` at most unless told otherwise: ``num_draft_tokens`` None becomes that
        depth; rule "auto" becomes "coupled" when the request is seeded, sampled and lossless and the
        drafter samples (so that its seed reproduces it under every draft-length policy), else "overaccept"."""
        speculation = self.speculation
        if speculation.num_draft_tokens is None:
            speculation = replace(speculation, num_draft_tokens=default_draft_tokens)
        rule = self.acceptance_rule
        if self.auto_rule and (samples_drafts and self.seed is not None and not self.sampling.greedy
                               and self.lossless and not self.measure_bias):
            rule = replace(rule, kind=RuleKind.COUPLED)
        return replace(self, speculation=speculation, acceptance_rule=rule, auto_rule=False)


def _flat(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name), doc=f"``{part}.{name}``")


for _name, _part in _PART_OF.items():
    setattr(GenerationConfig, _name, _flat(_part, _name))


def _acceptance(rule: Rule | None, auto: bool | None, settings: dict) -> tuple[Rule, bool]:
    """The acceptance part from a given rule (None: the standard one, "auto") and the flat settings
    ``rule`` ("auto", a kind or a :class:`Rule`), ``epsilon``, ``residual``, ``delta`` that override it. "auto" chooses between
    lossless rules only: with a lossy epsilon or residual it is "overaccept"."""
    if isinstance(settings.get("rule"), Rule):  # the flat ``rule`` may be a whole Rule
        rule, auto, settings = settings["rule"], False, {k: v for k, v in settings.items() if k != "rule"}
    base = rule or STANDARD
    auto = (rule is None) if auto is None else auto
    kind = settings.get("rule", base.kind if not auto else AUTO)
    auto = kind == AUTO
    concrete = Rule(RuleKind.OVERACCEPT if auto else kind, settings.get("epsilon", base.epsilon),
                    settings.get("residual", base.residual), settings.get("delta", base.delta))
    return concrete, auto and concrete.lossless


def with_overrides(config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    """``config`` (None: the defaults) with the flat or part settings ``overrides`` changed."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise ConfigError(f"config must be a GenerationConfig, got {type(config).__name__}")
    if config is None:
        return GenerationConfig(**overrides)
    return replace(config, **overrides) if overrides else config
