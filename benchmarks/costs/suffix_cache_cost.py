"""Time and memory of the suffix drafter's process-wide cache at 1 M tokens.

    python benchmarks/costs/suffix_cache_cost.py --tokens 1000000 --out benchmarks/results/costs/suffix_cache_cost.json

Tokenises the text the project ships (every Spec-Bench turn, genspec/data/spec_bench/question.jsonl, and the
embedded model's held-out answers, benchmarks/retrieval/datastore/spec_bench_heldout.jsonl) with the embedded model's
tokenizer, then fills a suffix cache capped at ``--tokens`` with those documents, cycled in a new random order
each pass until 1.5 x the cap has been added (so FIFO eviction runs for the last third), and reports:

- build: seconds per added document and in all, documents and tokens added, live tokens at the end;
- memory: the cache's arrays (``nbytes``) and what tracemalloc saw allocated while building (numpy reports
  its buffers to tracemalloc);
- proposals: ``--requests`` simulated requests (a shipped document's first half as the prompt, so most are
  in the cache: repeated traffic; the point is the time, not the acceptance; at each step the drafter
  proposes up to 8 tokens, then the document's next 1-4 tokens are committed, as if some were accepted),
  timed per ``propose`` call (the request's own cache and the 1 M-token one): percentiles; and the time
  of ``finish`` (the request's text added to the full cache).

Timings are wall-clock on whatever else the machine runs: say so when quoting them.
"""
from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc
from importlib import resources
from pathlib import Path

import numpy as np

from genspec.datastore import tokenize_documents
from genspec.drafters.base import DraftRequest, RequestContext
from genspec.drafters.suffix import SuffixDrafter, clear_suffix_caches


def shipped_documents() -> list[str]:
    texts = []
    for line in (resources.files("genspec") / "data" / "spec_bench" / "question.jsonl").read_text(encoding="utf-8").splitlines():
        texts.extend(json.loads(line)["turns"])
    heldout = Path(__file__).parent / "datastore" / "spec_bench_heldout.jsonl"
    texts.extend(json.loads(line)["text"] for line in heldout.read_text(encoding="utf-8").splitlines() if line.strip())
    return texts


def percentiles(values: list[float]) -> dict:
    array = np.asarray(values) * 1e3
    return {f"p{q}": round(float(np.percentile(array, q)), 3) for q in (50, 90, 99)} | {
        "max": round(float(array.max()), 3), "mean": round(float(array.mean()), 3), "count": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="the cache's cap in tokens")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from genspec.embedded import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    started = time.perf_counter()
    documents = [d for d in tokenize_documents(shipped_documents(), tokenizer) if len(d) >= 8]
    tokenise_s = time.perf_counter() - started
    shipped_tokens = sum(len(d) for d in documents)
    print(f"{len(documents)} shipped documents, {shipped_tokens:,} tokens (tokenised in {tokenise_s:.1f} s)")

    clear_suffix_caches()
    tracemalloc.start()
    drafter = SuffixDrafter(namespace="suffix-cache-cost", cache_tokens=args.tokens)
    cache = drafter.cache
    rng = random.Random(args.seed)
    added_docs = added_tokens = 0
    add_times = []
    order = []
    while added_tokens < 1.5 * args.tokens:
        if not order:
            order = list(range(len(documents)))
            rng.shuffle(order)
        document = documents[order.pop()]
        started = time.perf_counter()
        cache.add_document(document)
        add_times.append(time.perf_counter() - started)
        added_docs += 1
        added_tokens += len(document)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    build = {"documents_added": added_docs, "tokens_added": added_tokens, "live_tokens": len(cache),
             "cap": args.tokens, "documents_live": len(cache.documents), "seconds": round(sum(add_times), 2),
             "per_document_ms": percentiles(add_times)}
    memory = {"cache_arrays_mb": round(cache.nbytes() / 2 ** 20, 1),
              "tracemalloc_current_mb": round(current / 2 ** 20, 1), "tracemalloc_peak_mb": round(peak / 2 ** 20, 1)}
    print("build:", build)
    print("memory:", memory)

    propose_times, finish_times, drafted, first_right = [], [], 0, 0
    for request in range(args.requests):
        document = documents[rng.randrange(len(documents))]
        half = max(4, len(document) // 2)
        prompt, rest = document[:half], document[half:]
        drafter.start([RequestContext(request, list(prompt))])
        sequence, at = list(prompt), 0
        for _ in range(args.steps):
            if at >= len(rest):
                break
            started = time.perf_counter()
            draft = drafter.propose([DraftRequest(request, sequence, 8)])
            propose_times.append(time.perf_counter() - started)
            chain = draft.first_chain(0)
            if chain:
                drafted += 1
                first_right += int(chain[0] == rest[at])
            step = rng.randint(1, 4)
            sequence += rest[at:at + step]
            at += step
        started = time.perf_counter()
        drafter.finish([request])
        finish_times.append(time.perf_counter() - started)
    proposals = {"propose_ms": percentiles(propose_times), "finish_ms": percentiles(finish_times),
                 "proposals_with_a_draft": drafted, "first_token_right": round(first_right / max(drafted, 1), 3),
                 "live_tokens_after": len(cache)}
    print("proposals:", proposals)
    result = {"command": "python benchmarks/costs/suffix_cache_cost.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "shipped_documents": len(documents), "shipped_tokens": shipped_tokens, "build": build, "memory": memory,
        "proposals": proposals}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    clear_suffix_caches()


if __name__ == "__main__":
    main()
