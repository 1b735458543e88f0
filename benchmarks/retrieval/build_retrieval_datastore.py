"""Build a retrieval datastore that is not the benchmark's prompts: the embedded model's own greedy
answers to *held-out* Spec-Bench prompts (each category's prompts after the first ``--skip``, which
are the ones `genspec bench --num-prompts N<=skip` measures). `benchmarks/retrieval/retrieval_bench.sh` adds
Python's standard library as a code document and runs the benchmark.

REST-style datastores are usually a large corpus of past model answers (UltraChat for chat) or code
(The Stack); this is the small local analogue. The answers are generated with prompt lookup (lossless,
greedy: the same text plain decoding gives).

    python benchmarks/retrieval/build_retrieval_datastore.py --skip 3 --per-category 5 --max-new-tokens 128 \
        --out benchmarks/retrieval/datastore/spec_bench_heldout.jsonl
    genspec index build benchmarks/retrieval/datastore/spec_bench_heldout.jsonl --out /tmp/heldout_index
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", type=int, default=3, help="prompts per category left for benchmarking")
    parser.add_argument("--per-category", type=int, default=6, help="held-out prompts answered per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True, help="JSONL file to write ({\"text\": ...} per answer)")
    args = parser.parse_args()

    from tqdm import tqdm

    import genspec
    from genspec.bench.prompts import CATEGORIES, encode_prompt, load_spec_bench

    prompts = load_spec_bench(list(CATEGORIES))
    held_out, seen = [], {}
    for prompt in prompts:
        seen[prompt.category] = seen.get(prompt.category, 0) + 1
        if args.skip < seen[prompt.category] <= args.skip + args.per_category:
            held_out.append(prompt)
    engine = genspec.load(drafter="prompt-lookup", backend="torch")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started, tokens = time.perf_counter(), 0
    with out.open("w", encoding="utf-8") as sink:
        for prompt in tqdm(held_out, desc="held-out answers", unit="prompt"):
            ids = encode_prompt(prompt.text, engine.tokenizer)
            result = engine.generate_ids([ids], max_new_tokens=args.max_new_tokens)[0]
            tokens += len(result.token_ids)
            sink.write(json.dumps({"question_id": prompt.question_id, "category": prompt.category,
                                   "text": engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)})
                       + "\n")
    print(f"{len(held_out)} answers, {tokens} tokens in {time.perf_counter() - started:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
