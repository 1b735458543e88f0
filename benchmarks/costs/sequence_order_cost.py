"""What a batched step costs on the llama.cpp backend by how its rows' cache sequences are laid out.

With a cache stream per row llama.cpp puts into one micro-batch (one pass over the weights) only rows whose
sequence ids rise by one in batch order. The backend emits rows in sequence order and gives a joining row the
lowest free sequence, so a batch that lost and regained rows still runs as one pass; a batch whose sequences
have gaps (what a batch in engine-row order with freed ids handed out last looked like to llama.cpp) runs as
one pass per run of consecutive ids.

    python benchmarks/costs/sequence_order_cost.py [--rows 16] [--context 64] [--repeats 7]

Layouts, each with ``--rows`` rows of ``--context`` prompt tokens: ``fresh`` (sequences 0..rows-1),
``churned`` (rows 3 and 9 left, two rows joined: they take sequences 3 and 9 again), ``gapped`` (the same rows on
every sequence of ``rows + 4`` but four scattered ones: four gaps). Steps: every row 1 token, and the first row 5
tokens with the rest 1. Median ms of ``--repeats`` calls, the layouts interleaved in each repeat (this machine's
speed drifts), with the micro-batches ``block_shapes`` predicts.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from genspec.embedded import default_gguf_path
from genspec.models.llamacpp import LlamaCppLM


def prompt(row: int, length: int) -> list[int]:
    return [2] + [1000 + (37 * i + 101 * row) % 5000 for i in range(length - 1)]


def layout(name: str, rows: int, context: int) -> LlamaCppLM:
    """A model holding ``rows`` rows laid out on its sequences as ``name`` says."""
    if name == "gapped":
        model = LlamaCppLM(default_gguf_path(), max_rows=rows + 4)
        model.add_rows([prompt(r, context) for r in range(rows + 4)])
        model.remove_rows([2, 6, 10, 13])
        return model
    model = LlamaCppLM(default_gguf_path(), max_rows=rows)
    model.add_rows([prompt(r, context) for r in range(rows)])
    if name == "churned":
        model.remove_rows([3, 9])
        model.add_rows([prompt(rows + r, context) for r in range(2)])
    return model


def timed(model: LlamaCppLM, widths: list[int]) -> float:
    """Seconds of one forward whose row i holds ``widths[i]`` tokens, rolled back after."""
    tokens = torch.full((len(widths), max(widths)), 5, dtype=torch.long)
    valid = torch.arange(max(widths))[None, :] < torch.tensor(widths)[:, None]
    started = time.perf_counter()
    model.forward_transient(tokens, valid)
    elapsed = time.perf_counter() - started
    model.keep_block(torch.full((len(widths), 1), -1))
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    steps = {"every row 1 token": [1] * args.rows, "first row 5, the rest 1": [5] + [1] * (args.rows - 1)}
    models = {name: layout(name, args.rows, args.context) for name in ("fresh", "churned", "gapped")}
    times: dict[tuple[str, str], list[float]] = {(m, s): [] for m in models for s in steps}
    for repeat in range(args.repeats + 2):
        for step, widths in steps.items():
            for name, model in models.items():
                elapsed = timed(model, widths)
                if repeat >= 2:  # the first two warm the caches
                    times[(name, step)].append(elapsed)
    print(f"| {args.rows} rows, {args.context}-token prompts | step | ms (median of {args.repeats}) | "
          "micro-batches (rows x tokens) |")
    print("|---|---|---|---|")
    for name, model in models.items():
        for step, widths in steps.items():
            shapes = " + ".join(f"{r}x{t}" for r, t in model.block_shapes(widths))
            print(f"| {name} | {step} | {1e3 * statistics.median(times[(name, step)]):.0f} | {shapes} |")


if __name__ == "__main__":
    main()
