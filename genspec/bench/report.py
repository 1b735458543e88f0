"""``report.md`` from a results dictionary (the content of ``results.json``): pure text, no model."""
from __future__ import annotations

from genspec.bench.analysis import ALL, MEAN, reference_method, summarize, sweep_summary
from genspec.bench.methods import PLAIN



def _k_text(k) -> str:
    """The run's k as the report says it (None: each drafter drafted to its own default depth)."""
    return "each drafter's own (8; suffix 24)" if k is None else str(k)

def _spread(s: dict | None, fmt: str = "{:.2f}", suffix: str = "") -> str:
    if not s:
        return "–"
    text = fmt.format(s["median"]) + suffix
    if s["n"] > 1:
        text += f" [{fmt.format(s['min'])}–{fmt.format(s['max'])}]"
    return text


def format_number(value, fmt: str = "{:.2f}") -> str:
    """A table cell: ``value`` formatted, or a dash for a missing one."""
    return "–" if value is None else fmt.format(value)


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def format_match(pair) -> str:
    """A table cell: ``(equal, total)`` as ``equal/total``, or a dash."""
    return "–" if not pair else f"{pair[0]}/{pair[1]}"


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return out


def _label(row: dict, default_method: str | None) -> str:
    name = row["method"].replace("|", "\\|")
    if row["method"] == default_method:
        name += " (genspec default)"
    if row.get("failed_runs"):
        name += f" ⚠ {row['failed_runs']} failed"
    return name


def category_table(rows: list[dict], default_method: str | None, reference: str) -> list[str]:
    header = ["method", "tok/s", "speedup vs plain", f"vs {reference}", "mean accepted", "acceptance",
              "greedy = plain", "predicted", "measured / predicted"]
    lines = []
    for row in rows:
        theory = row.get("theory") or {}
        match = row.get("matches_plain")
        if row["kind"] != "genspec" and row.get("matches_reference"):
            match_text = f"{format_match(match)} ({reference}: {format_match(row['matches_reference'])})"
        else:
            match_text = format_match(match)
        lines.append([_label(row, default_method), _spread(row["tokens_per_second"], "{:.1f}"),
                      _spread(row["speedup_vs_plain"], suffix="x"), _spread(row["speedup_vs_reference"], suffix="x"),
                      format_number(row.get("mean_accepted_length")), format_number(row.get("acceptance_rate")), match_text,
                      format_number(theory.get("predicted_speedup"), "{:.2f}x"), format_number(theory.get("efficiency"))])
    return _table(header, lines)


def mean_table(rows: list[dict], default_method: str | None, reference: str) -> list[str]:
    header = ["method", "tok/s (mean of categories)", "speedup vs plain", f"vs {reference}",
              "categories slower than plain"]
    lines = [[_label(r, default_method), _spread(r["tokens_per_second"], "{:.1f}"),
              _spread(r["speedup_vs_plain"], suffix="x"), _spread(r["speedup_vs_reference"], suffix="x"),
              ", ".join(r.get("categories_slower_than_plain") or []) or "none"] for r in rows]
    return _table(header, lines)


def diagnostics_table(rows: list[dict]) -> list[str]:
    header = ["method", "alpha (per token)", "mean draft length", "c = draft/plain step",
              "verify/plain step", "draft time", "verify time", "outside model passes", "per-position acceptance"]
    lines = []
    for row in rows:
        theory = row.get("theory") or {}
        positions = [p["rate"] for p in row.get("acceptance_per_position") or [] if p["rate"] is not None][:8]
        lines.append([row["method"], format_number(theory.get("alpha")), format_number(theory.get("mean_draft_length"), "{:.1f}"),
                      format_number(theory.get("draft_cost_ratio"), "{:.3f}"), format_number(theory.get("verify_cost_ratio")),
                      _pct(row.get("draft_share")), _pct(row.get("verify_share")), _pct(row.get("overhead_share")),
                      " ".join(f"{p:.2f}" for p in positions) or "–"])
    return _table(header, lines)


def noise_lines(notes: list[dict], repeats: int) -> list[str]:
    """One line per category: the fastest method and what it cannot be told apart from."""
    if repeats < 2:
        return ["- One repeat only: the spread over repeats is not measured. On this kind of shared VM plain "
                "decoding of the same prompt varies by about ±15% from run to run, so smaller differences are "
                "not significant. Use `--repeats 3` or more."]
    out = []
    for note in notes:
        line = f"- **{note['category']}**: fastest `{note['fastest']}`"
        if note["within_noise_of_fastest"]:
            line += " (within noise: " + ", ".join(f"`{m}`" for m in note["within_noise_of_fastest"]) + ")"
        else:
            line += " (clear of every other method)"
        if note["within_noise_of_plain"]:
            line += "; not distinguishable from plain: " + ", ".join(f"`{m}`" for m in note["within_noise_of_plain"])
        out.append(line + ".")
    return out


def _machine(results: dict) -> list[str]:
    m = results.get("machine", {})
    model = results.get("model", {})
    s = results.get("settings", {})
    return [
        f"- Machine: {m.get('cpu_model', '?')}, {m.get('logical_cores', '?')} logical cores, "
        f"torch threads {m.get('torch_threads', '?')}; Python {m.get('python', '?')}, torch {m.get('torch', '?')}, "
        f"transformers {m.get('transformers', '?')}, genspec {m.get('genspec', '?')}.",
        f"- Target: `{model.get('path', '?')}` ({model.get('architecture', '?')}, {model.get('num_layers', '?')} "
        f"layers, vocabulary {model.get('vocab_size', '?')}, {model.get('dtype', '?')})"
        + (f"; draft model `{s['draft_model']}`" if s.get("draft_model") else "") + ".",
        f"- Prompts: Spec-Bench, {s.get('num_prompts', '?')} per category"
        + (f" after each category's first {s['skip_prompts']}" if s.get("skip_prompts") else "") + ", categories: "
        f"{', '.join(s.get('categories', []))}; "
        + (f"{s.get('max_new_tokens', '?')} new tokens on every call (end tokens ignored); " if s.get("ignore_eos")
           else f"{s.get('max_new_tokens', '?')} new tokens at most; ")
        + f"temperature {s.get('temperature', 0)} ({'greedy' if not s.get('temperature') else 'sampling'}"
        + (f", top-p {s['top_p']}" if s.get("top_p", 1.0) != 1.0 and s.get("temperature") else "") + "), "
        f"seed {s.get('seed', 0)}; k = {_k_text(s.get('num_draft_tokens', '?'))}, draft length policy "
        f"`{s.get('draft_length', '?')}` unless a method sets its own; {s.get('repeats', '?')} repeat(s).",
    ]


FAIRNESS = [
    "- One process, one machine, the same token ids for every method (the prompt encoded once), the same "
    "end-of-sequence tokens and token budget, the same seed. A warm-up generation per method is excluded.",
    "- Methods are interleaved per prompt (every method decodes a prompt before the next prompt starts), in "
    "an order rotated from prompt to prompt and repeat to repeat; Python's garbage collector is paused "
    "inside timed calls.",
    "- Times are wall-clock around the whole call (prefill included) for genspec and for transformers.",
    "- The Hugging Face baselines (`hf-*`) run stock `transformers` `generate()` on a **separate copy of the "
    "model, loaded from the same directory and never touched by genspec**. genspec's own copy has its "
    "`nn.Linear` layers replaced in place by `TransposedLinear` (same values, the few-row kernel timed "
    "fastest on this CPU) and a re-laid-out LM head; that is part of what genspec is, so `speedup vs hf-plain` includes it, "
    "while `speedup vs plain` (genspec plain decoding, same kernels) isolates speculation.",
    "- HF's assisted generation keeps its adaptive draft length (`num_assistant_tokens`, heuristic schedule) "
    "across calls on the same model, as it does for any user; its warm-up call is part of that history.",
    "- `greedy = plain`: prompts whose greedy output equals genspec plain decoding token for token "
    "(for HF methods, in brackets, equal to `hf-plain`). Both engines verify several tokens in one pass, "
    "whose float rounding differs slightly from one-token steps, so a near-tie can flip a token.",
]


def write_report(results: dict) -> str:
    """The whole ``report.md`` text."""
    summary = results.get("summary") or summarize(results)
    summary.setdefault("reference", reference_method(results))
    rows = summary["rows"]
    default_method = results.get("settings", {}).get("default_method")
    lines = ["# genspec bench", "", f"Run {results.get('created', '')}: `{results.get('command', 'genspec bench')}`", ""]
    if results.get("note"):  # a remark added to results.json after the run (e.g. runs removed, and why)
        lines += [f"Note: {results['note']}", ""]
    lines += _machine(results) + [""]
    if results.get("interrupted"):
        lines += ["**Interrupted**: only the prompts finished before the interruption are counted.", ""]
    history = [p for p in results.get("prompts", []) if p.get("history")]
    if history:
        lines += [f"History: {len(history)} request(s) of a replayed traffic ("
                  + ", ".join(f"{p['category']} #{p['question_id']}" for p in history)
                  + ") were decoded by every method in their place, so drafters that learn across requests saw "
                  "them, and are not counted in the figures (their runs have phase `history` in results.json).", ""]
    skipped = results.get("settings", {}).get("prompts_skipped") or []
    if skipped:
        lines += [f"Skipped {len(skipped)} prompt(s) that do not fit the model's context with the token budget: "
                  + ", ".join(f"{p['category']} #{p['question_id']}" for p in skipped) + ".", ""]
    errors = sorted({(r["method"], e) for r in rows for e in r.get("errors") or []})
    if errors:
        lines += ["**Failed calls** (left out of the figures):", ""]
        lines += [f"- `{m}`: {e}" for m, e in errors] + [""]
    lines += ["## Summary: mean over categories", "",
              "Speedups are per repeat means over the categories of the per-category speedup (Spec-Bench style); "
              "cells show the median over repeats [min–max].", ""]
    lines += mean_table([r for r in rows if r["category"] == MEAN], default_method, summary["reference"]) + [""]
    lines += ["![speedup per category](speedup_by_category.png)", ""]
    lines += ["## Within noise", "",
              "Two methods are within noise when their speedup ranges over the repeats overlap; a method is not "
              "distinguishable from plain decoding when its range includes 1.0x.", ""]
    lines += noise_lines(summary["noise"], summary["repeats"]) + [""]
    lines += ["## Per category", "",
              "tok/s and speedups: median over repeats [min–max]. `predicted`: Leviathan et al.'s speedup from this "
              "run's measured acceptance and costs (see Diagnostics); `measured / predicted` below 1 is what the "
              "real run loses to work outside the model passes and to acceptance that is not i.i.d.", ""]
    for category in [ALL] + summary["categories"]:
        title = "all prompts pooled" if category == ALL else category
        lines += [f"### {title}", ""]
        lines += category_table([r for r in rows if r["category"] == category], default_method,
                                summary["reference"]) + [""]
    pooled_rows = [r for r in rows if r["category"] == ALL]
    lines += ["## Diagnostics (all prompts pooled)", "",
              "`alpha`: per-token acceptance (accepted / (accepted + rejections)); `c`: drafting time per drafted "
              "token / plain decoding step; `verify/plain step`: mean target pass per verification / plain step "
              "(measured, not 1 as in the idealised formula); time shares are of wall time; `outside model "
              "passes` = wall time minus the time inside target and draft-model forward passes (engine overhead, "
              "n-gram search, acceptance rule, cache rollback, tokenizer work). Per-position acceptance: share of "
              "drafts reaching position i that were accepted up to i.", ""]
    lines += diagnostics_table(pooled_rows) + [""]
    lines += ["![acceptance by draft position](acceptance_by_position.png)", "",
              "![where the time goes](time_breakdown.png)", ""]
    sweep = sweep_summary(results)
    if sweep:
        lines += ["## Draft length sweep", "",
                  f"`{results.get('settings', {}).get('sweep_method')}` with a fixed draft length k on "
                  f"{results.get('settings', {}).get('sweep_prompts', '?')} prompt(s); tok/s median over repeats [min–max].", ""]
        policy = results.get("settings", {}).get("draft_length", "?")
        ordered = [s for s in sweep if s["k"] is None] + [s for s in sweep if s["k"] is not None]
        lines += _table(["method", "k", "tok/s", "mean accepted", "acceptance"],
                        [[s["method"], "–" if s["method"] == PLAIN else (
                            str(s["k"]) if s["k"] is not None else f"adaptive (method's policy, default `{policy}`)"),
                          _spread(s["tokens_per_second"], "{:.1f}"), format_number(s["mean_accepted_length"]),
                          format_number(s["acceptance_rate"])] for s in ordered]) + [""]
        lines += ["![tokens/s vs draft length](tokens_per_second_vs_k.png)", ""]
    lines += ["## How this was measured", ""] + FAIRNESS + [""]
    lines += ["Raw figures (every call, every step count, machine and versions): `results.json`.", ""]
    return "\n".join(lines)
