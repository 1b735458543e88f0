"""Where a loaded ``genspec serve`` spends its CPU: py-spy samples the server process while closed-loop clients
send a fixed number of held-out requests (the prompts of ``serve_load.py --held-out``), and each sample is put
in one part: the engine's prefill (``add_rows``' ``llama_decode``), its verify decodes (every other
``llama_decode``), the engine's Python around them, and the server around the engine (HTTP, SSE, tokeniser).
Samples of a thread waiting on a lock or in the event loop's select are counted apart, so the parts are shares
of the CPU time the server's Python threads used (llama.cpp's own worker threads are not Python threads: the
engine thread's ``llama_decode`` stands for them). One JSON line; the server binds to loopback and stops with
the script:

    python benchmarks/costs/serve_profile.py --clients 16 --requests 52 -- --drafter none
    python benchmarks/costs/serve_profile.py --clients 1 --requests 13 -- --drafter none --kernels exact-tiled

``--rate 0`` runs the same clients without sampling (the throughput alone): with ``PYTHONPATH`` pointing at
another checkout's tree, the server runs that code, which compares two commits on one load.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
import serve_load  # noqa: E402

from genspec.bench.llama_server import free_port  # noqa: E402
from genspec.bench.prompts import load_spec_bench, round_robin  # noqa: E402

PARTS = ("prefill decode", "verify decode", "engine python", "server")
#: innermost frames of a thread that waits (a lock, or the event loop in its C select): py-spy's --nonblocking
#: samples cannot tell them from running, so they are counted apart and left out of the shares
WAITING = ("Condition.wait (", "Runner.run (", "Event.wait (", "Thread.join (")


def part(stack: str) -> str:
    """The part of the server a sampled stack (py-spy's frames, outermost first, joined by ';') belongs to."""
    if stack.rpartition(";")[2].startswith(WAITING):
        return "waiting"
    if "LlamaCppLM._decode" in stack:
        return "prefill decode" if "LlamaCppLM.add_rows" in stack else "verify decode"
    return "engine python" if "genspec/serve/worker.py" in stack else "server"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=52)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip", type=int, default=0, help="held-out prompts to pass over first (another slice)")
    ap.add_argument("--rate", type=int, default=100,
                    help="py-spy samples per second (0: no sampling, the throughput alone)")
    ap.add_argument("--frames", type=int, default=0,
                    help="also list the N genspec frames the engine's own Python was sampled in most")
    ap.add_argument("flags", nargs="*", help="genspec serve's flags, after --")
    a = ap.parse_args()
    prompts = round_robin(load_spec_bench(skip=2))[a.skip:a.skip + a.requests]
    settings = types.SimpleNamespace(max_batch_size=16, kernels="exact", model=None, levels=[a.clients])
    port = free_port()
    server = serve_load.start_server(tuple(a.flags), port, settings)
    url = f"http://127.0.0.1:{port}"
    try:
        serve_load.run_level(url, prompts[:1], 1, 1, 16, {})  # warm-up, not sampled
        with tempfile.TemporaryDirectory() as folder:
            raw = Path(folder) / "samples.txt"
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.pid), "--format", "raw", "--rate",
                                    str(a.rate), "--nonblocking", "--output", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if a.rate else None
            result = serve_load.run_level(url, prompts, a.clients, a.requests, a.max_tokens, {})
            if spy is not None:
                spy.send_signal(2)  # py-spy writes its samples on SIGINT
                spy.wait(timeout=60)
            counts, frames = Counter(), Counter()
            for line in raw.read_text().splitlines() if spy is not None else ():
                stack, _, count = line.rpartition(" ")
                where = part(stack)
                counts[where] += int(count)
                if where == "engine python":
                    frames[[f for f in stack.split(";") if "genspec/" in f][-1]] += int(count)
    finally:
        serve_load.stop_servers([server])
    out = {"flags": a.flags, "clients": a.clients, "requests": a.requests,
           "tokens_per_s": round(result["tokens_per_s"], 1), "failed": result["failed"]}
    if a.rate:
        total = sum(counts[p] for p in PARTS) or 1
        out |= {"samples": total, "waiting samples": counts["waiting"],
                "share": {p: round(counts[p] / total, 3) for p in PARTS},
                **({"engine python frames": dict(frames.most_common(a.frames))} if a.frames else {})}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
