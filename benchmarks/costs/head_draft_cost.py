"""What one draft step of a trained head costs on the embedded model, by the head's depth and its linear
kernels: the drafter's ``propose`` as the engine calls it at every decode step (two newly committed pairs
fed to the head's cache, then a chain of ``--tokens`` draft tokens through the target's 8,192 output
rows), after a ``--context``-token prompt, for heads of 1, 2, ... layers of the shipped head's shape, with
the stock ``nn.Linear`` layers (``fast_kernels=False``) and as :class:`genspec.models.hf.TransposedLinear`
(the default). A row also counts the calls whose drafts differ between the two kernels (summation order
only: expected none, or a rare near-tie).

    python benchmarks/costs/head_draft_cost.py --layers 1,2 --out benchmarks/results/costs/head_draft_cost.txt

Weights do not change the time: heads of more than one layer are random. The features handed over
are the target's own for the prompt and random ones after it (their values do not change the time
either). Cells: median ms per ``propose`` over ``--repeats`` calls, the depths alternated call by call.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from verify_width_cost import cpu_name  # benchmarks/ is on the path when run as a script

import genspec
from genspec.drafters.base import DraftRequest, RequestContext
from genspec.drafters.head import HeadDrafter
from genspec.drafters.trained import load_for_target
from genspec.speculators.head import DraftHead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,2", help="comma-separated head depths")
    parser.add_argument("--tokens", default="1,2", help="comma-separated draft lengths")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens before drafting starts")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = genspec.load_model(None, backend="torch")
    shipped, vocab = load_for_target(target, None, "head")
    depths = [int(x) for x in args.layers.split(",")]
    lengths = [int(x) for x in args.tokens.split(",")]
    heads = {d: shipped if d == 1 else DraftHead(replace(shipped.config, num_layers=d)) for d in depths}
    drafters = {(d, fast): HeadDrafter(target, heads[d], vocab, fast_kernels=fast) for d in depths for fast in (False, True)}
    prompt = torch.randint(10, 20000, (args.context,)).tolist()
    target.reset(0)
    [hidden] = target.add_rows([prompt[:-1]], return_hidden=True)
    target.reset(0)
    times = {(key, n): [] for key in drafters for n in lengths}
    differ = {d: 0 for d in depths}
    sequence = list(prompt)
    for drafter in drafters.values():
        drafter.start([RequestContext(0, prompt, hidden=hidden)])
    for call in range(args.repeats + 5):  # the first 5 warm up
        for n in lengths:
            sequence += [int(t) for t in torch.randint(10, 20000, (2,))]
            committed = torch.randn(2, hidden.shape[-1], dtype=hidden.dtype) * hidden.std()
            chains = {}
            for key, drafter in drafters.items():
                start = time.perf_counter()
                chains[key] = drafter.propose([DraftRequest(0, list(sequence), n, committed)]).first_chain(0)
                if call >= 5:
                    times[(key, n)].append(time.perf_counter() - start)
            for d in depths:
                differ[d] += chains[(d, False)] != chains[(d, True)]
    lines = [f"# head draft step cost, embedded model, {cpu_name()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; prompt {args.context} tokens, 2 committed pairs per call, "
             f"median ms of {args.repeats} calls",
             "| layers | linears | " + " | ".join(f"{n} draft token{'s' if n > 1 else ''}" for n in lengths)
             + " | calls with other drafts |",
             "|---|---|" + "---|" * (len(lengths) + 1)]
    for (d, fast) in drafters:
        cells = " | ".join(f"{statistics.median(times[((d, fast), n)]) * 1e3:.2f}" for n in lengths)
        kind = "TransposedLinear (default)" if fast else "nn.Linear"
        lines.append(f"| {d} | {kind} | {cells} | {differ[d] if fast else ''} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
