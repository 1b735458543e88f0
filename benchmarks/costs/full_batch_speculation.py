"""Does speculation pay in a full batch on the llama.cpp backend? Closed-loop rows on held-out prompts, the
engine's costs measured at start as ``genspec serve`` measures them, and from the engine's step records: the
throughput of the whole run, and at a full batch that of the steps that drafted against the steps that did not
(their prefills left out: a step that admits a request also prefills its prompt).

    python benchmarks/costs/full_batch_speculation.py [--rows 16] [--requests 48] [--drafters none,prompt-lookup]
        [--calibrate serve|load] [--ignore-eos]

``--calibrate load``: the costs ``genspec.load`` measures (one row's widths only), so that every batch size above
one is priced from them and from what the engine measures as it runs (``generate_ids`` over a batch of prompts).

Prompts: the last ``--requests`` of Spec-Bench's prompts that ``genspec bench`` does not measure, taken round
robin over the categories (as ``serve_load.py --held-out`` does), ``Question: ...\\nAnswer:``, greedy, 128
tokens, EOS ends a request; a finished request is replaced by the next prompt until they run out.
"""
from __future__ import annotations

import argparse
import time

import genspec
from genspec.bench.prompts import load_spec_bench, round_robin
from genspec.calibration import calibrate_engine, served_batches
from genspec.engine import GenerationConfig


def held_out(count: int) -> list[str]:
    return round_robin(load_spec_bench(skip=2))[-count:]


def run(engine, prompts: list[list[int]], rows: int, drafter: str, tokens: int, ignore_eos: bool) -> dict:
    config = GenerationConfig(max_new_tokens=tokens, drafter=drafter, eos_token_ids=() if ignore_eos else None)
    queue = iter(prompts)
    for prompt in [next(queue) for _ in range(min(rows, len(prompts)))]:
        engine.add_request(prompt, config)
    records, started = [], time.perf_counter()
    while engine.has_unfinished():
        record = engine.step()
        records.append(record)
        for _ in range(sum(s.finish_reason is not None for s in record.requests.values())):
            following = next(queue, None)
            if following is not None:
                engine.add_request(following, config)
    wall = time.perf_counter() - started

    def rate(steps) -> tuple[int, float]:
        made = sum(len(s.new_tokens) for r in steps for s in r.requests.values())
        seconds = sum(r.total_time_s - r.prefill_time_s for r in steps)
        return len(steps), made / seconds if seconds else 0.0

    full = [r for r in records if r.batch_size == rows]
    drafting = [r for r in full if any(s.drafted for s in r.requests.values())]
    plain = [r for r in full if not any(s.drafted for s in r.requests.values())]
    made = sum(len(s.new_tokens) for r in records for s in r.requests.values())
    return {"wall": wall, "tok_s": made / wall, "drafting": rate(drafting), "plain": rate(plain),
            "drafted": sum(s.drafted for r in records for s in r.requests.values()),
            "accepted": sum(s.accepted for r in records for s in r.requests.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--drafters", default="none,prompt-lookup")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calibrate", choices=("serve", "load"), default="serve")
    parser.add_argument("--ignore-eos", action="store_true")
    args = parser.parse_args()
    engine = genspec.load(drafter="prompt-lookup", max_batch_size=args.rows, backend="llamacpp",
                          measure_costs=args.calibrate == "load")
    if args.calibrate == "serve":
        calibrate_engine(engine, batches=served_batches(args.rows))
    prompts = [engine.tokenizer.encode(f"Question: {p}\nAnswer:") for p in held_out(args.requests)]
    print(f"| drafter | tok/s | drafted | accepted | {args.rows}-row steps that drafted | their tok/s | "
          f"{args.rows}-row steps that did not | their tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for drafter in args.drafters.split(","):
        out = run(engine, prompts, args.rows, drafter, args.tokens, args.ignore_eos)
        print(f"| {drafter} | {out['tok_s']:.1f} | {out['drafted']} | {out['accepted']} | {out['drafting'][0]} | "
              f"{out['drafting'][1]:.1f} | {out['plain'][0]} | {out['plain'][1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
