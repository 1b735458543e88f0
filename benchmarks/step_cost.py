"""What one decode / verify step costs on this machine, and which exact kernel layout is fastest.

    python benchmarks/step_cost.py --out benchmarks/results/step_cost.json

On the embedded Gemma 3 270M (fp32): (a) the LM head (262,144 x 640) alone for n rows with
F.linear, one big ``x @ W.T`` (contiguous copy) and genspec's blocked transposed layout;
(b) a whole step of n new tokens after a 200-token context with stock ``nn.Linear`` layers vs
genspec's transposed ones (each with its best head). Medians over repeats, after warm-up.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from genspec.models.default import default_model_dir
from genspec.models.hf import HFCausalLM, _transposed_blocks

ROWS = (1, 2, 4, 8, 16)


def median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def head_table(weight: torch.Tensor, repeats: int) -> dict:
    transposed = weight.t().contiguous()
    blocks = _transposed_blocks(weight)
    table = {}
    for n in ROWS:
        x = torch.randn(n, weight.shape[1])
        reference = F.linear(x, weight)
        blocked = torch.cat([x @ b for b in blocks], dim=-1)
        table[n] = {
            "F.linear": median_ms(lambda: F.linear(x, weight), repeats),
            "x @ W_t": median_ms(lambda: x @ transposed, repeats),
            "blocked x @ W_t": median_ms(lambda: torch.cat([x @ b for b in blocks], dim=-1), repeats),
            "max_abs_diff_blocked": float((blocked - reference).abs().max()),
            "argmax_agrees": bool(torch.equal(blocked.argmax(-1), reference.argmax(-1))),
        }
    return table


def step_table(model: HFCausalLM, repeats: int, context: int = 200) -> dict:
    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    model.reset(1)
    model.forward(ids, last_only=True)
    model.commit_all()
    table = {}
    for n in ROWS:
        block = torch.randint(100, 20000, (1, n))

        def step():
            model.forward(block)
            model.keep_block(torch.full((1, n), -1))  # roll back: the context stays 200 tokens

        table[n] = median_ms(step, repeats)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", help="write the tables as JSON here")
    args = parser.parse_args()
    path = default_model_dir()
    stock = HFCausalLM.from_pretrained(path, fast_kernels=False)
    heads = head_table(stock.model.get_output_embeddings().weight.detach(), args.repeats)
    stock_steps = step_table(stock, args.repeats)
    del stock
    fast_steps = step_table(HFCausalLM.from_pretrained(path), args.repeats)

    print(f"LM head, ms (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print("| rows | F.linear | x @ W_t | blocked x @ W_t | argmax agrees |\n|---|---|---|---|---|")
    for n, r in heads.items():
        print(f"| {n} | {r['F.linear']:.1f} | {r['x @ W_t']:.1f} | {r['blocked x @ W_t']:.1f} | {r['argmax_agrees']} |")
    print("\nWhole step of n tokens after 200 tokens of context, ms")
    print("| n | stock (nn.Linear, F.linear head) | genspec (transposed) | ratio to n=1 (genspec) |\n|---|---|---|---|")
    for n in ROWS:
        print(f"| {n} | {stock_steps[n]:.1f} | {fast_steps[n]:.1f} | {fast_steps[n] / fast_steps[1]:.2f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        "torch": torch.__version__},
            "head_ms": heads, "step_ms_stock": stock_steps, "step_ms_genspec": fast_steps}, indent=1))


if __name__ == "__main__":
    main()
