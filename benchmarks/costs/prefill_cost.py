"""Milliseconds per prompt token of LlamaCppLM.add_rows (the engine's admission prefill) under each kernel
setting, one JSON line: how much of a loaded server's time the exact kernels add at admission. One setting
per process, because llama.cpp reads its tiled-matmul switch once per process:

    python benchmarks/costs/prefill_cost.py --kernels exact
    python benchmarks/costs/prefill_cost.py --kernels fast
"""
import argparse
import json
import time

import torch

from genspec.embedded import default_gguf_path
from genspec.models.llamacpp import LlamaCppLM

ap = argparse.ArgumentParser()
ap.add_argument("--kernels", choices=("exact", "fast"), default="exact")
ap.add_argument("--lengths", default="64,256,512")
ap.add_argument("--reps", type=int, default=3)
a = ap.parse_args()
path = default_gguf_path(progress=False)
lm = LlamaCppLM(path, kernels=a.kernels, max_rows=16, context=2048)
g = torch.Generator().manual_seed(0)
res = {}
prompts = lambda rows, n: [torch.randint(1000, 20000, (n,), generator=g).tolist() for _ in range(rows)]
for rows, n in [(1, int(n)) for n in a.lengths.split(",")] + [(4, 256)]:
    best = float("inf")
    for _ in range(a.reps):
        lm.reset(0); batch = prompts(rows, n)
        t = time.perf_counter(); lm.add_rows(batch); best = min(best, time.perf_counter() - t)
    res[f"{rows}x{n} ms/token"] = round(1000 * best / (rows * n), 2)
lm.reset(0); lm.add_rows(prompts(16, 200))
tokens = torch.randint(1000, 20000, (16, 1), generator=g)
best = float("inf")
for _ in range(10):
    t = time.perf_counter(); lm.forward_transient(tokens); lm.commit_all(); best = min(best, time.perf_counter() - t)
res["16x1 decode ms"] = round(1000 * best, 1)
print(json.dumps({"kernels": a.kernels, **res}), flush=True)
