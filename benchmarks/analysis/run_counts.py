"""Pooled counts per method from `genspec bench` results.json files (the figures the README quotes beside
the report's rates): target calls, new tokens, tokens per call, drafts reaching positions 1-4 and kept there,
drafting time per target call and the target's time per verify block by its width (1-5 tokens; plain too).
With two files, also how many answers of a method are token for token the same in both (sampled runs).

    python benchmarks/analysis/run_counts.py benchmarks/results/all_kinds/results.json.gz
    python benchmarks/analysis/run_counts.py BEFORE AFTER --methods head --same hybrid:lookup=suffix,hybrid
"""
from __future__ import annotations

import argparse
from pathlib import Path

from genspec.bench.run import read_results  # results.json or results.json.gz


def measured(results: dict, method: str) -> list[dict]:
    return [r for r in results["runs"] if r["method"] == method and r.get("phase") != "warmup" and not r.get("error")]


def counts(results: dict, method: str) -> str:
    runs = measured(results, method)
    calls = sum(r["stats"]["target_calls"] for r in runs)
    new = sum(r["new_tokens"] for r in runs)
    drafted, kept = [0] * 4, [0] * 4
    for r in runs:
        for i, d in enumerate(r["stats"]["drafted_per_position"][:4]):  # (the accepted list may be shorter)
            drafted[i] += d
        for i, a in enumerate(r["stats"]["accepted_per_position"][:4]):
            kept[i] += a
    rates = " / ".join(f"{a / d:.2f}" if d else "-" for d, a in zip(drafted, kept))
    return (f"{method}: {len(runs)} answers, {new} tokens in {calls} target calls ({new / calls:.2f} per call); "
            f"drafts reaching positions 1-4: {', '.join(map(str, drafted))}; kept there: {rates}")


def timing(results: dict, method: str) -> str:
    runs = measured(results, method)
    calls = sum(r["stats"]["target_calls"] or 0 for r in runs) if method != "hf-plain" else 0
    draft = sum(r["stats"].get("draft_time_s") or 0.0 for r in runs)
    widths: dict[int, list[float]] = {}
    for r in runs:
        for width, (count, seconds) in ((r.get("forward") or {}).get("verify_by_width") or {}).items():
            total = widths.setdefault(int(width), [0, 0.0])
            total[0] += count
            total[1] += seconds
    blocks = ", ".join(f"{w}: {1000 * s / n:.1f} ms ({n})" for w, (n, s) in sorted(widths.items()) if w <= 5 and n)
    return f"{method}: drafting {1000 * draft / calls if calls else 0:.1f} ms per target call; verify block by width: {blocks}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="results.json of genspec bench (one or two)")
    parser.add_argument("--methods", help="comma-separated methods (default: all but plain and hf-plain)")
    parser.add_argument("--same", help="METHOD_IN_FIRST,METHOD_IN_SECOND: count identical answers in the two files")
    args = parser.parse_args()
    files = [read_results(Path(path)) for path in args.results]
    for path, results in zip(args.results, files):
        print(path)
        methods = args.methods.split(",") if args.methods else [
            m for m in results["summary"]["methods"] if m not in ("plain", "hf-plain")]
        for method in methods:
            print("  " + counts(results, method))
        for method in ["plain"] + methods:
            print("  " + timing(results, method))
    if args.same and len(files) == 2:
        first, second = args.same.split(",")
        a = {(r["question_id"], r["repeat"]): r["token_ids"] for r in measured(files[0], first)}
        b = {(r["question_id"], r["repeat"]): r["token_ids"] for r in measured(files[1], second)}
        both = [k for k in b if k in a]
        print(f"identical answers, {first} (first) vs {second} (second): {sum(a[k] == b[k] for k in both)} of {len(both)}")


if __name__ == "__main__":
    main()
