"""Load test of ``genspec serve``: speculation on vs off at several concurrency levels, in one run.

``--backend local`` (default): two servers on loopback (127.0.0.1), the same model, one with speculation
(the default drafter) and one without (``--drafter none``). ``--versus-llama-server none,default,ngram-mod``
adds llama.cpp's own C++ ``llama-server`` on the same GGUF file, once per listed speculation type (``none``:
plain; ``default``: its ``--spec-default``; any model-free ``--spec-type``), with ``-np`` = the largest
level; it is built from the llama.cpp source that llama-cpp-python vendors on first use
(``genspec.bench.llama_server``, cached, its build time printed). ``--also-drafters suffix,ngram-cache`` adds a
genspec server per listed drafter; ``--also-kernels exact-tiled`` an "on" and an "off" server per listed kind of
kernels (``--kernels`` is the others'). With ``--held-out`` each level takes
prompts of its own that ``genspec bench`` does not measure (each category's third prompt on), the same
for every server, so no cross-request cache sees a prompt twice; and each server is started for one level
and stopped after it, one server running at a time. ``--backend ray --replicas 1,2``: for each
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
    python benchmarks/serving/serve_load.py --versus-llama-server none,default,ngram-simple,ngram-map-k \
        --held-out --concurrency 1,4,16 --requests 13,26,52 --out benchmarks/results/serve_load_llama_server

Writes results.json (every request's timings), report.md (a table per setup) and throughput.png.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from genspec.bench.llama_server import (
    SPEC_TYPES,
    free_port,
    server_binary,
    server_command,
)
from genspec.bench.prompts import load_spec_bench, round_robin

LLAMACPP_SERVER = ("llama_cpp.server",)  # a mode's flags that start llama-cpp-python's own server instead
LLAMA_SERVER = "llama-server"  # a mode's first flag that starts llama.cpp's C++ server (its speculation type after)


def start_server(flags: tuple[str, ...], port: int, args) -> subprocess.Popen:
    if flags and flags[0] == LLAMA_SERVER:
        # -np: a slot per client of the largest level; -c: 4,096 tokens a slot (the longest prompt plus 128 fits);
        # its threads as genspec's llamacpp backend sets them (every core)
        command = server_command(gguf_model(args), port, flags[1], parallel=max(args.levels), context=4096,
                                 threads=os.cpu_count())
    elif flags == LLAMACPP_SERVER:
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
                   "--max-batch-size", str(args.max_batch_size), "--max-queue", "256", "--kernels", args.kernels,
                   *flags]
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
    text = []
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
                    text += [c["text"] for c in chunk["choices"] if c.get("text")]
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "latency_s": time.perf_counter() - started}
    end = time.perf_counter()
    tokens = tokens or chunks  # llama-cpp-python's server streams one token per chunk and no usage
    ttft = (first or end) - started
    return {"ok": True, "tokens": tokens, "text": "".join(text), "latency_s": end - started, "ttft_s": ttft,
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
            result["prompt"] = index % len(prompts)
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
        for drafter in args.also_drafters:
            modes[f"genspec {drafter}"] = (("--drafter", drafter), {})
        for kernels in args.also_kernels:  # a later --kernels overrides the one start_server passes
            modes[f"on {kernels}"] = (("--drafter", "prompt-lookup", "--kernels", kernels), {})
            modes[f"off {kernels}"] = (("--drafter", "none", "--kernels", kernels), {})
        if args.versus_llamacpp_server:
            modes["llama.cpp"] = (LLAMACPP_SERVER, {})
        for spec_type in args.llama_server_types:
            modes[f"llama-server {spec_type}"] = ((LLAMA_SERVER, spec_type), {})
        return [("local", modes)]
    return [(f"ray, {n} replica{'s' if n > 1 else ''}",
             {mode: (("--backend", "ray", "--replicas", str(n), "--drafter", "prompt-lookup"), extra)
              for mode, extra in (("on", {}), ("off", {"speculative": {"enabled": False}}))})
            for n in (int(r) for r in args.replicas.split(","))]


def level_prompts(prompts: list[str], levels: list[int], requests: list[int], held_out: bool) -> list[list[str]]:
    """The prompts of each level: all of them at every level, or with ``held_out`` a new slice per level."""
    if not held_out:
        return [prompts] * len(levels)
    if sum(requests) > len(prompts):
        raise SystemExit(f"--held-out needs {sum(requests)} prompts, there are {len(prompts)}")
    starts = [sum(requests[:i]) for i in range(len(levels))]
    return [prompts[start:start + n] for start, n in zip(starts, requests)]


def measure_level(label: str, mode: str, flags, extra: dict, prompts: list[str], level: int, requests: int,
                  args, running: dict) -> dict:
    """One level of one mode, on its running server (started now, and stopped after it with ``--held-out``)."""
    if flags not in running:
        port = free_port()
        running[flags] = (start_server(flags, port, args), f"http://127.0.0.1:{port}")
        print(f"[{label}] server {' '.join(flags)} on port {port}", flush=True)
        run_level(running[flags][1], prompts[:1], 1, 1, 16, extra)  # warm-up, not measured
    url = running[flags][1]
    before = speculation_figures(url)
    result = run_level(url, prompts, level, requests, args.max_tokens, extra)
    after = speculation_figures(url)
    result["speculation"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"[{label}] {mode:>22} c={level:<2} {result['tokens_per_s']:6.1f} tok/s  "
          f"{result['requests_per_s']:.3f} req/s  ttft p50 {result['ttft_p50_s'] or 0:.2f}s  "
          f"tpot p50 {result['tpot_p50_s'] or 0:.3f}s  failed {result['failed']}", flush=True)
    if args.held_out:
        stop_servers([running.pop(flags)[0]])
    return result


def measure(label: str, modes: dict, prompts: list[str], levels: list[int], args) -> dict:
    """Every level of every mode, the modes' order rotated from level to level (drifts hit every mode).
    Without ``--held-out`` each setup's servers run together for the whole setup; with it one at a time."""
    running: dict = {}
    per_level = level_prompts(prompts, levels, args.requests, args.held_out)
    results = {mode: [] for mode in modes}
    try:
        for i, level in enumerate(levels):
            order = list(modes)
            for mode in order[i % len(order):] + order[:i % len(order)]:
                flags, extra = modes[mode]
                results[mode].append(measure_level(label, mode, flags, extra, per_level[i], level,
                                                   args.requests[i], args, running))
        return results
    finally:
        stop_servers([process for process, _ in running.values()])


def same_texts(a: dict, b: dict) -> tuple[int, int]:
    """(requests whose text is the same in both runs of a level, requests compared), matched by prompt."""
    texts = {r["prompt"]: r["text"] for r in a["runs"] if r["ok"]}
    pairs = [(texts[r["prompt"]], r["text"]) for r in b["runs"] if r["ok"] and r["prompt"] in texts]
    return sum(x == y for x, y in pairs), len(pairs)


def table(results: dict) -> list[str]:
    """One row per level: every mode's throughput, genspec's ratios to the others, p50 TTFT, acceptance."""
    modes = list(results)
    theirs = [m for m in modes if m.startswith("llama-server")]
    head = (["clients"] + [f"{m} tok/s" for m in modes] + ["on / off"]
            + (["on / best llama-server", "off / llama-server none"] if theirs else [])
            + (["on / llama.cpp server"] if "llama.cpp" in modes else [])
            + [f"TTFT p50 {m} (s)" for m in modes] + ["same text on / off", "acceptance on", "failed"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, on in enumerate(results["on"]):
        off = results["off"][i]
        rate = {m: results[m][i]["tokens_per_s"] for m in modes}
        cells = [str(on["concurrency"])] + [f"{rate[m]:.1f}" for m in modes] + [f"{rate['on'] / rate['off']:.2f}x"]
        if theirs:
            best = max(theirs, key=rate.get)
            cells.append(f"{rate['on'] / rate[best]:.2f}x ({best.split()[-1]})")
            cells.append(f"{rate['off'] / rate['llama-server none']:.2f}x" if "llama-server none" in rate else "-")
        if "llama.cpp" in modes:
            cells.append(f"{rate['on'] / rate['llama.cpp']:.2f}x")
        cells += [f"{results[m][i]['ttft_p50_s'] or 0:.2f}" for m in modes]
        same, compared = same_texts(off, on)
        drafted = on["speculation"].get("spec_decode_num_draft_tokens_total", 0)
        accepted = on["speculation"].get("spec_decode_num_accepted_tokens_total", 0)
        cells += [f"{same}/{compared}", f"{accepted / drafted if drafted else 0:.2f} ({int(drafted)} drafted)",
                  str(sum(results[m][i]["failed"] for m in modes))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def llama_server_build() -> dict:
    """What the llama-server binary was built from and with (its build.json), and the binary's path."""
    binary = server_binary()
    record = binary.parent.parent / "build.json"
    return {"binary": str(binary), **(json.loads(record.read_text()) if record.is_file() else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--replicas", default="1,2", help="--backend ray: replica counts, measured in turn")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", default="20",
                        help="requests per concurrency level, setup and mode: one number, or one per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--kernels", choices=["exact", "exact-tiled", "fast"], default="exact",
                        help="genspec serve's --kernels (a llamacpp model's: exact, the default, exact-tiled or fast)")
    parser.add_argument("--versus-llamacpp-server", action="store_true",
                        help="--backend local: also measure llama-cpp-python's own OpenAI server on the same GGUF "
                             "(needs the llamacpp-server extra)")
    parser.add_argument("--versus-llama-server", default="", metavar="TYPES",
                        help="--backend local: also measure llama.cpp's llama-server on the same GGUF, once per "
                             f"listed speculation type ({', '.join(SPEC_TYPES)})")
    parser.add_argument("--also-drafters", default="", metavar="NAMES",
                        help="--backend local: more genspec servers, one per listed drafter (e.g. suffix,ngram-cache)")
    parser.add_argument("--also-kernels", default="", metavar="KINDS",
                        help="--backend local: an on and an off genspec server per listed kind of kernels")
    parser.add_argument("--held-out", action="store_true",
                        help="prompts genspec bench does not measure, new ones at each level; one server at a time")
    parser.add_argument("--out", default="bench_results/serve_load")
    args = parser.parse_args()
    levels = args.levels = [int(c) for c in args.concurrency.split(",")]
    requests = [int(r) for r in args.requests.split(",")]
    if len(requests) not in (1, len(levels)):
        raise SystemExit(f"--requests: one number or one per level ({len(levels)}), got {args.requests}")
    args.requests = requests * len(levels) if len(requests) == 1 else requests
    args.llama_server_types = [t for t in args.versus_llama_server.split(",") if t]
    args.also_drafters = [d for d in args.also_drafters.split(",") if d]
    args.also_kernels = [k for k in args.also_kernels.split(",") if k]
    unknown = [t for t in args.llama_server_types if t not in SPEC_TYPES]
    if unknown:
        raise SystemExit(f"--versus-llama-server: unknown type {unknown[0]!r}; choose from {', '.join(SPEC_TYPES)}")
    if args.llama_server_types:
        server_binary()  # built now, not inside the first level's timing
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.held_out:  # round robin over the categories, so that every level's slice mixes them
        prompts = round_robin(load_spec_bench(skip=2))
    else:
        prompts = [p.text for p in load_spec_bench(per_category=2)]
    started = time.time()
    results = {label: measure(label, modes, prompts, levels, args) for label, modes in setups(args)}
    machine = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    (out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "settings": vars(args),
                                                  "llama_server": llama_server_build() if args.llama_server_types else None,
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
    styles = {"off": "--", "on": "-", "llama.cpp": ":"}
    for k, (label, result) in enumerate(results.items()):
        for j, mode in enumerate(result):
            own = mode in ("on", "off")
            axis.plot([r["concurrency"] for r in result[mode]], [r["tokens_per_s"] for r in result[mode]],
                      "o" + styles.get(mode, ":"), color=f"C{k}" if own or len(results) > 1 else f"C{j}",
                      label=(f"{label}: " if len(results) > 1 else "")
                      + ({"llama.cpp": "llama-cpp-python's server"}.get(mode, mode) if not own
                         else f"genspec, speculation {mode}"))
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
