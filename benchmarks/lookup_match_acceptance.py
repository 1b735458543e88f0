"""How often a prompt-lookup draft is right, by the length n of the n-gram it matched (the evidence the
cost-aware draft length learns from). Fixed k = 8 so every proposal is verified.

    python benchmarks/lookup_match_acceptance.py --categories coding,stem,rag,humanities,writing,qa \
        --num-prompts 2 --max-new-tokens 48

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
    args = parser.parse_args()

    engine = genspec.load(drafter="prompt-lookup")
    drafter, stats = engine.drafter, collections.defaultdict(lambda: [0, 0, 0])  # n -> drafts, accepted, hits
    propose, feedback = drafter.propose, drafter.feedback
    last = {}

    def recording_propose(sequences, max_tokens):
        draft = propose(sequences, max_tokens)
        last["n"] = draft.evidence[0]
        return draft

    def recording_feedback(accepted):
        if last.get("n"):
            entry = stats[last["n"]]
            entry[0] += 1
            entry[1] += accepted[0]
            entry[2] += int(accepted[0] > 0)
        feedback(accepted)

    drafter.propose, drafter.feedback = recording_propose, recording_feedback
    for prompt in load_spec_bench(args.categories.split(","), args.num_prompts):
        engine.generate_ids([encode_prompt(prompt.text, engine.tokenizer)], max_new_tokens=args.max_new_tokens,
                            draft_length="fixed", num_draft_tokens=8)
    for n, (drafts, accepted, hits) in sorted(stats.items()):
        print(f"n = {n}: {drafts} drafts, mean accepted {accepted / drafts:.2f}, first token right {hits / drafts:.2f}")


if __name__ == "__main__":
    main()
