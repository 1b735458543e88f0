"""Where a plain decoding step goes on the llama.cpp backend: inside ``llama_decode`` and outside it (the engine's
work: logits copy, NaN check, argmax, acceptance, bookkeeping), for genspec's plain decoding and for
llama-cpp-python's own ``Llama.generate`` on the same GGUF file, in one process, alternating.

    python benchmarks/costs/llamacpp_step_overhead.py [--rounds 3] [--temperature 0.7 --top-p 0.9]

Three prompts, 128 tokens each (EOS ignored), the first round a warm-up; medians over prompts and rounds of
milliseconds per token.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import llama_cpp
import llama_cpp._internals

import genspec

PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain why the sky is blue.",
           "def quicksort(arr):"]
TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args()
    decode = llama_cpp.llama_decode
    inside = {"seconds": 0.0, "calls": 0}

    def timed_decode(context, batch):
        started = time.perf_counter()
        status = decode(context, batch)
        inside["seconds"] += time.perf_counter() - started
        inside["calls"] += 1
        return status

    # both call the module's function: genspec through the module, llama-cpp-python through its _internals
    llama_cpp.llama_decode = llama_cpp._internals.llama_cpp.llama_decode = timed_decode
    engine = genspec.load(drafter="none", backend="llamacpp")
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    llama = llama_cpp.Llama(str(engine.target.path), n_ctx=4096, n_threads=len(os.sched_getaffinity(0)), verbose=False)
    greedy = args.temperature == 0

    def genspec_plain(ids):
        engine.generate_ids([ids], max_new_tokens=TOKENS, temperature=args.temperature, top_p=args.top_p, seed=0,
                            eos_token_ids=[])

    def llama_cpp_plain(ids):
        llama.set_seed(0)
        for i, _ in enumerate(llama.generate(ids, reset=True, temp=args.temperature, top_k=1 if greedy else 0,
                                             top_p=args.top_p, min_p=0.0)):
            if i + 1 >= TOKENS:
                break

    figures = {"genspec plain": [], "llama-cpp-python plain": []}
    for round_ in range(args.rounds + 1):
        for ids in prompts:
            for name, run in (("genspec plain", genspec_plain), ("llama-cpp-python plain", llama_cpp_plain)):
                inside.update(seconds=0.0, calls=0)
                started = time.perf_counter()
                run(ids)
                wall = time.perf_counter() - started
                if round_:
                    figures[name].append((wall / TOKENS, inside["seconds"] / TOKENS, (wall - inside["seconds"]) / TOKENS))
    print(f"T {args.temperature}, top-p {args.top_p}; ms per token, medians over {len(prompts)} prompts x {args.rounds} rounds")
    print("| decoding | per token | inside llama_decode | outside |")
    print("|---|---|---|---|")
    for name, rows in figures.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[i] for r in rows) * 1e3:.2f}" for i in range(3)) + " |")


if __name__ == "__main__":
    main()
