"""What the draft-length plan does with a full batch on the llama.cpp backend: ``--rows`` requests kept running
(a finished one replaced by the next held-out prompt), the engine's verify costs calibrated first as
``genspec serve`` does; then the steps that drafted and those that did not, their times and tokens, the cost
model's shapes at the end, and the draft lengths the plan chose most often.

    python benchmarks/costs/full_batch_plan.py [--rows 16] [--steps 200] [--drafter prompt-lookup]

Greedy, EOS ignored, 128 tokens per request; the first 10 steps are not counted. With ``--drafter none`` it
times plain steps only (their target-pass percentiles), to compare two versions of the code run in turn.
"""
from __future__ import annotations

import argparse
import statistics
from collections import Counter

import genspec
from genspec.bench.prompts import load_spec_bench
from genspec.calibration import calibrate_engine, served_batches
from genspec.engine import GenerationConfig


def summary(records: list, name: str) -> None:
    if not records:
        print(f"{name}: none")
        return
    seconds = sum(r.total_time_s - r.prefill_time_s for r in records)
    tokens = sum(len(s.new_tokens) for r in records for s in r.requests.values())
    drafted = sum(s.drafted for r in records for s in r.requests.values())
    print(f"{name}: {len(records)} steps, target pass {1e3 * statistics.mean(r.target_time_s for r in records):.0f} ms, "
          f"step without prefill {1e3 * seconds / len(records):.0f} ms, tokens/step {tokens / len(records):.1f}, "
          f"drafted/step {drafted / len(records):.1f}, tok/s without prefill {tokens / seconds:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--drafter", default="prompt-lookup")
    args = parser.parse_args()
    engine = genspec.load(drafter=args.drafter, max_batch_size=args.rows, backend="llamacpp", measure_costs=False)
    calibrate_engine(engine, batches=served_batches(args.rows))
    prompts = [engine.tokenizer.encode(f"Question: {p.text}\nAnswer:") for p in load_spec_bench(skip=2, per_category=6)]
    queue = iter([p for p in prompts if len(p) < 1500] * 5)
    config = GenerationConfig(max_new_tokens=128, eos_token_ids=())
    for _ in range(args.rows):
        engine.add_request(next(queue), config)
    records = []
    for _ in range(args.steps):
        record = engine.step()
        records.append(record)
        for _ in range(sum(s.finish_reason is not None for s in record.requests.values())):
            engine.add_request(next(queue), config)
    full = [r for r in records[10:] if r.batch_size == args.rows]
    plain = [r for r in full if not any(s.drafted for s in r.requests.values())]
    summary(plain, "plain steps")
    summary([r for r in full if any(s.drafted for s in r.requests.values())], "drafting steps")
    times = sorted(1e3 * r.target_time_s for r in plain)
    if times:
        print("plain target pass ms, percentiles 10 / 50 / 90 / max:",
              [round(times[int(q * (len(times) - 1))]) for q in (0.1, 0.5, 0.9, 1.0)])
    print("split factor:", engine.costs.split_factor)
    for batch in sorted({b for b, _ in engine.costs.verify}):
        print(f"{batch} rows, ms by width:", {w: round(1e3 * engine.costs.verify_cost(w, batch))
                                             for (b, w) in sorted(engine.costs.verify) if b == batch})
    print("draft lengths chosen:", Counter(tuple(sorted((s.drafted for s in r.requests.values() if s.drafted),
                                                         reverse=True)) for r in full).most_common(8))


if __name__ == "__main__":
    main()
