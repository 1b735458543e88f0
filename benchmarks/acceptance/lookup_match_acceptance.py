"""How often a prompt-lookup draft is right, by the length n of the n-gram it matched (the evidence the
cost-aware draft length learns from). Fixed k = 8 so every proposal is verified.

    python benchmarks/acceptance/lookup_match_acceptance.py --categories coding,stem,rag,humanities,writing,qa \
        --num-prompts 2 --max-new-tokens 48

``--skip-prompts N`` takes each category's prompts after the first N (those ``genspec bench`` does not
measure), ``--temperature`` samples (top-p 0.9).

Prints, per n, the number of verified drafts, the mean accepted length and how often the first token
was accepted.
"""
from __future__ import annotations

import argparse
import collections

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--categories", default="coding,stem,rag,humanities,writing,qa")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--skip-prompts", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    engine = genspec.load(drafter="prompt-lookup", backend="torch")
    stats = collections.defaultdict(lambda: [0, 0, 0])  # n -> drafts, accepted, hits
    sampled = {"temperature": args.temperature, "top_p": 0.9, "seed": 0} if args.temperature > 0 else {}
    for prompt in load_spec_bench(args.categories.split(","), args.num_prompts, skip=args.skip_prompts):
        engine.add_request(encode_prompt(prompt.text, engine.tokenizer), max_new_tokens=args.max_new_tokens,
                           draft_length="fixed", num_draft_tokens=8, **sampled)
        while engine.has_unfinished():  # each step's record says what was drafted, on what evidence, kept
            for step in engine.step().requests.values():
                if step.evidence and step.drafted:
                    entry = stats[step.evidence]
                    entry[0] += 1
                    entry[1] += step.accepted
                    entry[2] += int(step.accepted > 0)
    for n, (drafts, accepted, hits) in sorted(stats.items()):
        print(f"n = {n}: {drafts} drafts, mean accepted {accepted / drafts:.2f}, first token right {hits / drafts:.2f}")


if __name__ == "__main__":
    main()
