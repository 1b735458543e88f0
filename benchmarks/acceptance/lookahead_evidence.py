"""What lookahead's drafts achieve by the evidence behind them (the grades the draft-length policy prices
apart): per grade, the steps, tokens drafted and kept per step, how often the first drafted token was kept,
the verify block's width and the target's time per step, for the pool alone (``window=0``) and with the Jacobi window.

    python benchmarks/acceptance/lookahead_evidence.py --skip-prompts 2 --num-prompts 1 --max-new-tokens 128

``--skip-prompts N`` takes each category's prompts after the first N (those ``genspec bench`` does not
measure); greedy decoding on the torch backend, the cost policy choosing each draft's length.
"""
from __future__ import annotations

import argparse
import collections

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.engine import GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--categories", default=None, help="comma-separated (default: all 13)")
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--skip-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--windows", default="0,4", help="window sizes to run, comma-separated")
    args = parser.parse_args()
    categories = args.categories.split(",") if args.categories else None
    prompts = load_spec_bench(categories, args.num_prompts, skip=args.skip_prompts)
    target = genspec.load_model(backend="torch")
    print(f"# {len(prompts)} prompts (each category's after the first {args.skip_prompts}), "
          f"{args.max_new_tokens} new tokens, greedy, embedded model on torch")
    for window in (int(w) for w in args.windows.split(",")):
        engine = genspec.SpeculativeEngine(target, genspec.build_drafter("lookahead", target, window=window),
                                           target.tokenizer)
        grades = collections.defaultdict(lambda: [0, 0, 0, 0, 0.0, 0, 0])
        calls = tokens = 0
        seconds = 0.0
        for prompt in prompts:
            request = engine.add_request(encode_prompt(prompt.text, target.tokenizer),
                                         GenerationConfig(max_new_tokens=args.max_new_tokens))
            while engine.has_unfinished():
                record = engine.step()
                seconds += record.total_time_s
                step = record.requests.get(request)
                if step is None or record.block_width == 0:  # the prefill
                    continue
                grade = grades[step.evidence]
                grade[0] += 1
                grade[1] += step.drafted
                grade[2] += step.accepted
                grade[3] += record.block_width
                grade[4] += record.target_time_s
                grade[5] += step.drafted > 0
                grade[6] += step.accepted > 0
                calls += 1
                tokens += len(step.new_tokens)
        print(f"\nwindow={window}: {calls} target calls, {tokens} tokens, {tokens / calls:.2f} tokens a call, "
              f"{tokens / seconds:.1f} tok/s")
        print("evidence          steps  drafted/step  kept/step  first kept  width  target ms/step")
        for evidence, (steps, drafted, kept, width, spent, tried, first) in sorted(grades.items(),
                                                                                  key=lambda g: str(g[0])):
            share = f"{first / tried:10.2f}" if tried else f"{'-':>10s}"
            print(f"{str(evidence):16s} {steps:6d}  {drafted / steps:12.2f}  {kept / steps:9.2f}  {share}  "
                  f"{width / steps:5.2f}  {1000 * spent / steps:14.1f}")


if __name__ == "__main__":
    main()
