"""How often a layer-skip or pruned self-draft, or a trained head, is right on each backend: the torch copy of the
embedded model without some layers (or cut by a ``genspec calibrate prune`` plan) against the GGUF copy genspec
writes for a llama.cpp target (the copy should compute nearly the same function, its sliding-window pattern
included); a head trained on the torch target's states drafting from the llama.cpp target's.
Greedy, a fixed draft of ``--k`` tokens, so every draft is verified.

    python benchmarks/acceptance/self_draft_acceptance.py --skips "9,13;3,7,13" --plans "prune-0.5.json" \
        --skip-prompts 2 --num-prompts 1 --max-new-tokens 64

``--skips``: skip lists separated by ``;``; ``--plans``: pruning plan files separated by ``;``; ``--drafters``:
other drafters, ``NAME[:KEY=INT...]`` (``head:tree_nodes=0``: the shipped head, a chain). Prompts:
Spec-Bench's, each category's after the first ``--skip-prompts`` (held out from ``genspec bench``). Prints, per
draft and backend, the tokens drafted and accepted and their ratio. Acceptance, not speed: the timings do not
enter it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import genspec
from genspec.bench.prompts import CATEGORIES, encode_prompt, load_spec_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skips", default="9,13;3,7,13")
    parser.add_argument("--plans", default="", help="pruning plans (genspec calibrate prune), separated by ';'")
    parser.add_argument("--drafters", default="", help="other drafters, NAME[:KEY=INT...] (the shipped head as a "
                                                        "chain: head:tree_nodes=0), separated by ';'")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--skip-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    prompts = load_spec_bench(args.categories.split(","), args.num_prompts, skip=args.skip_prompts)
    print(f"{len(prompts)} prompts (skip {args.skip_prompts} per category), greedy, k = {args.k} fixed, "
          f"{args.max_new_tokens} tokens\n")
    print("| draft | backend | drafted | accepted | accepted / drafted |\n|---|---|---|---|---|")
    drafts = [(f"layer-skip {skip}", "layer-skip", {"skip": [int(i) for i in skip.split(",")]})
              for skip in args.skips.split(";") if skip]
    drafts += [(f"pruned {Path(plan).name}", "pruned", {"path": plan}) for plan in args.plans.split(";") if plan]
    for spec in filter(None, args.drafters.split(";")):  # NAME[:KEY=INT...]
        name, *pairs = spec.split(":")
        drafts.append((spec, name, {key: int(value) for key, value in (pair.split("=") for pair in pairs)}))
    for label, drafter, options in drafts:
        for backend in ("torch", "llamacpp"):
            engine = genspec.load(drafter=drafter, backend=backend, measure_costs=False, **options)
            ids = [encode_prompt(p.text, engine.tokenizer) for p in prompts]
            results = engine.generate_ids(ids, max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k,
                                          draft_length="fixed")
            drafted = sum(r.stats.drafted_tokens for r in results)
            accepted = sum(r.stats.accepted_tokens for r in results)
            print(f"| {label} | {backend} | {drafted} | {accepted} | {accepted / max(drafted, 1):.3f} |", flush=True)


if __name__ == "__main__":
    main()
