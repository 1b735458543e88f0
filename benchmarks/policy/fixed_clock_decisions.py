"""The cost policy's draft-length decisions under a fixed, made-up clock, to compare two versions of genspec.

The ``cost`` policy plans from measured times, so two runs of ``genspec bench`` draft differently whenever
the machine's speed drifts between them, and a difference in speedup can be the clock's, not the code's.
Here the clock stands still except in the target's forward pass, which advances it by 50 ms + 4 ms per
block token (row x width): every run makes the decisions its code makes for those costs, whatever the
machine does. Run it with each version on the path and compare the lines:

    PYTHONPATH=CHECKOUT python benchmarks/policy/fixed_clock_decisions.py [--drafter prompt-lookup]

Prints, per prompt (the first Spec-Bench prompt of four categories, greedy, 64 tokens, embedded model on
the torch backend): drafted and accepted tokens, target calls, and the first generated token ids. A
diagnostic only: the clock is replaced for this process (``time.perf_counter``) and the target's
``forward`` is wrapped; genspec itself never measures this way.
"""
from __future__ import annotations

import argparse
import json
import time

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench

CATEGORIES = ["writing", "math", "extraction", "summarization"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="prompt-lookup")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    now = [0.0]
    time.perf_counter = lambda: now[0]
    engine = genspec.load(drafter=args.drafter, backend="torch")
    forward = engine.target.forward

    def timed_forward(tokens, *rest, **options):
        now[0] += 0.050 + 0.004 * tokens.shape[0] * tokens.shape[1]
        return forward(tokens, *rest, **options)

    engine.target.forward = timed_forward
    for prompt in load_spec_bench(CATEGORIES, per_category=1):
        result = engine.generate_ids([encode_prompt(prompt.text, engine.tokenizer)], max_new_tokens=args.max_new_tokens)[0]
        print(json.dumps({"category": prompt.category, "drafted": result.stats.drafted_tokens,
                          "accepted": result.stats.accepted_tokens, "target_calls": result.stats.target_calls,
                          "first_tokens": result.token_ids[:5]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
