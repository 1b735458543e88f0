"""What the target's first L layers over committed tokens cost a head with ``token_layers`` on this machine.

    python benchmarks/costs/layer_states_cost.py --layers 4,6 --out benchmarks/results/costs/layer_states_cost.txt
    python benchmarks/costs/layer_states_cost.py --layers 6 --attention-only   # the first 6 layers without their MLPs

:class:`genspec.drafters.layer_states.LayerStates` on the embedded model: one request, a 300-token prompt read
once, then 40 steps alternating one and two new tokens (what a step commits: the target's token, plus an
accepted draft token); medians in ms, and the prompt's reading by a fresh instance.
"""
import argparse
import time

import genspec
from genspec.drafters.layer_states import LayerStates

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--layers", default="4,6")
parser.add_argument("--out")
parser.add_argument("--attention-only", action="store_true",
                    help="the layers without their MLPs (head_inputs.attention_only; the layers' count must be <= 6)")
args = parser.parse_args()
target = genspec.load_model(None, backend="torch")
if args.attention_only:
    from head_inputs import attention_only

    target = attention_only(target, max(int(x) for x in args.layers.split(",")))
prompt = list(range(1000, 1300))
lines = []
for layers in [int(x) for x in args.layers.split(",")]:
    states = LayerStates(target, layers)
    states.read([0], [prompt])
    sequence = list(prompt)
    times = {1: [], 2: []}
    for step in range(40):
        n = 1 + step % 2
        sequence = sequence + [2000 + step, 3000 + step][:n]
        started = time.perf_counter()
        states.read([0], [sequence])
        times[n].append(time.perf_counter() - started)
    started = time.perf_counter()
    LayerStates(target, layers).read([1], [prompt])
    prefill = time.perf_counter() - started
    lines.append(f"L={layers}{' attention only' if args.attention_only else ''}: read 1 token {sorted(times[1])[10] * 1e3:.1f} ms, 2 tokens {sorted(times[2])[10] * 1e3:.1f} ms "
                 f"(medians of 20); a 300-token prompt {prefill * 1e3:.0f} ms")
    print(lines[-1], flush=True)
if args.out:
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
