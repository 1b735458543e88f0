"""Load test of ``genspec serve``: speculation on vs off at several concurrency levels, in one run.

``--backend local`` (default): two servers on loopback (127.0.0.1), the same model, one with speculation
(the default drafter) and one without (``--drafter none``). ``--backend ray --replicas 1,2``: for each
replica count in turn, one ``genspec serve --backend ray`` (its own local Ray instance, one at a time:
two Ray instances would share two cores), speculation turned off per request
(``"speculative": {"enabled": false}``) for the "off" runs. ``--versus-llamacpp-server`` adds
llama-cpp-python's own OpenAI server (``python -m llama_cpp.server``) on the same GGUF file as a third
server (genspec's servers then run that file on the llamacpp backend). Closed-loop clients (each sends its next request when the last one
finished) at each concurrency level, a fixed number of requests per level and server, streaming
completions of Spec-Bench prompts (the first two of each category, the ones ``genspec bench``
measures, framed as ``genspec bench`` frames them for a model without a chat template:
"Question: ...\nAnswer:"), greedy, 128 tokens. The levels alternate between the two servers (on, off, then off, on,
...) so that slow drifts of the machine hit both. The script stops by itself.

    python benchmarks/serving/serve_load.py --out benchmarks/results/serve_load
    python benchmarks/serving/serve_load.py --versus-llamacpp-server --concurrency 1,4,16 \
        --out benchmarks/results/serve_load_llamacpp
    python benchmarks/serving/serve_load.py --backend ray --replicas 1,2 --out benchmarks/results/serve_load_ray

Writes results.json (every request's timings), report.md (a table per setup) and throughput.png.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from genspec.bench.prompts import load_spec_bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LLAMACPP_SERVER = ("llama_cpp.server",)  # a mode's flags that start llama-cpp-python's own server instead


def start_server(flags: tuple[str, ...], port: int, args) -> subprocess.Popen:
    if flags == LLAMACPP_SERVER:
        # its defaults but the context (4,096: the longest prompt plus 128 tokens fits), the threads, which
        # genspec's llamacpp backend also sets to the machine's cores, and interrupt_requests: by default a new
        # request cuts the stream being served (19 of 20 requests failed at 4 clients); one Llama, requests
        # served one at a time
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_model(args)), "--host", "127.0.0.1",
                   "--port", str(port), "--n_ctx", "4096", "--n_threads", str(os.cpu_count()),
                   "--n_threads_batch", str(os.cpu_count()), "--interrupt_requests", "False",
                   "--verbose", "False"]
    else:
        command = [sys.executable, "-m", "genspec", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--max-batch-size", str(args.max_batch_size), "--max-queue", "256", *flags]
        if args.model:
            command += ["--model", args.model]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server ({' '.join(flags)}) exited: {process.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(1)
    process.kill()
    raise SystemExit(f"server ({' '.join(flags)}) did not start in 10 minutes")


def gguf_model(args) -> Path:
    """The GGUF file both servers run: ``--model`` if it is one, else the embedded model's."""
    if args.model and args.model.endswith(".gguf"):
        return Path(args.model)
    from genspec.embedded import default_gguf_path

    return default_gguf_path()


def stop_servers(processes) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def one_request(url: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    """A streaming completion; client-side timings."""
    body = {"prompt": f"Question: {prompt}\nAnswer:", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    started = time.perf_counter()
    first = None
    tokens = chunks = 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                return {"ok": False, "error": f"HTTP {response.status_code}", "latency_s": time.perf_counter() - started}
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"]["message"], "latency_s": time.perf_counter() - started}
                if first is None and (chunk.get("genspec", {}).get("tokens")
                                      or any(c.get("text") for c in chunk.get("choices", []))):
                    first = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices", [])):
                    chunks += 1
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "latency_s": time.perf_counter() - started}
    end = time.perf_counter()
    tokens = tokens or chunks  # llama-cpp-python's server streams one token per chunk and no usage
    ttft = (first or end) - started
    return {"ok": True, "tokens": tokens, "latency_s": end - started, "ttft_s": ttft,
            "tpot_s": (end - (first or end)) / (tokens - 1) if tokens > 1 else None}


def run_level(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int, extra: dict) -> dict:
    """``requests`` requests from ``concurrency`` closed-loop clients."""
    lock, results, next_index = threading.Lock(), [], [0]

    def client():
        while True:
            with lock:
                if next_index[0] >= requests:
                    return
                index = next_index[0]
                next_index[0] += 1
            result = one_request(url, prompts[index % len(prompts)], max_tokens, extra)
            with lock:
                results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)

    def pct(values, q):
        values = sorted(v for v in values if v is not None)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {"concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
            "output_tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
            "ttft_p50_s": pct([r["ttft_s"] for r in ok], 0.5), "ttft_p99_s": pct([r["ttft_s"] for r in ok], 0.99),
            "tpot_p50_s": pct([r["tpot_s"] for r in ok], 0.5), "tpot_p99_s": pct([r["tpot_s"] for r in ok], 0.99),
            "mean_latency_s": statistics.mean(r["latency_s"] for r in ok) if ok else None, "runs": results}


def speculation_figures(url: str) -> dict:
    """The server's Prometheus counters of drafted / accepted tokens so far."""
    response = httpx.get(url + "/metrics", timeout=10)
    text = response.text if response.status_code == 200 else ""  # llama-cpp-python's server has none
    out = {}
    for line in text.splitlines():
        for name in ("genspec:spec_decode_num_draft_tokens_total", "genspec:spec_decode_num_accepted_tokens_total",
                     "genspec:spec_decode_num_drafts_total", "genspec:generation_tokens_total"):
            if line.startswith(name + " "):
                out[name.split(":")[1]] = float(line.split()[-1])
    return out


def setups(args) -> list[tuple[str, dict]]:
    """``(label, {mode: (server flags, extra request fields)})``, measured one after the other."""
    if args.backend == "local":
        modes = {"on": (("--drafter", "prompt-lookup"), {}), "off": (("--drafter", "none"), {})}
        if args.versus_llamacpp_server:
            modes["llama.cpp"] = (LLAMACPP_SERVER, {})
        return [("local", modes)]
    return [(f"ray, {n} replica{'s' if n > 1 else ''}",
             {mode: (("--backend", "ray", "--replicas", str(n), "--drafter", "prompt-lookup"), extra)
              for mode, extra in (("on", {}), ("off", {"speculative": {"enabled": False}}))})
            for n in (int(r) for r in args.replicas.split(","))]


def measure(label: str, modes: dict, prompts: list[str], levels: list[int], args) -> dict:
    """Start the setup's servers, run every level on and off (alternating which goes first), stop them."""
    servers = {}
    try:
        for flags in dict.fromkeys(flags for flags, _ in modes.values()):
            port = free_port()
            servers[flags] = (start_server(flags, port, args), f"http://127.0.0.1:{port}")
            print(f"[{label}] server {' '.join(flags)} on port {port}", flush=True)
        for flags, extra in modes.values():  # warm-up, not measured
            run_level(servers[flags][1], prompts[:1], 1, 1, 16, extra)
        results = {mode: [] for mode in modes}
        for i, level in enumerate(levels):
            order = list(modes)
            for mode in order[i % len(order):] + order[:i % len(order)]:  # rotated: drifts hit every mode
                flags, extra = modes[mode]
                url = servers[flags][1]
                before = speculation_figures(url)
                result = run_level(url, prompts, level, args.requests, args.max_tokens, extra)
                after = speculation_figures(url)
                result["speculation"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                results[mode].append(result)
                print(f"[{label}] {mode:>9} c={level:<2} {result['tokens_per_s']:6.1f} tok/s  "
                      f"{result['requests_per_s']:.3f} req/s  ttft p50 {result['ttft_p50_s'] or 0:.2f}s  "
                      f"tpot p50 {result['tpot_p50_s'] or 0:.3f}s  failed {result['failed']}", flush=True)
        return results
    finally:
        stop_servers([process for process, _ in servers.values()])


def table(results: dict) -> list[str]:
    versus = "llama.cpp" in results
    lines = ["| concurrency | tok/s off | tok/s on | on / off | "
             + ("llama.cpp server tok/s | on / llama.cpp server | " if versus else "")
             + "req/s off | req/s on | TTFT p50 off / on (s) | "
             "TTFT p99 off / on (s) | TPOT p50 off / on (s) | TPOT p99 off / on (s) | acceptance on | failed |",
             "|" + "---|" * (14 if versus else 12)]
    for i, (off, on) in enumerate(zip(results["off"], results["on"])):
        drafted = on["speculation"].get("spec_decode_num_draft_tokens_total", 0)
        accepted = on["speculation"].get("spec_decode_num_accepted_tokens_total", 0)
        theirs = results["llama.cpp"][i] if versus else None
        failed = off["failed"] + on["failed"] + (theirs["failed"] if theirs else 0)
        lines.append(
            f"| {on['concurrency']} | {off['tokens_per_s']:.1f} | {on['tokens_per_s']:.1f} | "
            f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x | "
            + (f"{theirs['tokens_per_s']:.1f} | {on['tokens_per_s'] / theirs['tokens_per_s']:.2f}x | " if theirs else "")
            + f"{off['requests_per_s']:.3f} | {on['requests_per_s']:.3f} | "
            f"{off['ttft_p50_s']:.2f} / {on['ttft_p50_s']:.2f} | {off['ttft_p99_s']:.2f} / {on['ttft_p99_s']:.2f} | "
            f"{off['tpot_p50_s']:.3f} / {on['tpot_p50_s']:.3f} | {off['tpot_p99_s']:.3f} / {on['tpot_p99_s']:.3f} | "
            f"{accepted / drafted if drafted else 0:.2f} ({int(drafted)} drafted) | {failed} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--replicas", default="1,2", help="--backend ray: replica counts, measured in turn")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=20, help="requests per concurrency level, setup and mode")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--versus-llamacpp-server", action="store_true",
                        help="--backend local: also measure llama-cpp-python's own OpenAI server on the same GGUF "
                             "(needs the llamacpp-server extra)")
    parser.add_argument("--out", default="bench_results/serve_load")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p.text for p in load_spec_bench(per_category=2)]
    started = time.time()
    results = {label: measure(label, modes, prompts, levels, args) for label, modes in setups(args)}
    machine = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    (out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "settings": vars(args),
                                                  "machine": machine, "wall_s": time.time() - started,
                                                  "results": results}, indent=1))
    lines = []
    for label, result in results.items():
        lines += ([f"### {label}", ""] if len(results) > 1 or args.backend != "local" else []) + table(result) + [""]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for k, (label, result) in enumerate(results.items()):
        for mode, style in (("off", "--"), ("on", "-"), ("llama.cpp", ":")):
            if mode not in result:
                continue
            axis.plot([r["concurrency"] for r in result[mode]], [r["tokens_per_s"] for r in result[mode]],
                      "o" + style, color=f"C{k}", label=(f"{label}: " if len(results) > 1 else "")
                      + ("llama-cpp-python's server" if mode == "llama.cpp" else f"speculation {mode}"))
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent clients")
    axis.set_ylabel("output tokens / s")
    axis.set_title(f"genspec serve ({args.backend}): throughput vs concurrency")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "throughput.png", dpi=120)


if __name__ == "__main__":
    main()
