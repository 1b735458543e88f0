"""What OpenMP's wait policy does to the llamacpp backend's one-token step on the embedded GGUF, alone and beside
a process that keeps one core busy (a server's other threads, a load generator, another job).

Each setting runs in a fresh process (OpenMP reads ``OMP_WAIT_POLICY`` when llama.cpp's libgomp loads):
``spin`` is OpenMP's default with the variable unset (genspec sets PASSIVE unless the user set it, so the run
sets ACTIVE), ``sleep`` is PASSIVE. Prints the median and 90th percentile of 40 steps after a 100-token prompt.

    python benchmarks/costs/llamacpp_wait_policy.py
"""
from __future__ import annotations

import os
import subprocess
import sys

STEP = """
import time, torch, genspec
lm = genspec.load_model(None, backend="llamacpp", max_rows=1)
lm.reset(0); lm.add_rows([list(range(1000, 1100))])
times = []
for _ in range(41):
    started = time.perf_counter(); lm.forward(torch.tensor([[2000]])); lm.commit_all()
    times.append((time.perf_counter() - started) * 1000)
times = sorted(times[1:])
print(f"{times[len(times) // 2]:.1f} {times[int(0.9 * len(times))]:.1f}")
"""
BUSY = "while True: pass"


def step_ms(policy: str) -> str:
    env = dict(os.environ, OMP_WAIT_POLICY=policy)
    out = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True, check=True).stdout
    median, p90 = out.split()[-2:]
    return f"median {median} ms, p90 {p90} ms"


def main() -> None:
    for busy in (False, True):
        competitor = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
        try:
            for name, policy in (("spin (ACTIVE)", "ACTIVE"), ("sleep (PASSIVE)", "PASSIVE")):
                where = "beside a busy core" if busy else "alone"
                print(f"{where:20s} {name:16s} {step_ms(policy)}", flush=True)
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()


if __name__ == "__main__":
    main()
