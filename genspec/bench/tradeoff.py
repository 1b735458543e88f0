"""``genspec tradeoff``: bias versus speed of lossy acceptance rules on real generations.

For every setting (a rule, its eps, delta and residual) the engine decodes the same prompts with the same
seeds, batch 1, measuring at every judged draft position the rule's exact rejection probability R and
bias TV(b p + R P, q) (``GenerationConfig.measure_bias``; definitions in :mod:`genspec.theory.pareto`).
Per setting:

- ``rejection_rate``: mean R over judged positions; ``bias_tv``: mean bias over them;
- ``pareto_bias``: mean of Theorem 5's front [TV(p, q) - R]_+ over the same positions, the least bias
  any rule with those rejection probabilities could have on these very steps;
- ``mean_accepted_length``: tokens per target call, 1 + accepted / calls; ``tokens_per_second``: new
  tokens over decoding time, the measurement's own time taken out;
- ``win_rate``: for a rule and eps run with both residuals, OPT's WinRate over UNO on the pairs of
  responses to the same prompt and seed (:mod:`genspec.bench.winrate`), on both settings' rows.

Settings run interleaved per prompt (prompt 1 with every setting, then prompt 2, ...), so that a slow
moment of a shared machine hits them all alike.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from genspec.acceptance import BIAS_RULES, RESIDUALS, Rule, RuleKind
from genspec.bench.prompts import BenchPrompt, load_spec_bench
from genspec.bench.winrate import Response, Scorer, win_rate
from genspec.engine import GenerationConfig, RequestResult, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.theory.pareto import StepStatistics

#: the JSON keys of one setting (``genspec tradeoff --json``), in order
KEYS = ("rule", "eps", "residual", "rejection_rate", "mean_accepted_length", "tokens_per_second", "bias_tv",
        "pareto_bias", "win_rate")
#: Spec-Bench prompts per category used here: the 3rd to the 5th (0-based 2..4). ``genspec bench`` measures
#: the first ones (2 by default) and ``genspec train`` continues the 6th on (cli/train.py,
#: BENCH_PROMPTS_EXCLUDED = 5), so the shipped head never trained on these.
PROMPT_SLOTS = range(2, 5)


@dataclass(frozen=True)
class Setting:
    """One acceptance rule of the grid (its ``delta`` only counts, and is only shown, for "typical")."""

    rule: Rule

    @property
    def epsilon(self) -> float:
        return self.rule.epsilon

    @property
    def residual(self) -> str:
        return self.rule.residual.value

    @property
    def delta(self) -> float | None:
        return self.rule.delta if self.rule.kind is RuleKind.TYPICAL else None

    @property
    def rule_name(self) -> str:
        """The rule as the JSON's ``rule`` value: "overaccept", or "typical:delta=D" (genspec's NAME:KEY=VALUE)."""
        kind = self.rule.kind.value
        return kind if self.delta is None else f"{kind}:delta={self.delta:g}"

    @property
    def label(self) -> str:
        return f"{self.rule_name} eps={self.epsilon:g} {self.residual}"

    @property
    def pair_key(self) -> tuple:
        """Settings that differ only in their residual are compared by WinRate."""
        return self.rule.kind, self.epsilon, self.delta

    def config(self, base: GenerationConfig) -> GenerationConfig:
        return replace(base, acceptance_rule=self.rule, auto_rule=False, measure_bias=True)


def settings_grid(rules, epsilons, residuals, deltas, typical_epsilons=None) -> list[Setting]:
    """rules x eps x (deltas for "typical") x residuals, in that nesting order; the typical rule takes its
    eps from ``typical_epsilons`` when given (its eps is a probability threshold, not an over-acceptance)."""
    if not rules or not epsilons or not residuals:
        raise ConfigError("give at least one rule, one eps and one residual")
    for rule in rules:
        if rule not in BIAS_RULES:
            raise ConfigError(f"unknown rule {rule!r}; choose from {', '.join(BIAS_RULES)}")
    for residual in residuals:
        if residual not in RESIDUALS:
            raise ConfigError(f"unknown residual {residual!r}; choose from {', '.join(RESIDUALS)}")
    if "typical" in rules and not deltas:
        raise ConfigError("the typical rule needs at least one delta")
    grid = []
    for rule in rules:
        for eps in (typical_epsilons if rule == "typical" and typical_epsilons else epsilons):
            for delta in (deltas if rule == "typical" else [None]):
                for residual in residuals:
                    grid.append(Setting(Rule(rule, eps, residual, *([] if delta is None else [delta]))))
    if len(set(grid)) != len(grid):
        raise ConfigError("a setting appears twice (repeated values in --eps, --delta or --residual)")
    return grid


def tradeoff_prompts(num_prompts: int) -> list[BenchPrompt]:
    """``num_prompts`` Spec-Bench prompts from :data:`PROMPT_SLOTS`, one category after another: every
    category's 3rd prompt, then every 4th, then every 5th (at most 39)."""
    pool = load_spec_bench(per_category=max(PROMPT_SLOTS) + 1)
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in pool:
        by_category.setdefault(prompt.category, []).append(prompt)
    ordered = [prompts[slot] for slot in PROMPT_SLOTS for prompts in by_category.values() if len(prompts) > slot]
    if not 1 <= num_prompts <= len(ordered):
        raise ConfigError(f"--num-prompts must be in 1..{len(ordered)}, got {num_prompts}")
    return ordered[:num_prompts]


@dataclass
class Generation:
    """One decoded response: which setting, prompt and sample (seed), what came out and its stats."""

    setting: int
    prompt: int
    sample: int
    seed: int
    token_ids: list[int]
    text: str
    stats: dict
    score: float | None = None

    def as_dict(self) -> dict:
        return {"setting": self.setting, "prompt": self.prompt, "sample": self.sample, "seed": self.seed,
                "token_ids": self.token_ids, "text": self.text, "stats": self.stats, "score": self.score}


def run_generations(engine: SpeculativeEngine, settings: list[Setting], prompt_ids: list[list[int]], samples: int,
                    base: GenerationConfig, seed: int,
                    progress: Callable[[int, int], None] | None = None) -> tuple[list[Generation], bool]:
    """Decode every prompt x sample with every setting, batch 1, interleaved per prompt and sample. Sample s
    uses seed ``seed + s`` under every setting (the same uniforms: paired comparisons). Returns the
    generations and whether the run was interrupted (Ctrl-C keeps what is done)."""
    configs = [s.config(base) for s in settings]
    engine.generate_ids([prompt_ids[0]], replace(configs[0], max_new_tokens=min(8, base.max_new_tokens)))  # warm-up
    generations, total = [], len(prompt_ids) * samples * len(settings)
    try:
        for p, prompt in enumerate(prompt_ids):
            for sample in range(samples):
                for index, config in enumerate(configs):
                    result: RequestResult = engine.generate_ids([prompt], replace(config, seed=seed + sample))[0]
                    generations.append(Generation(index, p, sample, seed + sample, result.token_ids, result.text or "",
                                                  result.stats.as_dict()))
                    if progress is not None:
                        progress(len(generations), total)
    except KeyboardInterrupt:
        return generations, True
    return generations, False


def score_generations(generations: list[Generation], prompts: list[BenchPrompt], prompt_ids: list[list[int]],
                      scorer: Scorer, settings: list[Setting],
                      progress: Callable[[int, int], None] | None = None) -> None:
    """Fill ``score`` of the generations that take part in a WinRate comparison (a setting whose pair_key
    was also run with the other residual)."""
    paired = _paired_keys(settings)
    todo = [g for g in generations if settings[g.setting].pair_key in paired]
    for done, g in enumerate(todo, start=1):
        g.score = float(scorer(Response(prompts[g.prompt].text, prompt_ids[g.prompt], g.text, g.token_ids)))
        if progress is not None:
            progress(done, len(todo))


def _paired_keys(settings: list[Setting]) -> set:
    residuals: dict[tuple, set] = {}
    for s in settings:
        residuals.setdefault(s.pair_key, set()).add(s.residual)
    return {key for key, found in residuals.items() if found >= {"opt", "uno"}}


def summarize(settings: list[Setting], generations: list[Generation]) -> list[dict]:
    """One record per setting: the :data:`KEYS` first, then details (tv, loss_star, judged positions, the
    empirical rejection rate, counts, WinRate scores)."""
    records = []
    for index, setting in enumerate(settings):
        mine = [g for g in generations if g.setting == index]
        totals, new_tokens, seconds, accepted, calls = StepStatistics.zero(), 0, 0.0, 0, 0
        for g in mine:
            s = g.stats
            bias = s["bias"]
            if bias["judged_positions"]:
                n = bias["judged_positions"]
                totals.add(StepStatistics(n, bias["rejection_rate"] * n, bias["bias_tv"] * n, bias["tv"] * n,
                                          bias["loss_star"] * n, bias["pareto_bias"] * n))
            new_tokens += s["new_tokens"]
            seconds += s["total_time_s"] - bias["measure_time_s"]
            accepted += s["accepted_tokens"]
            calls += s["target_calls"]
        means = totals.means()
        judged = means["judged_positions"]
        records.append({
            "rule": setting.rule_name, "eps": setting.epsilon, "residual": setting.residual,
            "rejection_rate": means["rejection_rate"], "mean_accepted_length": 1 + accepted / calls if calls else None,
            "tokens_per_second": new_tokens / seconds if seconds > 0 else None, "bias_tv": means["bias_tv"],
            "pareto_bias": means["pareto_bias"], "win_rate": None,
            "details": {"tv": means["tv"], "loss_star": means["loss_star"], "judged_positions": judged,
                        "empirical_rejection_rate": (judged - accepted) / judged if judged else None,
                        "generations": len(mine), "new_tokens": new_tokens, "decode_seconds": seconds,
                        "target_calls": calls, "accepted_tokens": accepted, "delta": setting.delta},
        })
    _add_win_rates(settings, generations, records)
    return records


def check_drafted(records: list[dict], drafter: str, draft_length: str) -> None:
    """A :class:`ConfigError` naming the settings whose generations drafted nothing (no judged position:
    no rejection or bias was measured, the row would be nulls) and why that happens."""
    empty = [f"{r['rule']} eps={r['eps']:g} {r['residual']}" for r in records
             if r["details"]["generations"] and not r["details"]["judged_positions"]]
    if not empty:
        return
    if draft_length == "cost":
        cause = (f"the cost draft-length policy judged the drafts of drafter {drafter!r} not worth their time on this "
                 f"machine and drafted nothing; use --draft-length fixed (the default) or heuristic")
    else:
        cause = (f"drafter {drafter!r} proposed no draft token on these prompts (a model-free drafter finds nothing to "
                 f"copy?); try another drafter or more prompts")
    raise ConfigError(f"no draft token was verified under {len(empty)} of {len(records)} settings ({', '.join(empty)}), "
                      f"so there is no rejection or bias to measure: {cause}")


def _add_win_rates(settings: list[Setting], generations: list[Generation], records: list[dict]) -> None:
    index_of = {(s.pair_key, s.residual): i for i, s in enumerate(settings)}
    for key in _paired_keys(settings):
        opt, uno = index_of[(key, "opt")], index_of[(key, "uno")]
        by_slot = {}
        for g in generations:
            if g.setting in (opt, uno) and g.score is not None:
                by_slot.setdefault((g.prompt, g.sample), {})[g.setting] = g
        pairs = [(slot[opt], slot[uno]) for slot in by_slot.values() if opt in slot and uno in slot]
        if not pairs:
            continue
        result = win_rate([a.score for a, _ in pairs], [b.score for _, b in pairs],
                          [a.token_ids == b.token_ids for a, b in pairs]).as_dict()
        result["of"] = "opt over uno"
        records[opt]["win_rate"] = records[uno]["win_rate"] = result


def public(records: list[dict]) -> list[dict]:
    """The records with the :data:`KEYS` only (``genspec tradeoff --json``)."""
    return [{key: record[key] for key in KEYS} for record in records]


# --------------------------------------------------------------------------- outputs
def _fmt(value, pattern="{:.4f}") -> str:
    return "–" if value is None else pattern.format(value)


def speed_table(records: list[dict]) -> str:
    """Markdown: per setting, speed against bias, with the front's bias at the same rejections."""
    lines = ["| rule | eps | residual | rejection rate | bias (TV per judged position) | Pareto bias at that rejection "
             "| mean TV(p, q) | tokens per target call | tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['rule']} | {r['eps']:g} | {r['residual']} | {_fmt(r['rejection_rate'])} | {_fmt(r['bias_tv'])} "
                     f"| {_fmt(r['pareto_bias'])} | {_fmt(r['details']['tv'])} | {_fmt(r['mean_accepted_length'], '{:.2f}')} "
                     f"| {_fmt(r['tokens_per_second'], '{:.1f}')} |")
    return "\n".join(lines)


def win_rate_table(records: list[dict]) -> str:
    """Markdown: OPT's WinRate over UNO per rule and eps."""
    lines = ["| rule | eps | comparisons | OPT wins | ties | UNO wins | OPT WinRate | 95% interval |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        w = r["win_rate"]
        if w is None or r["residual"] != "opt":
            continue
        lines.append(f"| {r['rule']} | {r['eps']:g} | {w['comparisons']} | {w['wins']} | {w['ties']} | {w['losses']} "
                     f"| {_fmt(w['rate'], '{:.3f}')} | [{w['ci95'][0]:.3f}, {w['ci95'][1]:.3f}] |")
    return "\n".join(lines)
