"""A trained head's held-out acceptance through the engine, as `genspec train` measures it at the end.

    python benchmarks/heads/held_out_acceptance.py --sequences DIR/sequences.json --heads shipped,RUN_DIR [--out FILE]

The first 8 held-out prompts of a training run's sequences (their continuations were not trained on),
greedy, 64 new tokens, a chain of 5 draft tokens every step (``draft_length="fixed"``), 8 requests in one
batch: first-token acceptance, per-position acceptance (share of drafts whose token i was kept) and tokens
per target call. Re-measures heads whose run ended before the batched chain stopped dropping drafts
(commit b55d9f3: after the first request of the batch finished, the others drafted nothing).
"""
import argparse
import json

import genspec
from genspec.drafters.registry import DRAFTERS
from genspec.train.data import Sequences, held_out_acceptance

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sequences", required=True, help="a training run's sequences.json")
parser.add_argument("--heads", default="shipped", help="comma-separated head directories ('shipped': the package's)")
parser.add_argument("--out", help="also write the figures here (JSON)")
args = parser.parse_args()

target = genspec.load_model(None, backend="torch")
prompts = Sequences.load(args.sequences).held_out_prompts()[:8]
figures = {}
for name in args.heads.split(","):
    drafter = DRAFTERS["head"].for_target(target, path=None if name == "shipped" else name, tree_nodes=0)
    figures[name] = measured = held_out_acceptance(target, drafter, prompts)
    print(f"{name}: first draft token {measured['first_token_acceptance']:.3f}, per position "
          + " ".join(f"{a:.2f}" for a in measured["acceptance_per_position"])
          + f"; {measured['mean_accepted_length']:.2f} tokens per target call")
if args.out:
    with open(args.out, "w") as f:
        json.dump(figures, f, indent=1)
