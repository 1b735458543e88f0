"""Early exit with and without KV reuse on the embedded model: the verify pass either takes the draft's
first L layers (keys, values, exit hidden states) and runs only layers L.., or recomputes every layer.

    python benchmarks/costs/early_exit_kv_reuse.py

Fixed k = 4 (so both variants draft the same tokens), greedy, 64 new tokens, the first Spec-Bench prompt of
two categories; prints speedup vs plain decoding in the same process, acceptance, mean accepted length,
and draft / verify seconds. Outputs are checked equal to plain decoding.
"""
from __future__ import annotations

import time

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.drafters import DraftModelDrafter
from genspec.engine import SpeculativeEngine
from genspec.models import variants


def run(engine, ids, **options):
    started = time.perf_counter()
    result = engine.generate_ids([ids], max_new_tokens=64, **options)[0]
    return time.perf_counter() - started, result


def main() -> None:
    engine = genspec.load(drafter="none", backend="torch")
    target = engine.target
    prompts = [encode_prompt(p.text, engine.tokenizer) for p in load_spec_bench(["summarization", "writing"], 1)]
    run(engine, prompts[0])  # warm-up
    for ids in prompts:
        plain_time, plain = run(engine, ids)
        print(f"plain {plain_time:.2f} s")
        for exit_layer in (4, 8):
            model = variants.early_exit(target, exit_layer)
            for reuse in (True, False):
                speculative = SpeculativeEngine(target, DraftModelDrafter(model, reuse_layers=reuse))
                seconds, result = run(speculative, ids, num_draft_tokens=4, draft_length="fixed")
                assert result.token_ids == plain.token_ids
                stats = result.stats
                print(f"exit layer {exit_layer}, reuse {reuse}: {plain_time / seconds:.2f}x plain, acceptance "
                      f"{stats.acceptance_rate:.2f}, mean accepted {stats.mean_accepted_length:.2f}, draft "
                      f"{stats.draft_time_s:.2f} s, verify {stats.verify_time_s:.2f} s", flush=True)


if __name__ == "__main__":
    main()
