"""What a draft head's truncated output layer costs per kernel: the target's own output rows for the
shipped head's 8,192-token vocabulary (and 4,096 / 16,384 rows), times one draft token (1 row), a
2-token sync, a tree level (3-16 rows) and a training batch (2,048 rows).

    python benchmarks/costs/subset_head_cost.py --out benchmarks/results/costs/subset_head_cost.txt

Columns: ``F.linear`` (what :meth:`genspec.models.hf.HFCausalLM.subset_head` ran until 2026-11-26), the
:class:`genspec.kernels.LMHead` kernels (``bmm`` over 1,024-column chunks of the transposed rows,
``W @ x.T`` with one row computed as two, oneDNN's GEMM over a packed copy, ``packed``, since
2026-11-27) and the one ``LMHead`` picks for that row count (what ``subset_head`` runs now). All are
exact fp32 products. Cells: median ms over the repeats, kernels alternated within each repeat.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from timing import median_seconds
from verify_width_cost import cpu_name  # benchmarks/ is on the path when run as a script

import genspec
from genspec.drafters.trained import load_for_target
from genspec.kernels import LMHead

ROWS = (1, 2, 3, 5, 16, 2048)


def median_ms(fn, repeats: int) -> float:
    return 1000 * median_seconds(fn, repeats, warmup=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per cell (20 for 2,048 rows)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = genspec.load_model(None, backend="torch")
    weight = target.model.get_output_embeddings().weight.detach()
    _, shipped = load_for_target(target, None, "head")
    extra = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(0))
    lines = [f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; median ms",
             f"{'rows':>6} {'vocab':>6} {'F.linear':>9} {'bmm':>7} {'W @ x.T':>8} {'packed':>7} {'LMHead':>7} (picks)"]
    for size in (4096, 8192, 16384):
        ids = torch.tensor(shipped) if size == len(shipped) else torch.unique(torch.cat([torch.tensor(shipped), extra]))[:size]
        rows_w = weight[ids].contiguous()
        head = LMHead(rows_w)
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1])
            repeats = max(5, args.repeats // 10) if rows > 100 else args.repeats
            calls = {"F.linear": lambda: torch.nn.functional.linear(x, rows_w),
                     "bmm": lambda: head.chunked(x), "W @ x.T": lambda: head.gemm(x), "packed": lambda: head.packed(x),
                     "LMHead": lambda: head(x)}
            for fn in calls.values():  # warm up
                fn()
            times = {name: [] for name in calls}
            for _ in range(repeats):
                for name, fn in calls.items():
                    times[name].append(median_ms(fn, 1))
            cells = " ".join(f"{statistics.median(times[n]):{w}.2f}" for n, w in zip(calls, (9, 7, 8, 7, 7)))
            lines.append(f"{rows:>6} {size:>6} {cells} ({head.kernel(rows)})")
            print(lines[-1], flush=True)
    report = "\n".join(lines)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
