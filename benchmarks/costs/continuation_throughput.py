"""How fast the target writes training data (its own greedy continuations), by batch size.

    python benchmarks/costs/continuation_throughput.py --batch-sizes 16,32,64 --prompts 64 --max-new-tokens 128

`genspec train` spends most of its data time here (the target continuing Spec-Bench prompts the benchmark
never measures, shortest first, ``max_prompt_tokens`` at most): this measures generated tokens per second
of wall time, plain decoding (no drafter) and with prompt lookup, on the same prompts at each batch size.
"""
from __future__ import annotations

import argparse
import time

import torch

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.cli.train import BENCH_PROMPTS_EXCLUDED
from genspec.engine import SpeculativeEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="16,32,64")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--drafters", default="none,prompt-lookup")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = genspec.load_model(None, backend="torch")
    measured = {q.question_id for q in load_spec_bench(per_category=BENCH_PROMPTS_EXCLUDED)}
    prompts = [encode_prompt(p.text, target.tokenizer) for p in load_spec_bench() if p.question_id not in measured]
    prompts = sorted((p for p in prompts if len(p) <= args.max_prompt_tokens), key=len)
    # every size-th prompt, so the sample spans the lengths training continues
    prompts = prompts[::max(1, len(prompts) // args.prompts)][:args.prompts]
    print(f"# {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{args.max_new_tokens} new tokens, torch threads {torch.get_num_threads()}")
    for name in args.drafters.split(","):
        drafter = None if name == "none" else genspec.build_drafter(name, target)
        for batch_size in map(int, args.batch_sizes.split(",")):
            engine = SpeculativeEngine(target, drafter, max_batch_size=batch_size)
            engine.generate_ids(prompts[:2], max_new_tokens=4, temperature=0.0)  # warm-up
            start, generated = time.perf_counter(), 0
            for i in range(0, len(prompts), batch_size):
                results = engine.generate_ids(prompts[i:i + batch_size], max_new_tokens=args.max_new_tokens,
                                              temperature=0.0)
                generated += sum(len(r.token_ids) for r in results)
            seconds = time.perf_counter() - start
            print(f"drafter {name:14s} batch {batch_size:3d}: {generated} tokens in {seconds:6.1f} s = "
                  f"{generated / seconds:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
