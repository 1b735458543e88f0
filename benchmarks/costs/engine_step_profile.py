"""Where an engine step's time goes on the llama.cpp backend, at several batch sizes, plain and speculative:
the target's pass (``StepRecord.target_time_s``: the batch filled, ``llama_decode``, the logits read) and
everything else the step does (drafting, acceptance, bookkeeping, emitting), from the records the engine
emits; and a cProfile of the same steps, its heaviest functions by own time.

    python benchmarks/costs/engine_step_profile.py [--rows 1,4,16] [--drafters none,prompt-lookup] [--steps 48]
        [--no-profile]

Each configuration: ``rows`` requests of ``--tokens`` tokens kept running on held-out prompts (``genspec bench``
measures none of them; a finished request is replaced by the next prompt, whose prefill joins a later step), EOS
ignored, greedy; means over the measured steps, in ms per step; "outside" is the step less the target's pass and
the prefills. The engine's verify costs are measured first for every batch size ``genspec serve`` measures
(:func:`genspec.calibration.calibrate_engine`), so its plans are a server's, not a cold engine's explorations.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics

import genspec
from genspec.bench.prompts import load_spec_bench
from genspec.calibration import calibrate_engine, served_batches
from genspec.engine import GenerationConfig


def run(engine, prompts: list[list[int]], rows: int, drafter: str, steps: int, warm: int,
        tokens: int, profiled: bool = True) -> tuple[list, pstats.Stats | None]:
    """``rows`` requests of ``tokens`` tokens kept running (one that finishes is replaced by the next prompt),
    ``warm`` steps unmeasured, then ``steps`` measured (and profiled if ``profiled``); their records."""
    config = GenerationConfig(max_new_tokens=tokens, drafter=drafter, eos_token_ids=())
    queue = iter(prompts * (1 + (rows + steps) // len(prompts)))
    for _ in range(rows):
        engine.add_request(next(queue), config)
    records, profile = [], cProfile.Profile()
    for i in range(warm + steps):
        if i >= warm and profiled:
            profile.enable()
        record = engine.step()
        if i >= warm:
            if profiled:
                profile.disable()
            records.append(record)
        for _ in range(sum(s.finish_reason is not None for s in record.requests.values())):
            engine.add_request(next(queue), config)
    while engine.has_unfinished():  # the rest, unmeasured
        for request in list(engine._running) + list(engine._waiting):
            engine.cancel(request.id)
        engine.step()
    return records, pstats.Stats(profile) if profiled else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--drafters", default="none,prompt-lookup")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--top", type=int, default=12, help="functions listed per configuration")
    parser.add_argument("--no-profile", action="store_true",
                        help="time the steps without cProfile (whose hooks add to every Python call's time)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    engine = genspec.load(drafter="prompt-lookup", max_batch_size=max(rows), backend="llamacpp", measure_costs=False)
    calibrate_engine(engine, batches=sorted(set(served_batches(max(rows))) | set(rows)))
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(f"Question: {p.text}\nAnswer:") for p in load_spec_bench(skip=2, per_category=2)]
    prompts = [p for p in prompts if len(p) < 1500]
    lines = ["| rows | drafter | step ms | target pass ms | prefill ms | outside ms | outside ms per row | "
             "tokens per step | tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    profiles = []
    for n in rows:
        for drafter in args.drafters.split(","):
            records, stats = run(engine, prompts, n, drafter, args.steps, args.warm, args.tokens, not args.no_profile)
            total = statistics.mean(r.total_time_s for r in records) * 1e3
            target = statistics.mean(r.target_time_s for r in records) * 1e3
            prefill = statistics.mean(r.prefill_time_s for r in records) * 1e3
            outside = statistics.mean(r.total_time_s - r.target_time_s - r.prefill_time_s for r in records) * 1e3
            tokens = statistics.mean(sum(len(s.new_tokens) for s in r.requests.values()) for r in records)
            lines.append(f"| {n} | {drafter} | {total:.1f} | {target:.1f} | {prefill:.1f} | {outside:.2f} | "
                         f"{outside / n:.2f} | {tokens:.1f} | {1e3 * tokens / total:.1f} |")
            print(lines[-1], flush=True)
            if stats is None:
                continue
            text = io.StringIO()
            stats.stream = text
            stats.sort_stats("tottime").print_stats(args.top)
            body = text.getvalue()
            profiles.append(f"### {n} rows, {drafter} ({len(records)} steps)\n\n```\n"
                            + body[body.index("ncalls"):].rstrip() + "\n```\n")
    print("\n".join(lines))
    print()
    print("\n".join(profiles))


if __name__ == "__main__":
    main()
