"""What the argmax over a 262,144-token vocabulary costs on this CPU: torch's against NumPy's
(:func:`genspec.kernels.most_likely`), for the logit shapes a verify step reads.

    python benchmarks/costs/argmax_cost.py [--repeats 200]

Median microseconds per call over ``--repeats`` calls, on random float32 logits ``[rows, width, 262144]``.
"""
from __future__ import annotations

import argparse

import torch
from timing import median_seconds

from genspec.kernels import most_likely

VOCAB = 262_144
SHAPES = [(1, 1), (1, 4), (1, 9), (4, 1), (4, 9)]



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median µs per call")
    print("| rows x width | torch.argmax | most_likely (NumPy) |")
    print("|---|---|---|")
    for rows, width in SHAPES:
        logits = torch.randn(rows, width, VOCAB)
        assert torch.equal(logits.argmax(-1), most_likely(logits))
        print(f"| {rows} x {width} | {median_seconds(lambda: logits.argmax(-1), args.repeats) * 1e6:.0f} "
              f"| {median_seconds(lambda: most_likely(logits), args.repeats) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
