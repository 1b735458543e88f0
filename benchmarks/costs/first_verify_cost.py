"""What a fresh engine's first verify blocks of each width cost: the target's time per step
(``StepRecord.target_time_s``) by block width, in order, for one sampled request with the shipped head
on the embedded model. The first call of a width pays one-time costs (the output layer's kernels are
picked and its packed weight copy made at first use: :mod:`genspec.kernels`), which the cost model
must not take for the width's price.

    python benchmarks/costs/first_verify_cost.py   # log: benchmarks/results/costs/first_verify_cost.txt
"""
from __future__ import annotations

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.drafters.head import HeadDrafter


def main() -> None:
    target = genspec.load_model(None, backend="torch")
    engine = SpeculativeEngine(target, HeadDrafter.for_target(target))
    prompt = [p for p in load_spec_bench() if p.category == "qa"][2]  # a prompt genspec bench does not measure
    engine.add_request(encode_prompt(prompt.text, target.tokenizer),
                       GenerationConfig(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=0))
    by_width: dict[int, list[float]] = {}
    while engine.has_unfinished():
        record = engine.step()
        if record.block_width:
            by_width.setdefault(record.block_width, []).append(record.target_time_s * 1000)
    for width, times in sorted(by_width.items()):
        print(f"width {width}: {len(times)} calls, ms in order: {' '.join(f'{t:.0f}' for t in times)}")


if __name__ == "__main__":
    main()
