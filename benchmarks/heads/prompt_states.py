"""How many of the prompt's states the shipped head needs: its acceptance with the last N prompt states.

The head (``--drafter head``) keeps a cache of (target feature, next token) pairs; ``prompt_states`` says how many of
the prompt's last features it reads when a request joins (on the llamacpp backend each costs an output-layer row).
This drafts fixed chains of ``-k`` tokens (greedy, no first-token threshold, so every step drafts) on one Spec-Bench
prompt per category that neither ``genspec bench`` nor its held-out run measures (``--skip 4``) and prints, per
setting, the share of drafted tokens kept and the wall time of the whole run.

    python benchmarks/heads/prompt_states.py [--backend llamacpp|torch] [--states all,64,16,4,1] [--skip 4]
"""
from __future__ import annotations

import argparse
import time

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.engine import SpeculativeEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="llamacpp", choices=("llamacpp", "torch"))
    parser.add_argument("--states", default="all,64,16,4,1", help="comma-separated prompt_states ('all': every one)")
    parser.add_argument("--skip", type=int, default=4, help="leave out each category's first N prompts (default 4)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    parser.add_argument("-k", type=int, default=3, help="draft tokens per step (default 3)")
    args = parser.parse_args()
    target = genspec.load_model(None, backend=args.backend)
    prompts = [encode_prompt(p.text, target.tokenizer) for p in load_spec_bench(None, 1, args.skip)]
    print(f"{args.backend}: {len(prompts)} prompts, {sum(map(len, prompts)) / len(prompts):.1f} tokens on average, "
          f"chains of {args.k}, {args.tokens} new tokens")
    for setting in args.states.split(","):
        states = None if setting == "all" else int(setting)
        drafter = genspec.build_drafter("head", target, tree_nodes=0, first_threshold=0.0, prompt_states=states)
        engine = SpeculativeEngine(target, drafter)
        kept = drafted = 0
        started = time.perf_counter()
        for prompt in prompts:
            result = engine.generate_ids([prompt], max_new_tokens=args.tokens, num_draft_tokens=args.k,
                                         draft_length="fixed")[0]
            kept, drafted = kept + result.stats.accepted_tokens, drafted + result.stats.drafted_tokens
        print(f"prompt_states={setting:>4}: kept {kept / drafted:.3f} of {drafted} drafted tokens, "
              f"{time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
