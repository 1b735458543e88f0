"""Acceptance per draft position of the model-free drafters when sampling: chains against candidate trees.

    python benchmarks/acceptance/sampling_acceptance.py --out benchmarks/results/acceptance/sampling_acceptance.json

At temperature > 0 a deterministic draft token y is kept with probability q(y) only (q: the target's
processed law), so a chain that greedy decoding accepts often is accepted much less when sampling. A tree
of several candidates verified together (each kept with its own residual, docs/theory.md's Algorithm 4) is kept
with probability sum_i q(y_i). This script measures both on the embedded Gemma 3 270M.

How: with deterministic drafts the engine verifies by the coupling "draw the target's token, keep the draft
iff equal" (genspec.randomness), so a seeded request produces exactly plain sampling's tokens whatever the
drafter, and a draft is accepted as far as it follows that trajectory. So each prompt is sampled once per
temperature with plain decoding (seed 0, top-p 0.9), and every drafter is replayed on that same trajectory
as the engine's step loop would run it (fixed draft length ``-k``, proposals clipped to the room left, the
next proposal after the accepted tokens and the target's token; requests one after the other, each
drafter's process memory emptied first, so ngram-cache and suffix learn from the earlier prompts only):
the same figures as the engine's statistics, paired across drafters, without a target pass per drafter.
``--check`` runs the engine itself on the first prompt for every drafter and temperature and fails if its
statistics differ from the replay's.

Prompts: Spec-Bench prompts that ``genspec bench`` does not measure (the ``--first``-th of each category on,
1-based; default the 6th). Acceptance does not depend on timing, so the shared CPU does not change it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import genspec
from genspec.bench.methods import LEARNING_DRAFTERS
from genspec.bench.prompts import CATEGORIES, encode_prompt, load_spec_bench
from genspec.drafters.base import DraftRequest, RequestContext
from genspec.drafters.ngram_cache import clear_process_tables
from genspec.drafters.suffix import clear_suffix_caches
from genspec.engine import GenerationConfig, SpeculativeEngine

#: label -> (drafter name, options)
METHODS = {
    "prompt-lookup chain": ("prompt-lookup", {}),
    "prompt-lookup tree (4 candidates)": ("prompt-lookup", {"num_candidates": 4}),
    "ngram-cache chain": ("ngram-cache", {}),
    "suffix chain": ("suffix", {"num_candidates": 1, "sampled_candidates": 1}),
    "suffix tree (2 leaves)": ("suffix", {"num_candidates": 2, "sampled_candidates": 2}),
    "suffix tree (4 leaves)": ("suffix", {"num_candidates": 4, "sampled_candidates": 4}),
    "suffix tree (8 leaves 24 nodes)": ("suffix", {"num_candidates": 8, "sampled_candidates": 8, "max_nodes": 24,
                                                   "min_prob": 0.05}),
}


def build(target, name: str, options: dict, namespace: str):
    """The drafter, with a process memory of its own if it has one."""
    extra = {"namespace": namespace} if name in LEARNING_DRAFTERS else {}
    return genspec.build_drafter(name, target, **options, **extra)


def replay(drafter, prompt: list[int], trajectory: list[int], k: int, max_new_tokens: int, sampling, request_id: int):
    """The engine's step loop for one request whose tokens are ``trajectory``: ``(accepted per position,
    drafted per position, target calls, draft nodes)``."""
    drafter.start([RequestContext(request_id, list(prompt), sampling)])
    accepted, drafted = [0] * k, [0] * k
    calls = nodes = t = 0
    while t < len(trajectory):
        room = min(k, max_new_tokens - t - 1)
        calls += 1
        if room <= 0:
            t += 1
            continue
        draft = drafter.propose([DraftRequest(request_id, list(prompt) + trajectory[:t], room)])
        chains = [draft.tokens[0, m, :int(draft.lengths[0, m])].tolist() for m in range(draft.num_chains)]
        chains = [c for c in chains if c]
        depth = max((len(c) for c in chains), default=0)
        kept = 0
        for chain in chains:  # the longest path of the tree along the trajectory
            n = 0
            while n < len(chain) and t + n < len(trajectory) and chain[n] == trajectory[t + n]:
                n += 1
            kept = max(kept, n)
        for i in range(depth):
            drafted[i] += 1
        for i in range(kept):
            accepted[i] += 1
        nodes += draft.drafted_tokens()[0]
        t += kept + 1
    drafter.finish([request_id])
    return accepted, drafted, calls, nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperatures", default="0.3,0.7,1.0")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--first", type=int, default=6, help="first prompt of each category used (1-based)")
    parser.add_argument("--num-prompts", type=int, default=1, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--methods", default=";".join(METHODS), help="labels of METHODS, separated by ';'")
    parser.add_argument("--check", action="store_true", help="compare with the engine on the first prompt")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    target = genspec.load_model(None, backend="torch")
    prompts = []
    for category in CATEGORIES:
        chosen = load_spec_bench([category], args.first - 1 + args.num_prompts)[args.first - 1:]
        prompts += [encode_prompt(p.text, target.tokenizer) for p in chosen]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    labels = args.methods.split(";")
    results, checks = [], []
    for temperature in temperatures:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=temperature,
                                  top_p=args.top_p if temperature > 0 else 1.0, seed=0)
        started = time.perf_counter()
        trajectories = [o.token_ids for o in SpeculativeEngine(target).generate_ids(prompts, config)]
        print(f"T = {temperature:g}: {len(prompts)} plain trajectories in {time.perf_counter() - started:.0f} s", flush=True)
        for label in labels:
            name, options = METHODS[label]
            clear_process_tables()
            clear_suffix_caches()
            drafter = build(target, name, options, f"sampling-study:{label}")
            accepted, drafted, calls, nodes = [0] * args.k, [0] * args.k, 0, 0
            for i, (prompt, trajectory) in enumerate(zip(prompts, trajectories)):
                a, d, c, n = replay(drafter, prompt, trajectory, args.k, args.max_new_tokens, config.sampling, i)
                accepted = [x + y for x, y in zip(accepted, a)]
                drafted = [x + y for x, y in zip(drafted, d)]
                calls, nodes = calls + c, nodes + n
            new = sum(len(t) for t in trajectories)
            row = {"method": label, "drafter": name, "options": options, "temperature": temperature,
                   "top_p": config.top_p, "drafts": drafted[0],
                   "acceptance_per_position": [round(a / d, 3) if d else None for a, d in zip(accepted, drafted)],
                   "accepted_per_position": accepted, "drafted_per_position": drafted,
                   "tokens_per_target_call": round(new / calls, 3), "draft_nodes_per_draft": round(nodes / max(drafted[0], 1), 2)}
            results.append(row)
            print(json.dumps(row), flush=True)
            if args.check:  # the engine itself on the first prompt, the same seed: the same statistics
                clear_process_tables()
                clear_suffix_caches()
                fresh = build(target, name, options, f"sampling-check:{label}")
                engine = SpeculativeEngine(target, fresh)
                out = engine.generate_ids(prompts[:1], GenerationConfig(
                    max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k, draft_length="fixed",
                    temperature=temperature, top_p=config.top_p, seed=0))[0]
                clear_suffix_caches()
                clear_process_tables()
                again = build(target, name, options, f"sampling-check-replay:{label}")
                a, d, _, _ = replay(again, prompts[0], trajectories[0], args.k, args.max_new_tokens, config.sampling, 0)
                same = (out.token_ids == trajectories[0] and list(out.stats.accepted_per_position) == a[:len(out.stats.accepted_per_position)]
                        and list(out.stats.drafted_per_position) == d[:len(out.stats.drafted_per_position)])
                checks.append({"method": label, "temperature": temperature, "engine_equals_replay": same})
                print(f"check {label} T = {temperature:g}: engine == replay: {same}", flush=True)
    print()
    print("| method | " + " | ".join(f"T = {t:g}" for t in temperatures) + " |")
    print("|---|" + "---|" * len(temperatures))
    for label in labels:
        cells = []
        for temperature in temperatures:
            row = next(r for r in results if r["method"] == label and r["temperature"] == temperature)
            positions = " / ".join("-" if a is None else f"{a:.2f}" for a in row["acceptance_per_position"])
            cells.append(f"{positions}<br>{row['tokens_per_target_call']:.2f} tok/call, {row['draft_nodes_per_draft']:.1f} nodes")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/acceptance/sampling_acceptance.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" if len(k) > 1 else f"-{k} {v}" for k, v in vars(args).items()
            if v not in (None, False) and k not in ("methods", "out", "check")) + (" --check" if args.check else "")
        args.out.write_text(json.dumps({"command": command, "num_prompts": len(prompts), "results": results,
                                        "checks": checks}, indent=1) + "\n")
    if not all(c["engine_equals_replay"] for c in checks):
        raise SystemExit("the engine's statistics differ from the replay's")


if __name__ == "__main__":
    main()
