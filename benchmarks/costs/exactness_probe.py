"""Does a row's logits depend on the batch llama.cpp computes it in? Bitwise comparison, one JSON line.

A prompt's greedy continuation is decoded one token at a time (the reference); then the same positions are
computed as one k-token block, beside 1..15 other rows (one token or four each), and after a prefill that
holds them. Each entry is [positions bitwise equal, positions compared, largest absolute logit difference].
--len0 700 puts the row past 512 KV cells, where llama.cpp's flash attention splits a lone query's cells
across threads. --kv-type sets the KV cache type; --tiled off / force sets GGML_CPU_TILED_MM (its tiled
K-quant matmul runs from 8 rows unless told otherwise). Run from anywhere:

    python benchmarks/costs/exactness_probe.py --kv-type bf16 --tiled off --len0 700
"""
import argparse
import json
import os

import llama_settings

ap = argparse.ArgumentParser()
ap.add_argument("--repack", type=int, default=0)
ap.add_argument("--gguf", default=None)
ap.add_argument("--steps", type=int, default=16)
ap.add_argument("--len0", type=int, default=20)
ap.add_argument("--threads", type=int, default=None)
llama_settings.add_arguments(ap)
a = ap.parse_args()
options = llama_settings.apply(a)
import torch

from genspec.embedded import default_gguf_path
from genspec.models.llamacpp import LlamaCppLM

path = a.gguf or default_gguf_path(progress=False)
lm = LlamaCppLM(path, max_rows=16, context=2048, threads=a.threads, repack=bool(a.repack), **options)
V = lm.vocab_size
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(10, min(5000, V - 1), ((a.len0 if i == 0 else 20) + 3 * i,), generator=g).tolist() for i in range(16)]
# reference: prompt 0 alone, one token at a time (greedy continuation)
lm.reset(0); lm.add_rows([prompts[0][:-1]])
tok = prompts[0][-1]
ref, toks = [], []
for _ in range(a.steps):
    lo = lm.forward(torch.tensor([[tok]]))[0, -1].clone(); lm.commit_all()
    ref.append(lo); toks.append(tok); tok = int(lo.argmax())
ref = torch.stack(ref)
out = {}
def cmp(name, got):
    eq = [bool(torch.equal(got[i], ref[i])) for i in range(len(got))]
    out[name] = (sum(eq), len(eq), float((got - ref[:len(got)]).abs().max()))
for k in (2, 3, 4, 5, 7, 8, 9, 12, 16):
    if k > a.steps: continue
    lm.reset(0); lm.add_rows([prompts[0][:-1]])
    got = lm.forward(torch.tensor([toks[:k]]))[0].clone()
    cmp(f"block{k}", got)
for rows in (2, 4, 8, 16):
    lm.reset(0); lm.add_rows([p[:-1] for p in prompts[:rows]])
    others = [p[-1] for p in prompts[:rows]]
    got = []
    for i in range(min(a.steps, 8)):
        t = torch.tensor([[toks[i]] + others[1:]]).T
        lo = lm.forward(t); lm.commit_all()
        got.append(lo[0, -1].clone())
        others = [0] + [int(x) for x in lo[1:, -1].argmax(-1)]
    cmp(f"rows{rows}x1", torch.stack(got))
    # rows x 4 block
    lm.reset(0); lm.add_rows([p[:-1] for p in prompts[:rows]])
    t = torch.tensor([toks[:4]] + [[p[-1], 11, 12, 13] for p in prompts[1:rows]])
    cmp(f"rows{rows}x4", lm.forward(t)[0].clone())
# prefill: prompt 0 + toks[:8] prefilled in one batch: last logits vs ref[7]
lm.reset(0); lm.add_rows([prompts[0][:-1] + toks[:7]])
got = lm.forward(torch.tensor([[toks[7]]]))[0, -1:].clone()
out["prefill_then_step"] = (int(torch.equal(got[0], ref[7])), 1, float((got[0]-ref[7]).abs().max()))
print(json.dumps({"model": os.path.basename(str(path)), "len0": a.len0, "kv_type": a.kv_type, "tiled": a.tiled, "fa": a.fa, "repack": a.repack,
                  "lib": os.environ.get("LLAMA_CPP_LIB_PATH", "installed"), **out}))
