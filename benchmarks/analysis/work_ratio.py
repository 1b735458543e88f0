"""Speedup per category with the machine's noise taken out: each request against its own one-token steps.

    python benchmarks/analysis/work_ratio.py benchmarks/results/default_32_greedy/results.json.gz --method prompt-lookup

On the 2-core VMs the same one-token step of the same request took 71 ms in one engine and 83 ms in the
other, back to back (a writing prompt at 32 tokens), so at 32 tokens a category's
wall-clock cell moves by several percent from noise alone. This reads the per-width verify times a
``genspec bench`` run records and prices each request's work in its own one-token steps: plain decoding
would have made ``new_tokens`` such steps, the method spent its measured verify time. The ratio
``new_tokens x (its width-1 step) / (its verify time)`` is what the method's choices (draft lengths, blocks
that failed) gained or lost, on the same machine state. It leaves out prefill and the engine's own work
between passes (equal in both engines: compare ``time_breakdown.png``); requests that never verified a
single token alone have no width-1 step and are skipped.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from genspec.bench.run import read_results  # results.json or results.json.gz


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a genspec bench results.json")
    parser.add_argument("--method", default="prompt-lookup")
    args = parser.parse_args()
    runs = read_results(Path(args.results))["runs"]
    ratios: dict[str, list[float]] = {}
    for run in runs:
        if run["method"] != args.method or run["phase"] != "main" or run["error"]:
            continue
        widths = run["forward"]["verify_by_width"]
        if "1" not in widths:
            continue
        calls, seconds = widths["1"]
        verify = sum(s for _, s in widths.values())
        ratios.setdefault(run["category"], []).append(run["new_tokens"] * (seconds / calls) / verify)
    print(f"| category | requests | work ratio, mean | lowest request |\n|---|---|---|---|")
    for category, values in ratios.items():
        print(f"| {category} | {len(values)} | {statistics.mean(values):.3f} | {min(values):.3f} |")
    everything = [v for values in ratios.values() for v in values]
    print(f"| all | {len(everything)} | {statistics.mean(everything):.3f} | {min(everything):.3f} |")


if __name__ == "__main__":
    main()
