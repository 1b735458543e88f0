"""Markdown tables method x category from a `genspec bench` results.json (for the README).

    python benchmarks/category_table.py benchmarks/results/spec_bench_final/results.json
    python benchmarks/category_table.py RESULTS --stats     # cells: speedup, acceptance, mean accepted, tok/s

Cells are medians over repeats (the report's own summary figures); the `mean` column is the mean over
categories of the per-category speedup, as in the report's summary.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _median(value):
    return value.get("median") if isinstance(value, dict) else value


def table(results: dict, stats: bool = False) -> str:
    summary = results["summary"]
    categories = [c for c in summary["categories"]]
    rows = {(r["method"], r["category"]): r for r in summary["rows"]}
    methods = [m for m in summary["methods"]]
    header = ["method"] + categories + ["mean"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        cells = [method]
        for category in categories + ["mean"]:
            row = rows.get((method, category))
            speedup = _median(row["speedup_vs_plain"]) if row else None
            if speedup is None:
                cells.append("–")
                continue
            cell = f"{speedup:.2f}x"
            if stats and category != "mean" and row.get("kind") == "genspec" and row.get("drafted_tokens"):
                cell += (f"<br>{row['acceptance_rate']:.2f} / {row['mean_accepted_length']:.2f}"
                         f"<br>{_median(row['tokens_per_second']):.1f} tok/s")
            elif stats and category != "mean":
                cell += f"<br>{_median(row['tokens_per_second']):.1f} tok/s"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results.json written by genspec bench")
    parser.add_argument("--stats", action="store_true",
                        help="add acceptance rate / mean accepted length and tokens/s to each cell")
    args = parser.parse_args()
    print(table(json.loads(Path(args.results).read_text()), args.stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
