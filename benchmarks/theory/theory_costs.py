"""Measured vs estimated cost of the theory toolkit's computations (genspec/theory/budget.py).

    python benchmarks/theory/theory_costs.py > benchmarks/results/theory/theory_costs.md

Each computation runs in a fresh Python process (one torch thread); its wall time and its peak resident
memory above the process's baseline after imports are set beside the estimates that ``genspec theory``
uses to refuse sizes above its limits. The per-unit rates in exact.py, simulate.py, chains.py and
leviathan.py were read off these rows; on a shared CPU they hold to a factor of about 3.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CASES = [
    ("random-chain V=300 T=50 (+ JSON)", "chain", dict(vocab=300, horizon=50)),
    ("exact batch V=7 T=50 M=1024", "exact", dict(vocab=7, horizon=50, batch=1024, variant="batch")),
    ("exact batch V=50 T=10 M=1024", "exact", dict(vocab=50, horizon=10, batch=1024, variant="batch")),
    ("exact multidraft V=7 T=50 M=256", "exact", dict(vocab=7, horizon=50, batch=256, variant="multidraft")),
    ("exact multidraft V=20 T=10 M=128", "exact", dict(vocab=20, horizon=10, batch=128, variant="multidraft")),
    ("simulate V=7 T=50 M=4 multidraft N=1e5", "simulate", dict(vocab=7, horizon=50, batch=4, variant="multidraft",
                                                                runs=100_000)),
    ("simulate V=100 T=20 M=1 N=1e5", "simulate", dict(vocab=100, horizon=20, batch=1, variant="batch", runs=100_000)),
    ("simulate V=100 T=5 M=64 multidraft N=2e4", "simulate", dict(vocab=100, horizon=5, batch=64, variant="multidraft",
                                                                  runs=20_000)),
    ("leviathan optimal gamma in 1..1e6", "leviathan", dict(max_gamma=1_000_000)),
    ("theory figures (defaults: V=7 T=50, 1e5 runs)", "figures", dict()),
]

CHILD = textwrap.dedent("""
    import json, resource, sys, tempfile, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from genspec.theory import exact, leviathan
    from genspec.theory.chains import chain_cost, random_chain, save_chain
    from genspec.theory.figures import FigureSettings, figures_cost, make_figures
    from genspec.theory.simulate import simulate, simulation_cost
    kind, a = sys.argv[1], json.loads(sys.argv[2])
    chain = random_chain(a["vocab"], a["horizon"], 0) if kind in ("exact", "simulate") else None
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "chain":
            estimate = chain_cost(a["vocab"], a["horizon"])
            save_chain(random_chain(a["vocab"], a["horizon"], 0), Path(tmp) / "pair.json")
        elif kind == "exact":
            estimate = exact.rejections_cost(a["vocab"], a["horizon"], a["batch"], a["variant"])
            exact.expected_rejections(chain, a["batch"], a["variant"])
        elif kind == "simulate":
            estimate = simulation_cost(a["vocab"], a["horizon"], a["runs"], a["batch"])
            simulate(chain, a["runs"], a["batch"], a["variant"])
        elif kind == "leviathan":
            estimate = leviathan.Cost(0.0, a["max_gamma"] * leviathan._SECONDS_PER_GAMMA)
            leviathan.optimal_gamma(0.8, 0.1, a["max_gamma"])
        else:
            settings = FigureSettings(Path(tmp))
            estimate = figures_cost(settings)
            make_figures(settings, show_progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    print(json.dumps([seconds, max(peak, 0), estimate.seconds, estimate.bytes]))
""")


def main() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("# Theory toolkit: measured vs estimated cost\n\n`python benchmarks/theory/theory_costs.py`, one process per "
          f"row, one torch thread, {os.cpu_count()}-core VM shared with other work.\n")
    print("| computation | seconds | estimated | peak memory above baseline (MB) | estimated (MB) |")
    print("|---|---|---|---|---|")
    for label, kind, arguments in CASES:
        out = subprocess.run([sys.executable, "-c", CHILD, kind, json.dumps(arguments)], env=env, check=True,
                             capture_output=True, text=True).stdout
        seconds, peak, estimated_seconds, estimated_bytes = json.loads(out.strip().splitlines()[-1])
        print(f"| {label} | {seconds:.1f} | {estimated_seconds:.1f} | {peak / 1e6:.0f} | {estimated_bytes / 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
