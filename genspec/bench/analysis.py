"""From raw benchmark records (``results["runs"]``) to the figures of the report.

Everything here is a pure function of the records, so a report can be rebuilt from ``results.json``
and tested on synthetic results.

- Rates: tokens/s of a (category, method, repeat) = its new tokens / its wall time, summed over the
  category's prompts. Speedups are paired: a method and its baseline over the *same* prompts of the
  *same* repeat (prompts where either failed are left out of that pair).
- Spread: median, min and max (and quartiles) over repeats. Two methods are *within noise* when their
  ranges over repeats overlap (needs >= 2 repeats).
- Theory (Leviathan et al., with measured costs): per-token acceptance alpha = accepted / (accepted +
  rejections) over the target calls that verified a draft (the maximum-likelihood estimate under
  i.i.d. acceptance); a step drafting d tokens is expected to emit E(alpha, d) = (1 - alpha^(d+1)) /
  (1 - alpha) tokens (:func:`genspec.theory.leviathan.expected_tokens_per_call`) and to cost
  d * c_draft + v(d + 1), with c_draft the measured drafting time per drafted token and v(w) the
  measured target forward time for a block of w tokens. Plain decoding costs v_plain(1) per token.
  Predicted speedup = predicted tokens/s of the method over that of plain, both including their
  measured prefill; ``measured / predicted`` is the efficiency of the real run (what the engine loses
  to overhead outside model passes, and to acceptance not being i.i.d.).
"""
from __future__ import annotations

import statistics

from genspec.bench.methods import HF_PLAIN, PLAIN, REFERENCES
from genspec.theory.leviathan import expected_tokens_per_call

ALL = "all"     # every prompt pooled
MEAN = "mean"   # arithmetic mean over categories of the per-category figures (Spec-Bench's average)


def spread(values: list[float]) -> dict | None:
    """Median, min, max, quartiles and the values themselves (None if there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    ordered = sorted(values)
    q1, q3 = (statistics.quantiles(ordered, n=4, method="inclusive")[::2] if len(ordered) > 1
              else (ordered[0], ordered[0]))
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "q1": q1, "q3": q3,
            "n": len(ordered), "values": values}


def overlap(a: dict | None, b: dict | None) -> bool | None:
    """Whether two spreads' [min, max] ranges overlap; None when either has fewer than 2 repeats."""
    if not a or not b or a["n"] < 2 or b["n"] < 2:
        return None
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def _index(runs: list[dict]) -> dict:
    index = {}
    for run in runs:
        index[(run["method"], run["category"], run["repeat"], run["question_id"])] = run
    return index


def _ok(run: dict | None) -> bool:
    return run is not None and not run.get("error") and run.get("wall_time_s", 0) > 0


def _rate(runs: list[dict]) -> float | None:
    time_s = sum(r["wall_time_s"] for r in runs)
    return sum(r["new_tokens"] for r in runs) / time_s if time_s > 0 else None


def reference_method(results: dict) -> str:
    """The run's reference method: its backend's plain decoding outside genspec (``hf-plain`` for runs
    from before the llamacpp backend)."""
    return REFERENCES.get(results.get("settings", {}).get("backend", "torch"), HF_PLAIN)


def summarize(results: dict) -> dict:
    """Per (category, method) rows of the main phase (the k sweep has :func:`sweep_summary`), the mean
    over categories, theory and noise notes."""
    runs = [dict(r, matches_reference=r.get("matches_reference", r.get("matches_hf_plain")))  # older files' name
            for r in results["runs"] if r.get("phase", "main") == "main"]
    methods = [m["name"] for m in results["methods"]]
    reference = reference_method(results)
    kinds = {m["name"]: m["kind"] for m in results.get("methods", [])}
    kinds.update({r["method"]: r["kind"] for r in runs})
    categories = _order(runs, "category")
    repeats = sorted({r["repeat"] for r in runs})
    index = _index(runs)
    qids = {c: sorted({r["question_id"] for r in runs if r["category"] == c}) for c in categories}
    groups = {c: [c] for c in categories}
    groups[ALL] = categories

    def keys(method, cats, repeat):
        return [(c, q) for c in cats for q in qids[c] if _ok(index.get((method, c, repeat, q)))]

    def paired(method, base, cats, repeat):
        shared = [k for k in keys(method, cats, repeat) if _ok(index.get((base, k[0], repeat, k[1])))]
        if not shared:
            return None
        mine = _rate([index[(method, c, repeat, q)] for c, q in shared])
        theirs = _rate([index[(base, c, repeat, q)] for c, q in shared])
        return mine / theirs if mine and theirs else None

    rows = {}
    for group, cats in groups.items():
        for method in methods:
            per_repeat = [keys(method, cats, r) for r in repeats]
            tps = [_rate([index[(method, c, r, q)] for c, q in ks]) if ks else None
                   for r, ks in zip(repeats, per_repeat)]
            pooled = [index[(method, c, r, q)] for r, ks in zip(repeats, per_repeat) for c, q in ks]
            failed = [index[(method, c, r, q)] for r in repeats for c in cats for q in qids[c]
                      if (method, c, r, q) in index and not _ok(index[(method, c, r, q)])]
            row = {"category": group, "method": method, "kind": kinds.get(method, "genspec"),
                   "prompts": sum(len(qids[c]) for c in cats), "runs": len(pooled), "failed_runs": len(failed),
                   "errors": sorted({r["error"] for r in failed if r.get("error")}),
                   "tokens_per_second": spread(tps),
                   "speedup_vs_plain": spread([paired(method, PLAIN, cats, r) for r in repeats]),
                   "speedup_vs_reference": spread([paired(method, reference, cats, r) for r in repeats])}
            row.update(_acceptance(pooled, method, reference))
            row.update(_greedy(pooled))
            row.update(_time_shares(pooled))
            plain_runs = [index[(PLAIN, c, r, q)] for r in repeats for c in cats for q in qids[c]
                          if _ok(index.get((PLAIN, c, r, q)))]
            row["theory"] = theory(pooled, plain_runs) if row["kind"] == "genspec" and method != PLAIN else None
            if row["theory"] and row["speedup_vs_plain"]:
                row["theory"]["efficiency"] = row["speedup_vs_plain"]["median"] / row["theory"]["predicted_speedup"]
            rows[(group, method)] = row

    for method in methods:  # the mean over categories, per repeat
        row = {"category": MEAN, "method": method, "kind": kinds.get(method, "genspec"),
               "prompts": sum(rows[(c, method)]["prompts"] for c in categories)}
        for key in ("tokens_per_second", "speedup_vs_plain", "speedup_vs_reference"):
            per_repeat = []
            for i in range(len(repeats)):
                values = [rows[(c, method)][key]["values"][i] if rows[(c, method)][key]
                          and len(rows[(c, method)][key]["values"]) == len(repeats) else None for c in categories]
                per_repeat.append(statistics.fmean(values) if values and None not in values else None)
            row[key] = spread(per_repeat)
        row["categories_slower_than_plain"] = [c for c in categories if rows[(c, method)]["speedup_vs_plain"]
                                               and rows[(c, method)]["speedup_vs_plain"]["median"] < 1.0]
        rows[(MEAN, method)] = row

    table = [rows[(g, m)] for g in [MEAN, ALL] + categories for m in methods]
    return {"categories": categories, "methods": methods, "repeats": len(repeats), "reference": reference, "rows": table,
            "noise": noise_notes(table, methods, [MEAN] + categories)}


def _order(runs: list[dict], key: str) -> list:
    seen = []
    for run in runs:
        if run[key] not in seen:
            seen.append(run[key])
    return seen


def _acceptance(runs: list[dict], method: str, reference: str) -> dict:
    stats = [r["stats"] for r in runs if r.get("stats")]
    if method in (PLAIN, reference):
        return {"acceptance_rate": None, "mean_accepted_length": 1.0 if runs else None,
                "acceptance_per_position": [], "drafted_tokens": 0}
    if not stats:
        return {"acceptance_rate": None, "mean_accepted_length": None, "acceptance_per_position": [],
                "drafted_tokens": None}
    drafted = sum(s["drafted_tokens"] for s in stats)
    accepted = sum(s["accepted_tokens"] for s in stats)
    calls = sum(s["target_calls"] for s in stats)
    width = max(len(s.get("drafted_per_position", [])) for s in stats)
    per_position = []
    for i in range(width):
        d = sum(s["drafted_per_position"][i] for s in stats if len(s.get("drafted_per_position", [])) > i)
        a = sum(s["accepted_per_position"][i] for s in stats if len(s.get("accepted_per_position", [])) > i)
        per_position.append({"drafted": d, "accepted": a, "rate": a / d if d else None})
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / calls if calls else None,
            "acceptance_per_position": per_position, "drafted_tokens": drafted}


def _greedy(runs: list[dict]) -> dict:
    out = {}
    for key in ("matches_plain", "matches_reference"):
        values = [r.get(key) for r in runs if r.get(key) is not None]
        out[key] = [sum(values), len(values)] if values else None
    return out


def _time_shares(runs: list[dict]) -> dict:
    """Shares of wall time: drafting, verifying (genspec's own split) and outside model forwards."""
    wall = sum(r["wall_time_s"] for r in runs)
    forwards = [r["forward"] for r in runs if r.get("forward")]
    out = {"draft_share": None, "verify_share": None, "overhead_share": None, "overhead_s_per_token": None}
    if wall <= 0 or not forwards:
        return out
    stats = [r["stats"] for r in runs if r.get("stats") and "draft_time_s" in r["stats"]]
    if stats and len(stats) == len(runs):
        out["draft_share"] = sum(s["draft_time_s"] for s in stats) / wall
        out["verify_share"] = sum(s["verify_time_s"] for s in stats) / wall
    if len(forwards) == len(runs):
        outside = wall - sum(f["model_s"] for f in forwards)
        out["overhead_share"] = outside / wall
        tokens = sum(r["new_tokens"] for r in runs)
        out["overhead_s_per_token"] = outside / tokens if tokens else None
    return out


def _steps(run: dict) -> list:
    """A run's (drafted, accepted) per step: its ``steps`` (``genspec bench --raw``) or, in any order, the
    same pairs from its ``step_counts``."""
    if run.get("steps") is not None:
        return run["steps"]
    return [[drafted, accepted] for drafted, accepted, count in run.get("step_counts") or [] for _ in range(count)]


def theory(runs: list[dict], plain_runs: list[dict]) -> dict | None:
    """Leviathan's prediction with this run's measured acceptance and costs (see the module doc)."""
    stats = [r["stats"] for r in runs if r.get("stats")]
    if not runs or not plain_runs or len(stats) != len(runs) or not all(r.get("forward") for r in runs + plain_runs):
        return None
    plain_width = _width_costs(plain_runs)
    if 1 not in plain_width:
        return None
    plain_step = plain_width[1]
    drafted = sum(s["drafted_tokens"] for s in stats)
    draft_cost = sum(s["draft_time_s"] for s in stats) / drafted if drafted else 0.0
    widths = _width_costs(runs)
    steps = [s for r in runs for s in _steps(r)]
    if steps and all(r.get("steps") is not None or r.get("step_counts") is not None for r in runs):
        tested = [(d, a) for d, a in steps if d > 0]
        rejections = sum(1 for d, a in tested if a < d)
        accepted = sum(a for _, a in tested)
        alpha = accepted / (accepted + rejections) if accepted + rejections else 0.0
        schedule = [d for d, _ in steps]
    else:  # no step log: pooled counts, every call drafting the mean length
        calls = sum(s["target_calls"] for s in stats)
        alpha = sum(s["accepted_tokens"] for s in stats) / drafted if drafted else 0.0
        schedule = [round(drafted / calls)] * calls if calls else []
    if not schedule:
        return None

    def verify_cost(width):
        if width in widths:
            return widths[width]
        nearest = min(widths, key=lambda w: abs(w - width)) if widths else 1
        return widths.get(nearest, plain_step)

    tokens = sum(expected_tokens_per_call(alpha, d) for d in schedule)
    cost = sum(d * draft_cost + verify_cost(d + 1) for d in schedule)
    per_token = cost / tokens
    new_tokens = sum(r["new_tokens"] for r in runs)
    plain_tokens = sum(r["new_tokens"] for r in plain_runs)
    prefill = sum(r["forward"].get("prefill_s", 0.0) for r in runs)
    plain_prefill = sum(r["forward"].get("prefill_s", 0.0) for r in plain_runs)
    predicted_rate = new_tokens / (prefill + new_tokens * per_token)
    plain_rate = plain_tokens / (plain_prefill + plain_tokens * plain_step)
    mean_draft = sum(schedule) / len(schedule)
    return {"alpha": alpha, "mean_draft_length": mean_draft,
            "draft_cost_ratio": draft_cost / plain_step,                       # Leviathan's c
            "verify_cost_ratio": (cost - draft_cost * sum(schedule)) / len(schedule) / plain_step,
            "plain_step_s": plain_step,
            "predicted_decode_speedup": plain_step / per_token,                  # no prefill
            "predicted_speedup": predicted_rate / plain_rate}


def _width_costs(runs: list[dict]) -> dict[int, float]:
    """Mean target forward seconds per verification block width, pooled over runs."""
    totals: dict[int, list[float]] = {}
    for run in runs:
        for width, (calls, seconds) in (run["forward"].get("verify_by_width") or {}).items():
            entry = totals.setdefault(int(width), [0, 0.0])
            entry[0] += calls
            entry[1] += seconds
    return {w: s / c for w, (c, s) in totals.items() if c}


def noise_notes(rows: list[dict], methods: list[str], categories: list[str]) -> list[dict]:
    """Per category: the fastest method (median speedup), the methods whose speedup range over repeats
    overlaps its range (not distinguishable from the fastest), and the methods whose range includes
    1.0 (not distinguishable from plain decoding)."""
    notes = []
    by_key = {(r["category"], r["method"]): r for r in rows}
    for category in categories:
        spreads = {m: by_key[(category, m)].get("speedup_vs_plain") for m in methods}
        measured = {m: s for m, s in spreads.items() if s}
        if not measured:
            continue
        fastest = max(measured, key=lambda m: measured[m]["median"])
        like_plain = [m for m, s in measured.items() if m != PLAIN and s["n"] >= 2 and s["min"] <= 1.0 <= s["max"]]
        ties = [m for m, s in measured.items() if m != fastest and overlap(s, measured[fastest])]
        notes.append({"category": category, "fastest": fastest, "within_noise_of_fastest": ties,
                      "within_noise_of_plain": like_plain})
    return notes


def sweep_summary(results: dict) -> list[dict]:
    """tokens/s per fixed k of the sweep method (and plain), over repeats."""
    runs = [r for r in results["runs"] if r.get("phase") == "sweep"]
    if not runs:
        return []
    out = []
    for method in _order(runs, "method"):
        mine = [r for r in runs if r["method"] == method]
        per_repeat = []
        for repeat in sorted({r["repeat"] for r in mine}):
            ok = [r for r in mine if r["repeat"] == repeat and _ok(r)]
            per_repeat.append(_rate(ok) if ok else None)
        acc = _acceptance([r for r in mine if _ok(r)], method, reference_method(results))
        k = next((r.get("k") for r in mine if r.get("k") is not None), None)
        out.append({"method": method, "k": k, "tokens_per_second": spread(per_repeat),
                    "mean_accepted_length": acc["mean_accepted_length"], "acceptance_rate": acc["acceptance_rate"]})
    return out
