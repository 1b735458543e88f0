"""Where speculation switches itself off under load: the batch draft-length plan on this machine's costs.

Measures the embedded model's verify costs by rows x block width as ``genspec serve`` does at start
(:func:`genspec.calibration.measure_verify_costs`), then asks :func:`genspec.draft_length.plan` what
each row of a batch of B equal requests should draft, for requests whose drafts are accepted at a given
rate (first token ``a``, each later one ``0.9`` once the previous was: prompt lookup's shape on
Spec-Bench, ``benchmarks/acceptance/lookup_match_acceptance.py``) and a free drafter proposing 8 tokens. Prints,
per acceptance rate, the draft length per batch size (0: that step is plain decoding) and the predicted
speedup over plain decoding at that batch size.

    python benchmarks/policy/switch_point.py [--batches 1,2,4,8,16] [--out benchmarks/results/policy/switch_point.md]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from genspec.draft_length import CostModel, DraftLength, RowPlan, plan


def predicted(first: float, later: float, batch: int, costs: CostModel) -> tuple[int, float]:
    policy = DraftLength("cost", k_max=8, cost_model=costs, prior_alpha=first, prior_later=later, prior_weight=1e6)
    lengths = plan([RowPlan(policy, cap=8) for _ in range(batch)], costs)
    k = lengths[0]
    return k, policy.expected_tokens(k) / costs.relative(1 + k, batch)  # per row: tokens per plain step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--out", help="also write the table (markdown) here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    import genspec
    from genspec.calibration import measure_verify_costs

    target = genspec.load_model(backend="torch")
    costs = CostModel()
    measure_verify_costs(target, costs, batches=batches, progress=lambda text: print(text, flush=True))
    widths = (1, 2, 3, 5, 9)
    lines = ["Verify cost (ms) by rows x block width:", "",
             "| rows | " + " | ".join(f"width {w}" for w in widths) + " |", "|---|" + "---|" * len(widths)]
    for batch in batches:
        lines.append(f"| {batch} | " + " | ".join(f"{1e3 * costs.verify_cost(w, batch):.0f}" for w in widths) + " |")
    lines += ["", "Draft length the plan gives each row (predicted speedup over plain decoding at that batch size):",
              "", "| first-token acceptance | " + " | ".join(f"{b} rows" for b in batches) + " |",
              "|---|" + "---|" * len(batches)]
    for first in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        cells = []
        for batch in batches:
            k, speedup = predicted(first, 0.9, batch, costs)
            cells.append(f"k={k} ({speedup:.2f}x)" if k else "off")
        lines.append(f"| {first:.1f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
