"""Does a fresh engine, calibrated as ``genspec serve`` calibrates it, start drafting? Several fresh engines in
turn, each generating the held-out prompts ``serve_load.py --held-out`` sends at one client, one after the other
(the first slice of Spec-Bench's prompts that ``genspec bench`` does not measure, round robin over the
categories), greedy, 128 tokens, EOS ends an answer: per engine, its one-row verify costs, the tokens it drafted
and kept in each request, and its throughput.

    python benchmarks/policy/fresh_engine_drafting.py [--trials 3] [--requests 13]

A draft-length plan that stops drafting after a request's first failures and never starts again shows as an
engine whose later requests draft nothing while the other engines' draft most of their tokens.
"""
from __future__ import annotations

import argparse
import time

import genspec
from genspec.bench.prompts import load_spec_bench, round_robin
from genspec.calibration import calibrate_engine


def held_out(count: int) -> list[str]:
    return round_robin(load_spec_bench(skip=2))[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--requests", type=int, default=13)
    parser.add_argument("--drafter", default="prompt-lookup")
    args = parser.parse_args()
    prompts = held_out(args.requests)
    for trial in range(args.trials):
        engine = genspec.load(drafter=args.drafter, max_batch_size=16, backend="llamacpp", measure_costs=False)
        calibrate_engine(engine, batches=(1, 2, 4, 8, 16))
        costs = {w: round(1e3 * engine.costs.verify_cost(w, 1), 1) for w in range(1, 10)}
        engine.generate(prompts[0][:200], max_new_tokens=16)  # warm-up, as serve_load.py's
        drafted, accepted, tokens, started = [], 0, 0, time.perf_counter()
        for prompt in prompts:
            result = engine.generate(f"Question: {prompt}\nAnswer:", max_new_tokens=128, temperature=0)[0]
            drafted.append(result.stats.drafted_tokens)
            accepted += result.stats.accepted_tokens
            tokens += len(result.token_ids)
        rate = tokens / (time.perf_counter() - started)
        print(f"engine {trial}: one-row verify ms by width {costs}; drafted {sum(drafted)} (per request {drafted}), "
              f"kept {accepted}; {rate:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
