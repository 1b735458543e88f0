"""The llamacpp backend's cost curve and numerics on the embedded GGUF (Gemma 3 270M, Q4_K_M).

1. What one row's verify block of k tokens costs on :class:`genspec.models.llamacpp.LlamaCppLM` (logits at
   every position, what verification reads) against the same block with logits at the last position only,
   and against genspec's one-token step: the price the draft-length policy learns for this backend.
2. How often llama.cpp's greedy token differs between a k-token block and k one-token steps on the same
   text (its kernels may round a position differently in a batch): the flip rate that bounds how often
   speculative greedy output can differ from plain greedy output on this backend.

    python benchmarks/costs/llamacpp_verify_cost.py [--threads N] [--repack] [--prompts N] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench


def block_cost(lm, prompt: list[int], k: int, last_only: bool, repeats: int) -> float:
    """Median ms of a k-token block after ``prompt`` (the block is rolled back after each timing)."""
    lm.reset(0)
    lm.add_rows([prompt])
    block = torch.tensor([prompt[-k:] if len(prompt) >= k else [prompt[-1]] * k])
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        lm.forward(block, last_only=last_only)
        times.append((time.perf_counter() - started) * 1000)
        lm.keep_block(torch.tensor([[0]]))
        lm.truncate(torch.tensor([len(prompt)]))
    return statistics.median(times[1:])  # the first call of a shape pays one-time set-up


def flips(lm, prompt: list[int], k: int, steps: int) -> tuple[int, int, float]:
    """(positions, greedy flips, max |logit difference|) of k-token blocks against one-token steps over the
    text greedy plain decoding writes after ``prompt``."""
    lm.reset(0)
    lm.add_rows([prompt[:-1]])
    text = [prompt[-1]]
    singles = []
    for _ in range(steps + k):
        logits = lm.forward(torch.tensor([[text[-1]]]))[0, 0]
        lm.commit_all()
        singles.append(logits)
        text.append(int(logits.argmax()))
    positions = flipped = 0
    largest = 0.0
    for start in range(0, steps, k):
        lm.reset(0)
        lm.add_rows([prompt[:-1] + text[:start]])
        logits = lm.forward(torch.tensor([text[start:start + k]]))[0]
        for j in range(k):
            reference = singles[start + j]
            positions += 1
            flipped += int(logits[j].argmax() != reference.argmax())
            largest = max(largest, float((logits[j] - reference).abs().max()))
    return positions, flipped, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--repack", action="store_true",
                        help="let llama.cpp repack the weights for its CPU kernels (LlamaCppLM(repack=True))")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args()
    lm = genspec.load_model(None, backend="llamacpp", max_rows=1)
    if args.threads or args.repack:
        from genspec.models.llamacpp import LlamaCppLM

        path, tokenizer = lm.path, lm.tokenizer
        del lm  # one copy of the weights at a time
        lm = LlamaCppLM(path, tokenizer, max_rows=1, threads=args.threads, repack=args.repack)
    # prompts genspec bench does not measure
    prompts = [p for p in load_spec_bench() if p.question_id % 10 == 3][:args.prompts]
    ids = [encode_prompt(p.text, lm.tokenizer) for p in prompts]
    curve = {}
    for k in (1, 2, 3, 4, 5, 6, 8, 12, 16):
        every = statistics.median(block_cost(lm, p, k, False, args.repeats) for p in ids)
        last = statistics.median(block_cost(lm, p, k, True, args.repeats) for p in ids)
        curve[k] = {"all_logits_ms": every, "last_logits_ms": last}
        print(f"k={k:2d}: logits at every position {every:6.1f} ms, at the last only {last:6.1f} ms", flush=True)
    numerics = {}
    for k in (2, 4, 8):
        counted = [flips(lm, p, k, 64) for p in ids]
        positions = sum(c[0] for c in counted)
        flipped = sum(c[1] for c in counted)
        largest = max(c[2] for c in counted)
        numerics[k] = {"positions": positions, "greedy_flips": flipped, "max_abs_logit_difference": largest}
        print(f"k={k}: {flipped} greedy flips in {positions} positions, max |logit difference| {largest:.2e}",
              flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"verify_cost_ms": curve, "block_vs_single_steps": numerics}, handle, indent=1)


if __name__ == "__main__":
    main()
