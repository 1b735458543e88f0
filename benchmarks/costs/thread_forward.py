"""Why ``genspec serve`` steps its engine in the main thread: the same forward pass timed in the thread
that loaded the model and in a second thread of the same process.

PyTorch's CPU kernels run on OpenMP (libgomp in the PyPI wheels); a thread team belongs to the thread
that starts it, so a second thread doing torch work gets a second team, and with more OpenMP threads
than cores libgomp's workers stop spin-waiting between the thousands of short parallel regions of a
decode step. The last line loads a fresh copy and runs it in another thread: as slow, because the main
thread's team is still there; what matters is that one thread does all the torch work.

    python benchmarks/costs/thread_forward.py [--rows 4] [--context 300]

Prints the median time of the embedded model's forward over ``rows`` rows x 1 token.
"""
from __future__ import annotations

import argparse
import threading
import time

import torch


def forward_ms(target, rows: int, context: int, repeats: int = 25) -> float:
    generator = torch.Generator().manual_seed(0)
    target.reset(0)
    target.add_rows([torch.randint(3, 30_000, (context,), generator=generator).tolist() for _ in range(rows)])
    times = []
    for _ in range(repeats):
        block = torch.randint(3, 30_000, (rows, 1), generator=generator)
        started = time.perf_counter()
        target.forward(block)
        times.append(time.perf_counter() - started)
        target.keep_block(torch.zeros(rows, 1, dtype=torch.long))
    target.reset(0)
    return 1e3 * sorted(times)[len(times) // 2]


def in_thread(function, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(function(*args)))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    import genspec

    target = genspec.load_model(backend="torch")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} rows x 1 token after "
          f"{args.context} tokens, median of 25")
    print(f"main thread (loaded the model):     {forward_ms(target, args.rows, args.context):6.1f} ms")
    print(f"second thread:                      {in_thread(forward_ms, target, args.rows, args.context):6.1f} ms")
    print(f"main thread again:                  {forward_ms(target, args.rows, args.context):6.1f} ms")
    del target
    print(f"one other thread loads and runs it: "
          f"{in_thread(lambda: forward_ms(genspec.load_model(backend='torch'), args.rows, args.context)):6.1f} ms")


if __name__ == "__main__":
    main()
