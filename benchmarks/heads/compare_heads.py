"""Two trained heads through the engine on the same held-out prompts (those a training run held out).

    python benchmarks/heads/compare_heads.py --run DIR [--other PATH] [--prompts 24]

``DIR`` is a ``genspec train head`` output directory: its held-out prompts (``sequences.json``) are the
ones measured, with ``genspec.train.data.held_out_acceptance`` (greedy, 64 tokens, 5 draft tokens at a
fixed length: the figure ``genspec train`` prints, here on more prompts), for the head in ``DIR`` and the
one at ``--other`` (default: the head shipped in the package). The other head may have trained on some
of those prompts (another run's split), which favours it: a new head that wins anyway wins.
"""
from __future__ import annotations

import argparse
import json

import torch

import genspec
from genspec.drafters.registry import DRAFTERS
from genspec.train.data import SEQUENCES, Sequences, held_out_acceptance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, metavar="DIR", help="a genspec train head output directory")
    parser.add_argument("--other", metavar="PATH", help="the head to compare with (default: the shipped head)")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts measured (the first N)")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = genspec.load_model(None, backend="torch")
    prompts = Sequences.load(f"{args.run}/{SEQUENCES}").held_out_prompts()
    print(f"# {len(prompts)} held-out prompts in {args.run}; measuring the first {args.prompts}", flush=True)
    for name, path in (("other" if args.other else "shipped", args.other), ("run", args.run)):
        measured = held_out_acceptance(target, DRAFTERS["head"].for_target(target, path=path), prompts[:args.prompts])
        print(f"{name:8s} first token {measured['first_token_acceptance']:.3f}, per position "
              + " ".join(f"{a:.3f}" for a in measured["acceptance_per_position"])
              + f", {measured['mean_accepted_length']:.3f} tokens per target call", flush=True)
        print(json.dumps({name: measured}), flush=True)


if __name__ == "__main__":
    main()
