"""What a distilled draft's step costs by its network and the context's length: the drafter's ``propose`` as the
engine calls it at every decode step (the draft model reads the token the target added, then drafts ``--tokens``
tokens), after a prompt of each ``--contexts`` length, for the transformer draft (2 Llama layers of width 256,
``genspec train draft``'s default) and GRU and LSTM drafts of the same width and depth (``--arch gru|lstm``), all
over the embedded model's vocabulary sizes (an 8,192-token draft vocabulary, 262,144 target tokens). A second
table: reading a prompt of each length (a request's first draft).

    python benchmarks/costs/recurrent_draft_cost.py --threads 1 --clock cpu \
        --out benchmarks/results/costs/recurrent_draft_cost.txt

Weights do not change the time: the drafts are random. Greedy, one request. Cells: median ms per ``propose`` over
``--repeats`` calls, the networks alternated call by call; the prompt's reading: median of 3. ``--clock cpu``: the
process's CPU time instead of wall time, with ``--threads 1`` what a call costs on a machine others load (there a
2-thread kernel waits for whichever of its threads was descheduled, and wall times mean little).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from verify_width_cost import cpu_name  # benchmarks/ is on the path when run as a script

from genspec.drafters.base import DraftRequest
from genspec.drafters.draft_model import DraftModelDrafter
from genspec.speculators.distilled import DraftConfig
from genspec.speculators.recurrent import draft_network

#: the embedded model's vocabulary, its hidden size, and the draft vocabulary genspec train picks by default
FULL_VOCAB, HIDDEN, DRAFT_VOCAB = 262_144, 640, 8192


def drafter(arch: str) -> DraftModelDrafter:
    torch.manual_seed(0)
    config = DraftConfig(HIDDEN, DRAFT_VOCAB + 1, max_positions=32_768, arch=arch)
    return DraftModelDrafter(draft_network(config).eval().as_model(list(range(DRAFT_VOCAB)), FULL_VOCAB))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="128,1024,4096", help="comma-separated prompt lengths")
    parser.add_argument("--tokens", type=int, default=1, help="draft tokens per propose")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--out", type=Path, help="also write the tables here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    archs = ("transformer", "gru", "lstm")
    contexts = [int(c) for c in args.contexts.split(",")]
    generator = torch.Generator().manual_seed(0)
    steps: dict[tuple[str, int], list[float]] = {}
    reads: dict[tuple[str, int], list[float]] = {}
    for context in contexts:
        prompt = torch.randint(0, DRAFT_VOCAB, (context,), generator=generator).tolist()
        drafters = {arch: drafter(arch) for arch in archs}
        sequences = {arch: list(prompt) for arch in archs}
        for arch, d in drafters.items():
            for _ in range(3):  # the prompt's reading: a fresh row each time
                d.finish([0])
                start = clock()
                d.propose([DraftRequest(0, sequences[arch], args.tokens)])
                reads.setdefault((arch, context), []).append(clock() - start)
        for _ in range(args.repeats):
            for arch, d in drafters.items():
                # the target kept the draft and added a token: the next propose reads that one, then drafts
                start = clock()
                draft = d.propose([DraftRequest(0, sequences[arch], args.tokens)])
                steps.setdefault((arch, context), []).append(clock() - start)
                sequences[arch] += draft.first_chain(0) + [int(torch.randint(0, DRAFT_VOCAB, (1,), generator=generator))]

    def table(title: str, cells: dict) -> list[str]:
        lines = [title, f"{'context':>8} " + " ".join(f"{arch:>12}" for arch in archs)]
        for context in contexts:
            lines.append(f"{context:>8} " + " ".join(f"{statistics.median(cells[arch, context]) * 1e3:>12.2f}"
                                                     for arch in archs))
        return lines

    lines = [f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; median ms of "
             f"{'CPU' if args.clock == 'cpu' else 'wall'} time",
             *table(f"propose ({args.tokens} draft token(s)) after the context, {args.repeats} calls:", steps),
             *table("reading the context (a request's first draft), 3 calls:", reads)]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
