"""What a sampled step's law and draw cost on the embedded model's real laws: top-p (nucleus) by a full sort of
the vocabulary, by the top 1,024 tokens, and by genspec's selection by probability share
(:data:`genspec.sampling.NUCLEUS_SHARE`); the law as a softmax over the whole masked row or over the nucleus only
(:func:`genspec.sampling.process_logits`); an inverse-CDF draw from it with its search for the last positive token
always done or only when needed (:func:`genspec.acceptance.sample_with_uniforms`).

    python benchmarks/costs/top_p_cost.py [--temperature 0.7] [--top-p 0.9] [--repeats 50]

Logits: the embedded Gemma 3 270M (llama.cpp backend) after each of 4 Spec-Bench-style prompts and 16 greedy
tokens of each (64 rows of 262,144 logits), scaled by the temperature. Median milliseconds per row; with the
share selection, how many tokens it ranked and how often it had to widen.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch
from timing import median_seconds

import genspec
import genspec.sampling as sampling
from genspec.acceptance import sample_with_uniforms
from genspec.kernels import most_likely
from genspec.sampling import SamplingConfig, process_logits

PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain why the sky is blue.",
           "def quicksort(arr):", "Translate to French: The weather is nice today."]


def rows_of_logits(tokens: int = 16) -> torch.Tensor:
    engine = genspec.load(drafter="none", backend="llamacpp")
    target, rows = engine.target, []
    for prompt in PROMPTS:
        ids = engine.tokenizer(prompt)["input_ids"]
        target.reset(0)
        target.add_rows([ids[:-1]])
        last = ids[-1]
        for _ in range(tokens):
            logits = target.forward(torch.tensor([[last]]))[0, 0]
            target.commit_all()
            rows.append(logits.clone())
            last = int(logits.argmax())
    return torch.stack(rows)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    logits = rows_of_logits() / args.temperature
    ranked = []
    for row in logits:
        probs = (row - row.max()).exp()
        probs /= probs.sum()
        ranked.append(int((probs >= probs.max() * sampling.NUCLEUS_SHARE).sum()))
    sort = [1e3 * median_seconds(lambda: torch.sort(row, descending=True), args.repeats // 5 or 1) for row in logits[:8]]
    topk = [1e3 * median_seconds(lambda: torch.topk(row, 1024), args.repeats) for row in logits]
    rows = [row[None] for row in logits]
    share = [1e3 * median_seconds(lambda: sampling._softmax_in_nucleus(row, [args.top_p]), args.repeats) for row in rows]
    laws = [sampling._softmax_in_nucleus(row, [args.top_p]) for row in rows]
    kept = [int((law > 0).sum()) for law in laws]
    masked = [1e3 * median_seconds(lambda: row.masked_fill(law == 0, -math.inf).softmax(-1), args.repeats)
              for row, law in zip(rows, laws)]
    config = SamplingConfig(temperature=1.0, top_p=args.top_p)  # the rows are already divided by the temperature
    law_time = [1e3 * median_seconds(lambda: process_logits(row, config), args.repeats) for row in rows]
    uniforms = torch.rand(1, dtype=torch.float64)
    draw = [1e3 * median_seconds(lambda: sample_with_uniforms(law, uniforms), args.repeats) for law in laws]
    search = [1e3 * median_seconds(lambda: law.shape[-1] - 1 - most_likely((law > 0).flip(-1)), args.repeats)
              for law in laws]
    print(f"{len(logits)} rows, T {args.temperature}, top-p {args.top_p}; median ms per row [max]")
    print("| step | ms |\n|---|---|")
    print(f"| top-p by a full sort | {statistics.median(sort):.2f} [{max(sort):.2f}] |")
    print(f"| top-p by the top 1,024 | {statistics.median(topk):.2f} [{max(topk):.2f}] |")
    print(f"| top-p by share and the law over the nucleus (genspec) | {statistics.median(share):.2f} [{max(share):.2f}] |")
    print(f"| a softmax over the whole masked row instead | {statistics.median(masked):.2f} [{max(masked):.2f}] |")
    print(f"| process_logits: temperature, top-p, law | {statistics.median(law_time):.2f} [{max(law_time):.2f}] |")
    print(f"| sample_with_uniforms: one draw | {statistics.median(draw):.2f} [{max(draw):.2f}] |")
    print(f"| the search for the last positive token it skips | {statistics.median(search):.2f} [{max(search):.2f}] |")
    print(f"tokens ranked by share: median {statistics.median(ranked)}, max {max(ranked)}; nucleus size: median "
          f"{statistics.median(kept)}, max {max(kept)}; rows whose first selection held less than top-p: "
          f"{sum(k > r for k, r in zip(kept, ranked))}")

if __name__ == "__main__":
    main()
