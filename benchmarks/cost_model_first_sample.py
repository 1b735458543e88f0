"""Does one slow verify timing switch drafting off for the rest of an engine's life?

Each ``genspec bench`` method (and ``genspec serve``) keeps one engine, whose cost model keeps measured
verify times by block width across requests. This script decodes a Spec-Bench writing prompt (few
matches) and then the extraction prompt (many) on one engine per drafter, prints what was drafted and the
verify times the cost model holds, then decodes the extraction prompt on a fresh engine for comparison.
Greedy, 32 tokens, cost policy, the embedded model. Timings vary run to run: the effect needs a slow
first sample of a wide block (see README, "Short answers").

    python benchmarks/cost_model_first_sample.py
"""
from __future__ import annotations

import torch

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.engine import GenerationConfig, SpeculativeEngine


def main() -> None:
    target = genspec.load_model(None)
    writing = encode_prompt(load_spec_bench(["writing"], per_category=1)[0].text, target.tokenizer)
    extraction = encode_prompt(load_spec_bench(["extraction"], per_category=1)[0].text, target.tokenizer)
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=8)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in ("suffix", "prompt-lookup"):
        drafter = genspec.build_drafter(name, target)
        engine = SpeculativeEngine(target, drafter, target.tokenizer)
        for label, ids in (("writing", writing), ("extraction", extraction)):
            stats = engine.generate_ids([ids], config)[0].stats
            costs = ", ".join(f"w{w} {s * 1000:.0f} ms" for (b, w), s in sorted(engine.costs.verify.items()) if b == 1)
            print(f"{name:14s} {label:11s} drafted {stats.drafted_tokens:3d}  verify costs held: {costs}")
        fresh = SpeculativeEngine(target, drafter, target.tokenizer).generate_ids([extraction], config)[0].stats
        print(f"{name:14s} extraction on a fresh engine: drafted {fresh.drafted_tokens}")


if __name__ == "__main__":
    main()
