"""What llama.cpp's context settings cost on the embedded model: one ``llama_decode`` of the llamacpp backend
(``LlamaCppLM``) with the KV cache shared by all rows or a stream per row, flash attention on or off, and the
weights as the file lays them out or repacked for the CPU kernels, for one row's one-token step, one row's
4-token block and 16 rows' one-token steps after prompts of 100 and of 500 tokens.

    python benchmarks/costs/llamacpp_decode_settings.py [--rounds 5] [--steps 40]

Every setting is loaded once; the rounds alternate between them (slow drifts of the machine hit all alike), each
round a fresh 100-token prompt per row and ``--steps`` timed calls per shape; medians of ms per call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from genspec.embedded import default_gguf_path
from genspec.models.llamacpp import LlamaCppLM

SHAPES = {"1 row x 1": (1, 1, 100), "1 row x 4": (1, 4, 100), "16 rows x 1": (16, 1, 100),
          "16 rows x 1, 500-token prompts": (16, 1, 500)}
#: (shared cache, flash attention, repack)
SETTINGS = {"shared cache": (True, False, False), "stream per row": (False, False, False),
            "stream per row, flash attention": (False, True, False),
            "stream per row, flash attention, repacked": (False, True, True)}


def time_shape(model: LlamaCppLM, rows: int, width: int, prompt: int, steps: int, seed: int) -> float:
    model.reset(0)
    model.add_rows([[1000 + (seed * 7 + r * 13 + i) % 5000 for i in range(prompt)] for r in range(rows)])
    block = torch.full((rows, width), 5, dtype=torch.long)
    keep = torch.zeros(rows, 1, dtype=torch.long)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model.forward_transient(block)
        times.append(time.perf_counter() - started)
        model.keep_block(keep)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    path = default_gguf_path()
    settings = {name: LlamaCppLM(path, max_rows=16, context=4096, shared_cache=shared, flash_attention=flash,
                                 repack=repack) for name, (shared, flash, repack) in SETTINGS.items()}
    figures = {(name, shape): [] for name in settings for shape in SHAPES}
    for round_ in range(args.rounds):
        order = list(settings)
        for name in order[round_ % len(order):] + order[:round_ % len(order)]:
            for shape, (rows, width, prompt) in SHAPES.items():
                figures[name, shape].append(time_shape(settings[name], rows, width, prompt, args.steps, round_))
    print(f"ms per llama_decode, medians of {args.rounds} rounds x {args.steps} calls")
    print("| setting | " + " | ".join(SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for name in settings:
        print(f"| {name} | " + " | ".join(f"{statistics.median(figures[name, s]):.2f}" for s in SHAPES) + " |")


if __name__ == "__main__":
    main()
