"""Markdown tables method x category from a `genspec bench` results.json (for the README).

    python benchmarks/analysis/category_table.py benchmarks/results/all_kinds/results.json.gz
    python benchmarks/analysis/category_table.py RESULTS --stats     # cells: speedup, acceptance, mean accepted, tok/s
    python benchmarks/analysis/category_table.py BEFORE AFTER --labels before,after --methods plain,prompt-lookup
                                                            # one table, a row per (run, method)
    python benchmarks/analysis/category_table.py BEFORE AFTER --labels before,after --spread
                                                            # cells: median [min–max] over repeats; mean: + tok/s

Cells are medians over repeats (the report's own summary figures); the `mean` column is the mean over
categories of the per-category speedup, as in the report's summary.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from genspec.bench.run import read_results  # results.json or results.json.gz


def _median(value):
    return value.get("median") if isinstance(value, dict) else value


def _spread(value, digits: int = 2) -> str:
    return f"{value['median']:.{digits}f} [{value['min']:.{digits}f}–{value['max']:.{digits}f}]"


def table(results: dict, stats: bool = False, methods: list[str] | None = None, label: str = "",
          header: bool = True, spread: bool = False) -> str:
    summary = results["summary"]
    categories = [c for c in summary["categories"]]
    rows = {(r["method"], r["category"]): r for r in summary["rows"]}
    methods = [m for m in summary["methods"] if methods is None or m in methods]
    names = ["method"] + categories + ["mean"]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)] if header else []
    for method in methods:
        cells = [f"{method} ({label})" if label else method]
        for category in categories + ["mean"]:
            row = rows.get((method, category))
            speedup = _median(row["speedup_vs_plain"]) if row else None
            if speedup is None:
                cells.append("–")
                continue
            cell = f"{speedup:.2f}x"
            if spread:
                cell = _spread(row["speedup_vs_plain"]).replace(" [", "x [")
                if category == "mean":
                    cell += f"<br>{_spread(row['tokens_per_second'], 1)} tok/s"
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
    parser.add_argument("results", nargs="+", help="results.json written by genspec bench (several: one table)")
    parser.add_argument("--stats", action="store_true",
                        help="add acceptance rate / mean accepted length and tokens/s to each cell")
    parser.add_argument("--labels", help="comma-separated, one per results file (rows read 'method (label)')")
    parser.add_argument("--methods", help="comma-separated methods to show (default: all)")
    parser.add_argument("--spread", action="store_true",
                        help="cells read median [min–max] over repeats; the mean column adds tokens/s")
    args = parser.parse_args()
    labels = args.labels.split(",") if args.labels else [""] * len(args.results)
    if len(labels) != len(args.results):
        parser.error("--labels needs one label per results file")
    methods = args.methods.split(",") if args.methods else None
    print("\n".join(table(read_results(Path(path)), args.stats, methods, label, header=i == 0, spread=args.spread)
                    for i, (path, label) in enumerate(zip(args.results, labels))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
