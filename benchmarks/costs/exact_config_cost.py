"""Median milliseconds of one llama_decode of (rows x width tokens) at a given context, one JSON line, under
the llama.cpp settings of exactness_probe.py (--kv-type, --tiled): what the batch-invariant settings cost.

    python benchmarks/costs/exact_config_cost.py --kv-type bf16 --tiled off --context 800
"""
import argparse
import json
import statistics
import time

import llama_settings

ap = argparse.ArgumentParser()
ap.add_argument("--context", type=int, default=200)
ap.add_argument("--reps", type=int, default=9)
llama_settings.add_arguments(ap)
a = ap.parse_args()
options = llama_settings.apply(a)
import torch

from genspec.embedded import default_gguf_path
from genspec.models.llamacpp import LlamaCppLM

lm = LlamaCppLM(default_gguf_path(progress=False), max_rows=16, context=2048, **options)
g = torch.Generator().manual_seed(0)
res = {}
for rows in (1, 4, 16):
    lm.reset(0); lm.add_rows([torch.randint(10, 5000, (a.context,), generator=g).tolist() for _ in range(rows)])
    for width in ((1, 2, 4, 8, 16) if rows == 1 else (1, 4)):
        tokens = torch.randint(10, 5000, (rows, width), generator=g)
        times = []
        for _ in range(a.reps):
            t = time.perf_counter(); lm.forward_transient(tokens); times.append(time.perf_counter() - t)
            lm.keep_block(torch.full((rows, 1), -1))
        res[f"{rows}x{width}"] = round(1000 * statistics.median(times), 2)
print(json.dumps({"kv_type": a.kv_type, "tiled": a.tiled, "fa": a.fa, "context": a.context, **res}))
