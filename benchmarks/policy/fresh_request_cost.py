"""What one request costs a new user, per drafter: a fresh engine per request, as `genspec generate` has.

`genspec bench` keeps one engine per method for the whole run, so after its first requests the draft
length policy knows what the drafter achieves (the acceptance memory, the measured verify costs). A new
user who runs `genspec generate --drafter layer-skip` once has none of that: the request pays for its own
probing. This script decodes each prompt with plain decoding and with each drafter, every call on a new
engine over the same loaded target (loading and drafter building are not timed; one plain generation
warms the target first), interleaved per prompt, and prints per drafter and answer length the speed
relative to plain decoding: per prompt and their mean. With ``--repeats R`` each cell alternates plain and
drafter R times and compares medians (one sample per cell moved by up to 20% on the 2-core VM: a rag
request with nothing drafted measured 0.80x once and 0.96-1.14x in three more).

Prompts: each Spec-Bench category's 3rd prompt (``genspec bench`` measures the 1st and 2nd). Greedy,
cost policy, k = 8, the embedded model.

    python benchmarks/policy/fresh_request_cost.py --drafters early-exit,layer-skip,quantized,prompt-lookup \
        --lengths 32,128 --out benchmarks/results/policy/fresh_request_cost.md
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.engine import GenerationConfig, SpeculativeEngine


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def timed_request(target, drafter, ids: list[int], config: GenerationConfig) -> tuple[float, int, int]:
    """(seconds, drafted tokens, accepted tokens) of one request on a new engine."""
    engine = SpeculativeEngine(target, drafter, target.tokenizer)
    start = time.perf_counter()
    stats = engine.generate_ids([ids], config)[0].stats
    return time.perf_counter() - start, stats.drafted_tokens, stats.accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafters", default="early-exit,layer-skip,prompt-lookup")
    parser.add_argument("--lengths", default="32,128")
    parser.add_argument("--categories", default=None, help="comma-separated (default: all 13)")
    parser.add_argument("--repeats", type=int, default=3, help="plain / drafter alternations per cell (medians)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    drafter_names = [d for d in args.drafters.split(",") if d]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    categories = args.categories.split(",") if args.categories else None

    target = genspec.load_model(None, backend="torch")
    prompts = load_spec_bench(categories, per_category=1, skip=2)
    encoded = [(p, encode_prompt(p.text, target.tokenizer)) for p in prompts]
    drafters = {name: genspec.build_drafter(name, target) for name in drafter_names}
    timed_request(target, None, encoded[0][1], GenerationConfig(max_new_tokens=8))  # warm the target
    ratios: dict[tuple[str, int], list[float]] = {}
    lines = [f"# {_cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads; a new engine per "
             f"request; greedy, cost policy, k = 8; each category's 3rd Spec-Bench prompt; median of {args.repeats} "
             f"alternations per cell", "",
             "| prompt | tokens | drafter | plain s | drafter s | speed vs plain | drafted | accepted |",
             "|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        config = GenerationConfig(max_new_tokens=length, num_draft_tokens=8, draft_length="cost")
        for prompt, ids in encoded:
            for name, drafter in drafters.items():
                plains, runs = [], []
                for _ in range(args.repeats):
                    plains.append(timed_request(target, None, ids, config)[0])
                    runs.append(timed_request(target, drafter, ids, config))
                plain = statistics.median(plains)
                seconds = statistics.median(r[0] for r in runs)
                drafted, accepted = runs[-1][1], runs[-1][2]
                ratios.setdefault((name, length), []).append(plain / seconds)
                lines.append(f"| {prompt.category} #{prompt.question_id} | {length} | {name} | {plain:.2f} | "
                             f"{seconds:.2f} | {plain / seconds:.2f}x | {drafted} | {accepted} |")
                print(lines[-1], flush=True)
    lines += ["", "| drafter | tokens | mean speed vs plain | lowest | prompts |", "|---|---|---|---|---|"]
    for (name, length), values in ratios.items():
        lines.append(f"| {name} | {length} | {statistics.mean(values):.2f}x | {min(values):.2f}x | {len(values)} |")
    report = "\n".join(lines)
    print("\n".join(lines[-len(ratios) - 2:]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
