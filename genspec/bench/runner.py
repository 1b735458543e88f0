"""Fair timing of decoding methods: same target, same prompts, same settings, one process.

Each prompt is decoded by every method back to back (plain decoding first), so slow drifts of the
machine hit all methods alike; a warm-up generation per method is excluded from the figures.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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


# ---------------------------------------------------------------------------------------------------
# ``genspec bench``: genspec and Hugging Face methods interleaved per prompt, repeated, fully instrumented


class ForwardTimer:
    """Times every ``forward`` of one :class:`CausalLM` instance (an instance attribute wraps the bound
    method; the class and other instances are untouched). Records per block width, prefill apart."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.reset()
        inner = model.forward

        def timed(tokens, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(tokens, *args, **kwargs)
            finally:
                self._add(int(tokens.shape[1]), kwargs.get("last_only", False), time.perf_counter() - start)

        model.forward = timed

    def _add(self, width: int, last_only: bool, seconds: float) -> None:
        self.seconds += seconds
        if last_only:  # a prefill (target) or a sync (draft model): not a verification block
            self.last_only_s += seconds
            return
        calls, total = self.by_width.get(width, (0, 0.0))
        self.by_width[width] = (calls + 1, total + seconds)

    def reset(self) -> None:
        self.seconds = 0.0
        self.last_only_s = 0.0
        self.by_width: dict[int, tuple[int, float]] = {}


def drafter_models(drafter) -> list[CausalLM]:
    """The models a drafter runs (its own and those of its inner drafters, for hierarchical stacks)."""
    models, seen = [], set()
    while drafter is not None and id(drafter) not in seen:
        seen.add(id(drafter))
        model = getattr(drafter, "model", None)
        if isinstance(model, CausalLM):
            models.append(model)
        drafter = getattr(drafter, "inner", None)
    return models


class GenspecDecoder:
    """One genspec method: an engine over the shared target, with forward timers and a step log.

    The step log ((drafted, accepted) per target call) wraps the engine instance's verification
    method; if a future engine renames it, the log is simply missing and the theory prediction falls
    back to pooled counts."""

    kind = "genspec"

    def __init__(self, spec, target: CausalLM, drafter, tokenizer, target_timer: ForwardTimer):
        self.spec = spec
        self.name = spec.name
        self.engine = SpeculativeEngine(target, drafter, tokenizer)
        self.target_timer = target_timer
        self.draft_timers = []
        for model in drafter_models(drafter):
            timer = getattr(model, "_genspec_bench_timer", None)
            if timer is None:
                timer = ForwardTimer(model)
                model._genspec_bench_timer = timer
            self.draft_timers.append(timer)
        self.steps: list | None = None
        verify = getattr(self.engine, "_verify", None)
        if verify is not None:
            def logged(*args, **kwargs):
                new_tokens, accepted, drafted = verify(*args, **kwargs)
                if self.steps is not None and len(drafted) == 1:
                    self.steps.append([int(drafted[0]), int(accepted[0])])
                return new_tokens, accepted, drafted

            self.engine._verify = logged

    @property
    def settings(self) -> dict:
        return {"drafter": self.spec.base, "options": self.spec.to_dict()["options"],
                "config_overrides": dict(self.spec.config_overrides)}

    def decode(self, ids: list[int], config: GenerationConfig) -> dict:
        self.target_timer.reset()
        for timer in self.draft_timers:
            timer.reset()
        self.steps = [] if hasattr(self.engine, "_verify") else None
        start = time.perf_counter()
        result = self.engine.generate_ids([ids], config, **self.spec.config_overrides)[0]
        wall = time.perf_counter() - start
        stats = result.stats
        raw = stats.as_dict()
        raw["accepted_per_position"] = list(stats.accepted_per_position)
        raw["drafted_per_position"] = list(stats.drafted_per_position)
        forward = {"target_s": self.target_timer.seconds, "prefill_s": self.target_timer.last_only_s,
                   "verify_by_width": {str(w): [c, s] for w, (c, s) in sorted(self.target_timer.by_width.items())},
                   "draft_model_s": sum(t.seconds for t in self.draft_timers)}
        forward["model_s"] = forward["target_s"] + forward["draft_model_s"]
        steps, self.steps = self.steps, None
        return {"new_tokens": stats.new_tokens, "wall_time_s": wall, "token_ids": list(result.token_ids),
                "stats": raw, "steps": steps, "forward": forward}


def encode_all(prompts: list[BenchPrompt], tokenizer) -> list[list[int]]:
    return [encode_prompt(p.text, tokenizer) for p in prompts]


def run_interleaved(decoders: list, prompts: list[BenchPrompt], prompt_ids: list[list[int]],
                    config: GenerationConfig, repeats: int, phase: str = "main",
                    on_progress: Callable[[str, dict | None], None] | None = None,
                    rotation: int = 0) -> list[dict]:
    """Decode every prompt with every decoder, ``repeats`` times; returns one record per call.

    Fairness: the decoders of one prompt run back to back (slow drifts of a noisy machine hit all of
    them alike) in an order rotated from prompt to prompt and repeat to repeat (no method is always
    first after a context switch); garbage collection is paused during each timed call; the
    same seed is used for every call. A decoder that raises is recorded with its error and the run
    goes on. ``matches_plain`` compares greedy outputs with the first decoder's (genspec plain);
    ``matches_hf_plain`` HF methods' with ``hf-plain`` (the same numerics)."""
    records = []
    seed = config.seed if config.seed is not None else 0
    for repeat in range(repeats):
        for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
            shift = (index + repeat + rotation) % len(decoders)
            order = decoders[shift:] + decoders[:shift]
            outputs = {}
            for decoder in order:
                if on_progress:
                    on_progress(f"repeat {repeat + 1}/{repeats} · {prompt.category} #{prompt.question_id} · "
                                f"{decoder.name}", None)
                record = {"phase": phase, "repeat": repeat, "method": decoder.name, "kind": decoder.kind,
                          "category": prompt.category, "question_id": prompt.question_id,
                          "prompt_tokens": len(ids), "error": None}
                gc.disable()  # no collection pause inside a timed call (it runs between calls instead)
                try:
                    if decoder.kind == "hf":
                        out = decoder.decode(ids, config.max_new_tokens, config.temperature, seed)
                    else:
                        out = decoder.decode(ids, replace(config, seed=seed))
                except Exception as exc:  # noqa: BLE001 - one failing baseline must not end the run
                    out = {"new_tokens": 0, "wall_time_s": 0.0, "token_ids": [], "stats": None, "steps": None,
                           "forward": None}
                    record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                finally:
                    gc.enable()
                record.update(out)
                record["tokens_per_second"] = (out["new_tokens"] / out["wall_time_s"]
                                               if out["wall_time_s"] > 0 else 0.0)
                outputs[decoder.name] = record
                if on_progress:
                    on_progress("", record)
            greedy = config.temperature == 0
            plain, hf_plain = outputs.get(decoders[0].name), outputs.get("hf-plain")
            for decoder in decoders:  # records in the methods' order, whatever order they ran in
                record = outputs[decoder.name]
                ok = record["error"] is None
                record["matches_plain"] = (record["token_ids"] == plain["token_ids"]
                                           if greedy and ok and plain and plain["error"] is None
                                           and decoder is not decoders[0] else None)
                record["matches_hf_plain"] = (record["token_ids"] == hf_plain["token_ids"]
                                              if greedy and ok and decoder.kind == "hf" and hf_plain
                                              and hf_plain["error"] is None and decoder.name != "hf-plain"
                                              else None)
                records.append(record)
    return records


def warm_up(decoders: list, ids: list[int], config: GenerationConfig) -> None:
    """One short untimed generation per decoder (first-call allocations, lazy initialisation)."""
    for decoder in decoders:
        try:
            if decoder.kind == "hf":
                decoder.decode(ids, 4, config.temperature, 0)
            else:
                decoder.decode(ids, replace(config, max_new_tokens=4, seed=0))
        except Exception:  # noqa: BLE001 - the timed run records the error
            pass
