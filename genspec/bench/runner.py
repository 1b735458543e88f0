"""Fair timing of decoding methods: same target, same prompts, same settings, one process.

Each prompt is decoded by every method back to back (plain decoding first), so slow drifts of the
machine hit all methods alike; a warm-up generation per method is excluded from the figures.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from genspec.bench.prompts import BenchPrompt, encode_prompt
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.models.base import CausalLM


@dataclass
class Method:
    """A named way to decode: ``make_drafter(target)`` builds its drafter (None = plain decoding)."""

    name: str
    make_drafter: Callable | None
    config_overrides: dict = field(default_factory=dict)


@dataclass
class Run:
    """One prompt decoded by one method."""

    method: str
    category: str
    question_id: int
    new_tokens: int
    time_s: float
    stats: dict
    token_ids: list[int]
    matches_plain: bool | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0


def run_methods(target: CausalLM, methods: list[Method], prompts: list[BenchPrompt], config: GenerationConfig,
                tokenizer=None, on_progress: Callable[[str], None] | None = None) -> list[Run]:
    """Decode every prompt with every method; the first method is the baseline for ``matches_plain``."""
    tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    engines = [(m, SpeculativeEngine(target, m.make_drafter(target) if m.make_drafter else None, tokenizer))
               for m in methods]
    warm = encode_prompt("Hello, how are you?", tokenizer)
    for method, engine in engines:
        engine.generate_ids([warm], config, max_new_tokens=4, **method.config_overrides)
    runs = []
    for prompt in prompts:
        ids = encode_prompt(prompt.text, tokenizer)
        baseline = None
        for method, engine in engines:
            if on_progress:
                on_progress(f"{prompt.category} #{prompt.question_id}: {method.name}")
            result = engine.generate_ids([ids], config, **method.config_overrides)[0]
            run = Run(method.name, prompt.category, prompt.question_id, result.stats.new_tokens,
                      result.stats.total_time_s, result.stats.as_dict(), result.token_ids)
            if baseline is None:
                baseline = run
            elif config.temperature == 0:
                run.matches_plain = run.token_ids == baseline.token_ids
            runs.append(run)
    return runs


def summarize(runs: list[Run], baseline: str) -> list[dict]:
    """Per (category, method): total tokens / total time, speedup vs ``baseline`` on the same prompts,
    mean accepted length and acceptance rate pooled over the prompts, greedy agreement."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.category, run.method), []).append(run)
        groups.setdefault(("all", run.method), []).append(run)
    rows = []
    for (category, method), group in groups.items():
        base = groups[(category, baseline)]
        tps = sum(r.new_tokens for r in group) / sum(r.time_s for r in group)
        base_tps = sum(r.new_tokens for r in base) / sum(r.time_s for r in base)
        drafted = sum(r.stats["drafted_tokens"] for r in group)
        accepted = sum(r.stats["accepted_tokens"] for r in group)
        calls = sum(r.stats["target_calls"] for r in group)
        matches = [r.matches_plain for r in group if r.matches_plain is not None]
        rows.append({
            "category": category, "method": method, "prompts": len(group), "tokens_per_second": tps,
            "speedup": tps / base_tps, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / calls if calls else 0.0,
            "median_prompt_speedup": statistics.median(r.tokens_per_second / b.tokens_per_second
                                                       for r, b in zip(group, base)),
            "greedy_matches": f"{sum(matches)}/{len(matches)}" if matches else "-",
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    head = "| category | method | prompts | tok/s | speedup | median speedup | acceptance | mean accepted | greedy match |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['category']} | {r['method']} | {r['prompts']} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['median_prompt_speedup']:.2f}x | {r['acceptance_rate']:.2f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['greedy_matches']} |")
    return "\n".join(lines)
