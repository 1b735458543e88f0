"""What asking llama.cpp for the final hidden states costs a one-token step: the embedded GGUF model, one row after a
``--prompt-tokens`` prompt, one-token steps with states off, on, and switched every step (as an engine whose head
drafts now and then asks for them), median ms per step over ``--steps`` steps, ``--rounds`` interleaved rounds.

    python benchmarks/costs/hidden_state_cost.py --steps 60 --rounds 2

With states on llama.cpp makes every token of a decode an output and copies its state out; a one-token step has
its one token an output anyway, so the difference is the copy of one state (640 floats on Gemma 3 270M).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from genspec.embedded import default_gguf_path
from genspec.models.llamacpp import LlamaCppLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    args = parser.parse_args()
    steps_in_all = args.steps * 3 * args.rounds  # each round times 3 modes
    lm = LlamaCppLM(default_gguf_path(), None, context=args.prompt_tokens + steps_in_all + 1, max_rows=1)
    lm.add_rows([list(range(1000, 1000 + args.prompt_tokens))])
    token = 1234

    def step_ms(states_at) -> float:
        nonlocal token
        times = []
        for i in range(args.steps):
            start = time.perf_counter()
            lm.forward(torch.tensor([[token]]), return_hidden=states_at(i))
            times.append(time.perf_counter() - start)
            lm.commit_all()
            token += 1
        return statistics.median(times) * 1e3

    modes = {"states off": lambda i: False, "states on": lambda i: True, "switched every step": lambda i: i % 2 == 1}
    print(f"embedded GGUF, 1 row after {args.prompt_tokens} prompt tokens, median ms per one-token step "
          f"({args.steps} steps per cell)\n")
    print("| round | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    for round_ in range(args.rounds):
        print(f"| {round_ + 1} | " + " | ".join(f"{step_ms(mode):.2f}" for mode in modes.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
