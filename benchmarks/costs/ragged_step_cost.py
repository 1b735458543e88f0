"""What a verify step of rows of different widths costs on the llama.cpp backend, against what the draft-length
plan prices it at: as the uniform blocks llama.cpp runs it as (``LlamaCppLM.block_shapes``, priced from the
measured uniform shapes by ``CostModel.shapes_relative``), and as every row padded to the widest (the price
before the plan knew the shapes); and what the engine's NaN check and greedy argmax over the step's logits cost
reading every position of the padded ``[rows, widest, V]`` block against its valid positions only.

    python benchmarks/costs/ragged_step_cost.py [--rows 16] [--context 300] [--repeats 9]

The uniform shapes (rows in 1, 2, 4, 8, 16 up to ``--rows``, widths 1 to 9) are timed first, after
``--context`` tokens per row, into a ``CostModel``; then each mixed step is timed. Medians of ``--repeats``
calls (the first two dropped), in ms, on the embedded GGUF model with a cache stream per row.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from genspec.draft_length import CostModel
from genspec.drafting import unusable_rows
from genspec.embedded import default_gguf_path
from genspec.kernels import most_likely
from genspec.models.llamacpp import LlamaCppLM

MIXED = {
    "1 row of 5, the rest 1": lambda n: [5] + [1] * (n - 1),
    "a quarter of 4, the rest 1": lambda n: [4] * (n // 4) + [1] * (n - n // 4),
    "half of 2, half of 1": lambda n: [2] * (n // 2) + [1] * (n - n // 2),
    "half of 4, half of 1": lambda n: [4] * (n // 2) + [1] * (n - n // 2),
    "widths 1 to 5 in turn": lambda n: [1 + i % 5 for i in range(n)],
}


def timed(model: LlamaCppLM, widths: list[int], repeats: int) -> float:
    """Median seconds of a forward whose row i holds ``widths[i]`` tokens (rolled back after each)."""
    tokens = torch.full((len(widths), max(widths)), 5, dtype=torch.long)
    valid = torch.arange(max(widths))[None, :] < torch.tensor(widths)[:, None]
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        model.forward_transient(tokens, valid)
        times.append(time.perf_counter() - started)
        model.keep_block(torch.full((len(widths), 1), -1))
    return statistics.median(times[2:])


def reductions(model: LlamaCppLM, widths: list[int], repeats: int) -> tuple[float, float]:
    """Median seconds of the NaN check and the argmax over a forward's logits: every position, valid ones only."""
    tokens = torch.full((len(widths), max(widths)), 5, dtype=torch.long)
    valid = torch.arange(max(widths))[None, :] < torch.tensor(widths)[:, None]
    logits = model.forward(tokens, valid)
    model.keep_block(torch.full((len(widths), 1), -1))
    out = []
    for mask in (torch.ones_like(valid), valid):  # every position read, or the valid ones
        times = []
        for _ in range(repeats + 2):
            started = time.perf_counter()
            unusable_rows(logits, mask)
            most_likely(logits, mask)
            times.append(time.perf_counter() - started)
        out.append(statistics.median(times[2:]))
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model = LlamaCppLM(default_gguf_path(), max_rows=args.rows)
    model.add_rows([[2] + [1000 + (37 * i) % 5000 for i in range(args.context - 1)]] * args.rows)
    costs = CostModel()
    batches = [b for b in (1, 2, 4, 8, 16) if b < args.rows] + [args.rows]
    for batch in batches:
        for width in range(1, 10):
            costs.observe_verify(width, timed(model, [width] * batch + [0] * (args.rows - batch), args.repeats), batch)
    plain = costs.verify_cost(1, args.rows)
    print("uniform shapes, ms (rows x width 1..9): " + "; ".join(
        f"{b}: " + " ".join(f"{1e3 * costs.verify[(b, w)]:.0f}" for w in range(1, 10)) for b in batches))
    print(f"\n| {args.rows} rows | widths | measured ms | priced by its blocks ms | priced padded ms | "
          "NaN check + argmax ms, every position | valid positions only |")
    print("|---|---|---|---|---|---|---|")
    for name, make in MIXED.items():
        widths = make(args.rows)
        measured = timed(model, widths, args.repeats)
        shapes = model.block_shapes(widths)
        priced = costs.shapes_relative(shapes, args.rows) * plain
        padded = costs.relative(max(widths), args.rows) * plain
        every, only = reductions(model, widths, args.repeats)
        print(f"| {name} | {' '.join(map(str, widths))} | {1e3 * measured:.0f} | {1e3 * priced:.0f} "
              f"({' + '.join(f'{r}x{t}' for r, t in shapes)}) | {1e3 * padded:.0f} | {1e3 * every:.1f} | "
              f"{1e3 * only:.1f} |", flush=True)


if __name__ == "__main__":
    main()
