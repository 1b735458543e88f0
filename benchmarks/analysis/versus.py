"""Methods against reference methods in one `genspec bench` run: geometric mean over categories of the
per-category tok/s ratio, per repeat (the mean a ratio of speeds calls for; the report's summary averages
speedups arithmetically, Spec-Bench style), with the lowest category and the pooled tok/s ratio.

    python benchmarks/analysis/versus.py benchmarks/results/llamacpp/results.json.gz \
        --methods plain,prompt-lookup,suffix --against llamacpp-plain,llamacpp-lookup

A category's tok/s is its generated tokens over its wall time (all its prompts), as in the report.
"""
from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

from genspec.bench.run import read_results  # results.json or results.json.gz


def category_speeds(results: dict) -> dict[str, dict[tuple[int, str], float]]:
    """method -> (repeat, category) -> tok/s over the main phase's calls."""
    tokens: dict = defaultdict(lambda: defaultdict(float))
    seconds: dict = defaultdict(lambda: defaultdict(float))
    for run in results["runs"]:
        if run["phase"] != "main" or run.get("error"):
            continue
        key = (run["repeat"], run["category"])
        tokens[run["method"]][key] += run["new_tokens"]
        seconds[run["method"]][key] += run["wall_time_s"]
    return {m: {k: tokens[m][k] / seconds[m][k] for k in seconds[m] if seconds[m][k] > 0} for m in seconds}


def compare(results: dict, method: str, against: str) -> list[dict]:
    """Per repeat: geometric mean and lowest of the per-category ratios, and the pooled ratio."""
    speeds = category_speeds(results)
    if method not in speeds or against not in speeds:
        missing = method if method not in speeds else against
        raise SystemExit(f"method {missing!r} is not in this run; it has: {', '.join(sorted(speeds))}")
    out = []
    for repeat in sorted({r for r, _ in speeds[method]}):
        keys = [k for k in speeds[method] if k[0] == repeat and k in speeds[against]]
        ratios = {k[1]: speeds[method][k] / speeds[against][k] for k in keys}
        lowest = min(ratios, key=ratios.get)
        pooled = [r for r in results["runs"] if r["phase"] == "main" and r["repeat"] == repeat and not r.get("error")]
        rate = {m: sum(r["new_tokens"] for r in pooled if r["method"] == m)
                / sum(r["wall_time_s"] for r in pooled if r["method"] == m) for m in (method, against)}
        out.append({"repeat": repeat, "geometric_mean": math.exp(sum(map(math.log, ratios.values())) / len(ratios)),
                    "lowest": (lowest, ratios[lowest]), "pooled": rate[method] / rate[against]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results.json(.gz) written by genspec bench")
    parser.add_argument("--methods", required=True, help="comma-separated methods to compare")
    parser.add_argument("--against", required=True, help="comma-separated reference methods")
    args = parser.parse_args()
    results = read_results(Path(args.results))
    print("| method | against | geometric mean of categories, per repeat | lowest category | pooled |")
    print("|---|---|---|---|---|")
    for method in args.methods.split(","):
        for against in args.against.split(","):
            rows = compare(results, method, against)
            means = " / ".join(f"{r['geometric_mean']:.2f}x" for r in rows)
            lowest = " / ".join(f"{r['lowest'][0]} {r['lowest'][1]:.2f}x" for r in rows)
            pooled = " / ".join(f"{r['pooled']:.2f}x" for r in rows)
            print(f"| {method} | {against} | {means} | {lowest} | {pooled} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
