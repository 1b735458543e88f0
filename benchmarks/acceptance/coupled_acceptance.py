"""What the coupled rule costs in acceptance, on the embedded model's own laws.

The coupled rule (genspec.acceptance.coupled_tokens) makes a seeded request reproducible whatever its
draft lengths, but keeps a draft token with probability P(the two coupled draws agree) instead of the
standard rule's 1 - TV(draft, target). This script measures both on real (draft, target) laws of Gemma 3
270M: the target's laws at the last 60 positions of 6 Spec-Bench prompts (the 4th of 6 categories,
truncated to their last 200 tokens), T = 1, against two drafts made from the target (its int8 copy, its
first 12 of 18 layers). Agreement is estimated by Monte Carlo (4,000 shared noise draws per position,
on the union of each law's top-512 tokens). It also reports the inverse-CDF coupling (one shared uniform,
tokens in vocabulary order), computed exactly, and the time to draw one position's noise.

    python benchmarks/acceptance/coupled_acceptance.py
"""
from __future__ import annotations

import time

import torch

from genspec.acceptance import coupled_tokens
from genspec.api import load_model
from genspec.bench.prompts import load_spec_bench
from genspec.models.variants import early_exit, quantized
from genspec.randomness import RequestRandomness

POSITIONS = 60
DRAWS = 4000


def laws(model, ids: list[int]) -> torch.Tensor:
    model.reset(1)
    tokens = torch.tensor([ids])
    return torch.softmax(model.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))[0].double(), -1)[-POSITIONS:]


def main() -> None:
    torch.manual_seed(0)
    target = load_model()
    prompts = load_spec_bench(per_category=5)[3::5][:6]
    drafts = {"int8 copy": quantized(target), "first 12 layers": early_exit(target, 12)}
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in drafts}
    for prompt in prompts:
        ids = target.tokenizer(prompt.text)["input_ids"][-200:]
        target_probs = laws(target, ids)
        for name, model in drafts.items():
            draft_probs = laws(model, ids)
            tv = 0.5 * (draft_probs - target_probs).abs().sum(-1)
            upper_draft, upper_target = draft_probs.cumsum(-1), target_probs.cumsum(-1)
            overlap = (torch.minimum(upper_draft, upper_target)
                       - torch.maximum(upper_draft - draft_probs, upper_target - target_probs)).clamp(min=0)
            agree = []
            for i in range(len(target_probs)):
                support = torch.unique(torch.cat([draft_probs[i].topk(512).indices, target_probs[i].topk(512).indices]))
                race = torch.empty(DRAWS, len(support), dtype=torch.float64).exponential_()
                agree.append((coupled_tokens(draft_probs[i, support].expand(DRAWS, -1), race)
                              == coupled_tokens(target_probs[i, support].expand(DRAWS, -1), race)).double().mean())
            rows[name].append(torch.stack([1 - tv, torch.stack(agree), overlap.sum(-1)], -1))
    print(f"Gemma 3 270M, T = 1, {len(prompts)} prompts x {POSITIONS} positions; acceptance per draft token:")
    print(f"{'draft':<18} {'positions':>9} {'standard 1-TV':>14} {'coupled':>8} {'inverse-CDF':>12}")
    for name, parts in rows.items():
        table = torch.cat(parts)
        print(f"{name:<18} {len(table):>9} {table[:, 0].mean():>14.3f} {table[:, 1].mean():>8.3f} {table[:, 2].mean():>12.3f}")
    noise = RequestRandomness(0)
    started = time.perf_counter()
    for position in range(50):
        noise.race(position, target.vocab_size)
    print(f"noise of one position ({target.vocab_size} tokens): {(time.perf_counter() - started) / 50 * 1000:.1f} ms "
          f"(mean of 50)")


if __name__ == "__main__":
    main()
