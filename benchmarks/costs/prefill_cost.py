"""Milliseconds per prompt token of LlamaCppLM.add_rows (the engine's admission prefill) under each kernel
setting, and of a one-token step of 1 and of 16 rows, one JSON line: how much of a loaded server's time each
kind of kernels costs at admission and per step. One setting per process, because llama.cpp reads its
tiled-matmul switch once per process:

    python benchmarks/costs/prefill_cost.py --kernels exact
    python benchmarks/costs/prefill_cost.py --kernels exact-tiled
    python benchmarks/costs/prefill_cost.py --kernels fast
"""
import argparse
import json
import time

import torch

from genspec.embedded import default_gguf_path
from genspec.models.llamacpp import Kernels, LlamaCppLM

ap = argparse.ArgumentParser()
ap.add_argument("--kernels", choices=[k.value for k in Kernels], default="exact")
ap.add_argument("--lengths", default="64,256,512")
ap.add_argument("--reps", type=int, default=3)
a = ap.parse_args()
path = default_gguf_path(progress=False)
lm = LlamaCppLM(path, kernels=a.kernels, max_rows=16, context=2048)
g = torch.Generator().manual_seed(0)


def prompts(rows: int, n: int) -> list[list[int]]:
    return [torch.randint(1000, 20000, (n,), generator=g).tolist() for _ in range(rows)]


def best_seconds(setup, call, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``call(setup())``; ``setup`` is not timed."""
    best = float("inf")
    for _ in range(reps):
        arg = setup()
        t = time.perf_counter(); call(arg); best = min(best, time.perf_counter() - t)
    return best


def fresh_prompts(rows: int, n: int):
    lm.reset(0)
    return prompts(rows, n)


res = {}
for rows, n in [(1, int(n)) for n in a.lengths.split(",")] + [(4, 256)]:
    seconds = best_seconds(lambda: fresh_prompts(rows, n), lm.add_rows, a.reps)
    res[f"{rows}x{n} ms/token"] = round(1000 * seconds / (rows * n), 2)
for rows in (1, 16):
    lm.reset(0); lm.add_rows(prompts(rows, 200))
    tokens = torch.randint(1000, 20000, (rows, 1), generator=g)
    seconds = best_seconds(lambda: tokens, lambda t: (lm.forward_transient(t), lm.commit_all()), 10)
    res[f"{rows}x1 decode ms"] = round(1000 * seconds, 1)
print(json.dumps({"kernels": a.kernels, **res}), flush=True)
