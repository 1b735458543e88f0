"""How often a layer-skip self-draft is right on each backend: the torch view of the embedded model without some
layers against the GGUF copy llama.cpp's quantiser writes without them (the copy should compute nearly the same
function, its sliding-window pattern included). Greedy, a fixed draft of ``--k`` tokens, so every draft is verified.

    python benchmarks/acceptance/self_draft_acceptance.py --skips "9,13;3,7,13" --skip-prompts 2 --num-prompts 1 \
        --max-new-tokens 64

``--skips``: skip lists separated by ``;``. Prompts: Spec-Bench's, each category's after the first
``--skip-prompts`` (held out from ``genspec bench``). Prints, per skip list and backend, the tokens drafted and
accepted and their ratio. Acceptance, not speed: the timings do not enter it.
"""
from __future__ import annotations

import argparse

import genspec
from genspec.bench.prompts import CATEGORIES, encode_prompt, load_spec_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skips", default="9,13;3,7,13")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--skip-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    prompts = load_spec_bench(args.categories.split(","), args.num_prompts, skip=args.skip_prompts)
    print(f"{len(prompts)} prompts (skip {args.skip_prompts} per category), greedy, k = {args.k} fixed, "
          f"{args.max_new_tokens} tokens\n")
    print("| skipped layers | backend | drafted | accepted | accepted / drafted |\n|---|---|---|---|---|")
    for skip in args.skips.split(";"):
        layers = [int(i) for i in skip.split(",")]
        for backend in ("torch", "llamacpp"):
            engine = genspec.load(drafter="layer-skip", backend=backend, measure_costs=False, skip=layers)
            ids = [encode_prompt(p.text, engine.tokenizer) for p in prompts]
            results = engine.generate_ids(ids, max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k,
                                          draft_length="fixed")
            drafted = sum(r.stats.drafted_tokens for r in results)
            accepted = sum(r.stats.accepted_tokens for r in results)
            print(f"| {skip} | {backend} | {drafted} | {accepted} | {accepted / max(drafted, 1):.3f} |", flush=True)


if __name__ == "__main__":
    main()
