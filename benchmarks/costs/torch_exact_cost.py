"""What the torch backend's exact kernels (``--kernels exact``, ``HFCausalLM(..., exact=True)``) cost beside its
default ones on the embedded Gemma 3 270M (float32): one forward of a decode step, of verify blocks and of a batch
of rows, after ``--context`` tokens per row, and a prefill of that many tokens.

    python benchmarks/costs/torch_exact_cost.py [--context 200] [--repeats 9] [--runs 3]

Both models are loaded once (two copies of the weights) and timed interleaved, shape by shape, so that a slower
stretch of a shared machine falls on both; each cell is the median of ``--repeats`` forwards, and the script
prints each run's table and, per cell, the lowest and highest median over ``--runs`` runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from genspec.embedded import default_model_dir
from genspec.models import HFCausalLM

#: (title, rows, tokens per row); the last is the prefill
SHAPES = [("1 row x 1 token", 1, 1), ("1 x 4", 1, 4), ("1 x 16", 1, 16), ("4 rows x 1", 4, 1),
          ("16 rows x 1", 16, 1)]


def forward_seconds(lm: HFCausalLM, rows: int, width: int, context: int) -> float:
    """One timed forward of ``width`` tokens per row over ``rows`` rows of ``context`` cached tokens (the block is
    not kept, so every repeat sees the same cache)."""
    lm.reset(0)
    lm.add_rows([[(7 * r + i) % 1000 + 10 for i in range(context)] for r in range(rows)])
    block = torch.tensor([[(13 * r + i) % 1000 + 10 for i in range(width)] for r in range(rows)])
    started = time.perf_counter()
    lm.forward(block)
    return time.perf_counter() - started


def prefill_seconds(lm: HFCausalLM, context: int) -> float:
    lm.reset(0)
    started = time.perf_counter()
    lm.add_rows([[(7 * i) % 1000 + 10 for i in range(context)]])
    return time.perf_counter() - started


def one_run(models: dict[str, HFCausalLM], context: int, repeats: int) -> dict[str, list[float]]:
    """Kind -> median ms per shape (the prefill last), the kinds interleaved repeat by repeat."""
    cells: dict[str, list[float]] = {kind: [] for kind in models}
    for _, rows, width in SHAPES + [("prefill", 0, 0)]:
        times: dict[str, list[float]] = {kind: [] for kind in models}
        for repeat in range(repeats + 1):  # the first is a warm-up
            for kind, lm in models.items():
                seconds = prefill_seconds(lm, context) if not rows else forward_seconds(lm, rows, width, context)
                if repeat:
                    times[kind].append(seconds)
        for kind in models:
            cells[kind].append(statistics.median(times[kind]) * 1e3)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    path = default_model_dir()
    models = {"default": HFCausalLM.from_pretrained(path), "exact": HFCausalLM.from_pretrained(path, exact=True)}
    titles = [title for title, _, _ in SHAPES] + [f"a {args.context}-token prefill"]
    print(f"embedded Gemma 3 270M, float32, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.context} tokens per row; median ms of {args.repeats} forwards, kinds interleaved")
    runs = []
    for run in range(args.runs):
        runs.append(one_run(models, args.context, args.repeats))
        print(f"\nrun {run + 1}\n\n| | " + " | ".join(titles) + " |\n|---|" + "---|" * len(titles))
        for kind, cells in runs[-1].items():
            print(f"| {kind} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print(f"\nlowest-highest over {args.runs} runs, and the exact / default ratio of the medians of the runs\n")
    print("| | " + " | ".join(titles) + " |\n|---|" + "---|" * len(titles))
    for kind in models:
        spans = [(min(r[kind][i] for r in runs), max(r[kind][i] for r in runs)) for i in range(len(titles))]
        print(f"| {kind}, ms | " + " | ".join(f"{low:.0f}-{high:.0f}" for low, high in spans) + " |")
    ratios = [statistics.median(r["exact"][i] for r in runs) / statistics.median(r["default"][i] for r in runs)
              for i in range(len(titles))]
    print("| exact / default | " + " | ".join(f"{ratio:.2f}x" for ratio in ratios) + " |")


if __name__ == "__main__":
    main()
