"""Exact expected rejections vs Monte-Carlo simulation on random chain pairs (README table).

    python benchmarks/theory/theory_exact_vs_simulated.py

Each row: a flat-Dirichlet pair (docs/theory.md) made by `genspec theory random-chain`, then
`genspec theory rejections --simulate 100000` with simulation seed 1000 + pair seed.
"""
from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from genspec.cli import main

ROWS = [(0, 7, 50, 1, "batch"), (0, 7, 50, 4, "batch"), (0, 7, 50, 4, "multidraft"),
        (1, 3, 50, 2, "batch"), (1, 3, 50, 2, "multidraft"), (2, 20, 30, 8, "batch"), (2, 20, 30, 8, "multidraft")]


def run_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def main_table(runs: int = 100_000) -> None:
    print("| pair seed | V | T | M | variant | exact | simulated (mean ± s.e.) | z | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for seed, vocab, horizon, batch, variant in ROWS:
            chain = Path(tmp) / f"pair-{seed}.json"
            with contextlib.redirect_stdout(io.StringIO()):
                main(["theory", "random-chain", "--vocab", str(vocab), "--horizon", str(horizon), "--seed", str(seed),
                      "--out", str(chain)])
            start = time.perf_counter()
            result = run_json(["theory", "rejections", str(chain), "--batch", str(batch), "--variant", variant,
                               "--simulate", str(runs), "--seed", str(1000 + seed), "--json"])
            seconds = time.perf_counter() - start
            exact, mean, stderr = result["expected_rejections"], result["simulated_mean"], result["simulated_stderr"]
            name = "SD" if batch == 1 else variant
            print(f"| {seed} | {vocab} | {horizon} | {batch} | {name} | {exact:.4f} | {mean:.4f} ± {stderr:.4f} | "
                  f"{(mean - exact) / stderr:+.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main_table()
