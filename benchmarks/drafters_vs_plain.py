"""Tokens/s and speedup of genspec's drafters vs plain decoding, greedy, on Spec-Bench prompts.

    python benchmarks/drafters_vs_plain.py --categories summarization,qa --num-prompts 3 \
        --max-new-tokens 128 --out benchmarks/results/drafters_vs_plain.json

Default target: the embedded Gemma 3 270M (fp32, CPU). All methods run in one process on the same
prompts; see genspec/bench/runner.py for how timing is kept fair.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import transformers

import genspec
from genspec.bench.prompts import CATEGORIES, load_spec_bench
from genspec.bench.runner import Method, markdown_table, run_methods, summarize
from genspec.engine import GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="target model directory (default: embedded)")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=8)
    parser.add_argument("--out", help="write raw runs and the summary as JSON here")
    args = parser.parse_args()

    target = genspec.load_model(args.model)
    methods = [Method("plain", None),
               Method("prompt-lookup", lambda t: genspec.build_drafter("prompt-lookup", t))]
    prompts = load_spec_bench(args.categories.split(","), args.num_prompts)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens)
    runs = run_methods(target, methods, prompts, config, on_progress=lambda s: print(s, flush=True))
    rows = summarize(runs, baseline="plain")
    print(markdown_table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        "torch": torch.__version__, "transformers": transformers.__version__},
            "settings": vars(args), "summary": rows, "runs": [vars(r) for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
