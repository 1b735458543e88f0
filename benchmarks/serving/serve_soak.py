"""Soak and fault run of ``genspec serve``: loopback only (127.0.0.1), bounded, stops by itself.

    python benchmarks/serving/serve_soak.py --out benchmarks/results/serve_soak     # 10 minutes, embedded model
    python benchmarks/serving/serve_soak.py --model DIR --duration 15 --fault-seconds 6 --out /tmp/soak  # smoke

One ``genspec serve`` (its API key in $GENSPEC_API_KEY, rate limits off, drafters prompt-lookup, ngram-cache,
suffix and none to choose from per request), then three phases:

1. **Soak**: Locust (``soak_locustfile.py``: completions, streams, ``n = 3`` seeded samples, stop strings,
   streamed chats and abandoned streams, each with a random drafter) with ``--users`` clients for
   ``--duration`` seconds, no pause between requests. The server's resident memory is sampled every second.
   Afterwards the server's ``/metrics`` must count what the clients saw: every sample the clients asked
   for finished (success) or was cancelled (an abandoned stream), nothing else failed, no row is running
   or waiting.
2. **Slow and vanishing clients**: a probe (a greedy 32-token completion, one after another) alone, then
   during each fault for ``--fault-seconds``: ``--fault-clients`` connections that open and never send;
   as many that send half a body and stall; a client that opens streams and hangs up after the first
   chunk, in a loop. Reported: the probe's median latency under each against alone (and alone's own
   spread, the noise), whether and when the server closed the stalled connections, rows left running.
3. **SIGKILL under load**: ``--users`` streams running, the server killed with SIGKILL; every client must
   get a connection error (never hang: each waits at most 60 s). Then the same command again: the time
   until it answers a completion.

Prints a compact summary (also ``summary.md``) and writes ``summary.json`` and Locust's ``locust.json`` to ``--out``;
exits 1 if a check failed (``checks`` in the summary says which).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent
PROBE = {"prompt": "def fibonacci(n):\n    ", "max_tokens": 32, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``genspec serve`` on 127.0.0.1 in a process of its own."""

    def __init__(self, args, port: int, key: str):
        self.command = [sys.executable, "-m", "genspec", "serve", "--host", "127.0.0.1", "--port", str(port),
                        "--no-cost-measurement", "--requests-per-minute", "0", "--tokens-per-minute", "0",
                        "--max-streams-per-key", "256", "--max-batch-size", str(args.max_batch_size),
                        "--extra-drafter", "ngram-cache", "--extra-drafter", "suffix",
                        "--keep-alive", str(args.keep_alive), "--read-timeout", str(args.read_timeout),
                        *(["--model", args.model] if args.model else [])]
        self.env = {**os.environ, "GENSPEC_API_KEY": key}
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {key}"}
        self.port = port
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 900) -> float:
        """Starts it; returns the seconds until it answered a completion."""
        started = time.perf_counter()
        # stderr to a file, not a pipe nobody reads: a full pipe would block the server's next log line
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.command, env=self.env, stdout=subprocess.DEVNULL, stderr=self.log,
                                        text=True)
        while True:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"the server exited: {self.log.read()[-3000:]}")
            try:
                if self.complete(timeout=60).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            if time.perf_counter() - started > timeout:
                self.stop()
                raise SystemExit(f"the server did not answer within {timeout:.0f} s")
            time.sleep(0.2)

    def complete(self, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json=PROBE, headers=self.headers, timeout=timeout)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def rss_mb(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def total(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in metrics.items() if n == name and all((k, val) in lab for k, val in labels.items()))


# ------------------------------------------------------------------------------ phase 1: soak
def soak(server: Server, args, out: Path) -> dict:
    rss, stop = [], threading.Event()

    def sample():
        while not stop.wait(1.0):
            rss.append((time.perf_counter(), server.rss_mb()))

    rss_start = server.rss_mb()
    before = server.metrics()  # the start-up probe's request is not the clients'
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    command = [sys.executable, "-m", "locust", "-f", str(HERE / "soak_locustfile.py"), "--headless",
               "--host", server.url, "-u", str(args.users), "-r", str(args.users), "--run-time", f"{round(args.duration)}s",
               "--stop-timeout", "120", "--json-file", str(out / "locust"), "--loglevel", "WARNING"]
    started = time.perf_counter()
    locust = subprocess.run(command, env=server.env, capture_output=True, text=True, timeout=args.duration + 300)
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    rss_end = server.rss_mb()
    # Locust's JSON file, not its CSV files: it is written after the last user finished its last request
    if not (out / "locust.json").is_file():
        raise SystemExit(f"Locust wrote no statistics (exit code {locust.returncode}): {locust.stderr[-3000:]}")
    entries = {e["name"]: e for e in json.loads((out / "locust.json").read_text()) if e["name"] != "models"}
    asked = sum(e["num_requests"] * int(name.rsplit("n=", 1)[1]) for name, e in entries.items())
    everything: dict[str, int] = {}
    for e in entries.values():
        for ms, count in e["response_times"].items():
            everything[ms] = everything.get(ms, 0) + count
    metrics = server.metrics()

    def delta(name, **labels):
        return total(metrics, name, **labels) - total(before, name, **labels)

    finished = delta("genspec:request_success_total")
    cancelled = delta("genspec:request_failure_total", reason="cancelled")
    other_failures = delta("genspec:request_failure_total") - cancelled
    half = rss[len(rss) // 2][1] if rss else rss_start
    return {
        "seconds": round(seconds, 1), "users": args.users, "locust_exit_code": locust.returncode,
        "requests": sum(e["num_requests"] for e in entries.values()),
        "failures": sum(e["num_failures"] for e in entries.values()),
        "by_kind": {name: {"requests": e["num_requests"], "failures": e["num_failures"],
                           "p50_ms": percentile(e["response_times"], 0.5), "p99_ms": percentile(e["response_times"], 0.99)}
                    for name, e in entries.items()},
        "p50_ms": percentile(everything, 0.5), "p99_ms": percentile(everything, 0.99),
        "samples_asked": asked, "server_finished": finished, "server_cancelled": cancelled,
        "server_other_failures": other_failures,
        "rows_running": total(metrics, "genspec:num_requests_running"),
        "rows_waiting": total(metrics, "genspec:num_requests_waiting"),
        "rss_mb": {"start": round(rss_start, 1), "half": round(half, 1), "end": round(rss_end, 1),
                   "max": round(max([v for _, v in rss] + [rss_start, rss_end]), 1)},
        "locust_errors": locust.stderr[-2000:] if locust.returncode not in (0, 1) else "",
    }


def percentile(histogram: dict[str, int], q: float) -> float:
    """The ``q`` quantile of Locust's response-time histogram (milliseconds, rounded as Locust rounds them)."""
    ordered = sorted((float(ms), count) for ms, count in histogram.items())
    rank, seen = q * sum(count for _, count in ordered), 0
    for ms, count in ordered:
        seen += count
        if seen >= rank:
            return ms
    return ordered[-1][0] if ordered else 0.0


# ------------------------------------------------------------------------------ phase 2: faults
def probe_latencies(server: Server, seconds: float) -> list[float]:
    """Sequential probe completions for about ``seconds`` (at least 3)."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        started = time.perf_counter()
        response = server.complete()
        response.raise_for_status()
        times.append(time.perf_counter() - started)
    return times


def idle_connections(server: Server, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", server.port)) for _ in range(count)]


def half_bodies(server: Server, count: int) -> list[socket.socket]:
    body = json.dumps(PROBE).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: {server.headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    connections = []
    for _ in range(count):
        connection = socket.create_connection(("127.0.0.1", server.port))
        connection.sendall(head + body[:len(body) // 2])
        connections.append(connection)
    return connections


class CloseWatch:
    """Watches connections in a thread: when the server closes each (seconds after it was opened)."""

    def __init__(self, connections: list[socket.socket]):
        self.connections, self.opened = connections, time.perf_counter()
        self.closed: dict[int, float] = {}
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.stop = threading.Event()
        self.thread.start()

    def _watch(self) -> None:
        import selectors

        selector = selectors.DefaultSelector()
        for i, connection in enumerate(self.connections):
            selector.register(connection, selectors.EVENT_READ, i)
        while len(self.closed) < len(self.connections) and not self.stop.is_set():
            for key, _ in selector.select(timeout=0.2):
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if not data:  # the server closed it (what it sent before, if anything, is read and dropped)
                    self.closed[key.data] = round(time.perf_counter() - self.opened, 1)
                    selector.unregister(key.fileobj)
        selector.close()

    def result(self, wait: float) -> dict:
        """After at most ``wait`` more seconds: how many the server closed, and when the last was closed."""
        self.thread.join(timeout=wait)
        self.stop.set()
        self.thread.join()
        for connection in self.connections:
            connection.close()
        return {"closed": len(self.closed), "of": len(self.connections),
                "last_after_s": max(self.closed.values()) if self.closed else None}


def abandoning_client(server: Server, stop: threading.Event, counter: list[int]) -> None:
    body = {**PROBE, "max_tokens": 128, "stream": True}
    while not stop.is_set():
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        counter[0] += 1


def faults(server: Server, args) -> dict:
    alone = probe_latencies(server, args.fault_seconds)
    result = {"probe_alone_s": _spread(alone)}

    watch = CloseWatch(idle_connections(server, args.fault_clients))
    during = probe_latencies(server, args.fault_seconds)
    result["idle_connections"] = {"count": args.fault_clients, "probe_s": _spread(during),
                                  "closed_by_server": watch.result(wait=args.keep_alive + 10)}

    watch = CloseWatch(half_bodies(server, args.fault_clients))
    during = probe_latencies(server, args.fault_seconds)
    result["half_bodies"] = {"count": args.fault_clients, "probe_s": _spread(during),
                             "closed_by_server": watch.result(wait=args.read_timeout + 10)}

    stop, counter = threading.Event(), [0]
    thread = threading.Thread(target=abandoning_client, args=(server, stop, counter), daemon=True)
    thread.start()
    during = probe_latencies(server, args.fault_seconds)
    stop.set()
    thread.join(timeout=120)
    result["abandoned_streams"] = {"count": counter[0], "probe_s": _spread(during)}

    deadline = time.perf_counter() + 10
    while True:  # an abandoned stream's row is freed at the next step boundary
        metrics = server.metrics()
        rows = total(metrics, "genspec:num_requests_running") + total(metrics, "genspec:num_requests_waiting")
        if rows == 0 or time.perf_counter() > deadline:
            break
        time.sleep(0.2)
    result["rows_left"] = rows
    return result


def _spread(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"n": len(times), "median": round(statistics.median(times), 3), "min": round(ordered[0], 3),
            "max": round(ordered[-1], 3)}


# ------------------------------------------------------------------------------ phase 3: SIGKILL
def kill_under_load(server: Server, args) -> dict:
    outcomes, started = [None] * args.users, threading.Barrier(args.users + 1, timeout=120)
    killed_at = [0.0]

    def client(i: int) -> None:
        body = {**PROBE, "max_tokens": 200, "stream": True, "speculative": {"enabled": False}}
        signalled = False
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers,
                              timeout=httpx.Timeout(60, connect=10)) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and not signalled:
                        signalled = True
                        started.wait()
                    if line == "data: [DONE]":
                        outcomes[i] = ("finished before the kill", time.perf_counter() - killed_at[0])
                        return
            outcomes[i] = ("stream ended without [DONE]", time.perf_counter() - killed_at[0])
        except httpx.HTTPError as exc:
            outcomes[i] = (type(exc).__name__, time.perf_counter() - killed_at[0])
        finally:
            if not signalled:
                try:
                    started.wait()
                except threading.BrokenBarrierError:
                    pass

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.users)]
    for thread in threads:
        thread.start()
    started.wait()
    killed_at[0] = time.perf_counter()
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    for thread in threads:
        thread.join(timeout=90)
    hung = sum(thread.is_alive() for thread in threads)
    restart_s = server.start()
    errors: dict[str, int] = {}
    for outcome in outcomes:
        kind = outcome[0] if outcome else "hung"
        errors[kind] = errors.get(kind, 0) + 1
    return {"streams": args.users, "outcomes": errors, "hung": hung,
            "slowest_error_s": round(max((o[1] for o in outcomes if o), default=0.0), 2),
            "restart_to_first_answer_s": round(restart_s, 1)}


# ------------------------------------------------------------------------------ summary
def checks(summary: dict, args) -> dict[str, bool]:
    s, f, k = summary["soak"], summary["faults"], summary["kill"]
    growth = s["rss_mb"]["end"] - s["rss_mb"]["half"]
    return {
        "soak: no failed request": s["failures"] == 0 and s["requests"] > 0,
        "soak: /metrics counts what the clients saw": s["server_finished"] + s["server_cancelled"] == s["samples_asked"]
        and s["server_other_failures"] == 0,
        "soak: no row left running or waiting": s["rows_running"] == 0 and s["rows_waiting"] == 0,
        f"soak: resident memory grew <= {args.rss_bound_mb} MB in the second half": growth <= args.rss_bound_mb,
        "faults: the server closed every idle connection": f["idle_connections"]["closed_by_server"]["closed"]
        == args.fault_clients,
        "faults: the server closed every half body": f["half_bodies"]["closed_by_server"]["closed"]
        == args.fault_clients,
        "faults: no row left": f["rows_left"] == 0,
        "kill: no client hung (each got a connection error, or had finished)": k["hung"] == 0
        and "hung" not in k["outcomes"] and "stream ended without [DONE]" not in k["outcomes"],
        "kill: the restarted server answered": k["restart_to_first_answer_s"] > 0,
    }


def report(summary: dict) -> str:
    s, f, k = summary["soak"], summary["faults"], summary["kill"]
    alone = f["probe_alone_s"]
    lines = [
        f"# genspec serve soak ({summary['model']}, {s['users']} clients, {s['seconds']:.0f} s)", "",
        f"- requests {s['requests']}, failures {s['failures']}; latency p50 {s['p50_ms']:.0f} ms, "
        f"p99 {s['p99_ms']:.0f} ms (client side, to the end of the response)",
        f"- RSS {s['rss_mb']['start']} MB at start, {s['rss_mb']['half']} at half time, {s['rss_mb']['end']} at the "
        f"end (max {s['rss_mb']['max']})",
        f"- /metrics: {s['server_finished']:.0f} finished + {s['server_cancelled']:.0f} cancelled = "
        f"{s['server_finished'] + s['server_cancelled']:.0f} samples; the clients asked for {s['samples_asked']}; "
        f"other failures {s['server_other_failures']:.0f}; rows running {s['rows_running']:.0f}, waiting "
        f"{s['rows_waiting']:.0f}", "",
        "| kind | requests | failures | p50 ms | p99 ms |", "|---|---:|---:|---:|---:|",
        *[f"| {name} | {r['requests']} | {r['failures']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} |"
          for name, r in sorted(s["by_kind"].items())], "",
        f"Faults (probe: a greedy 32-token completion; alone median {alone['median']} s, range {alone['min']}-"
        f"{alone['max']} s, {alone['n']} runs):", "",
        "| fault | probe median s | ratio to alone | what the server did |", "|---|---:|---:|---|",
    ]
    for name, label in (("idle_connections", "connections that never send"), ("half_bodies", "half bodies, then stall")):
        fault = f[name]
        closed = fault["closed_by_server"]
        lines.append(f"| {fault['count']} {label} | {fault['probe_s']['median']} | "
                     f"{fault['probe_s']['median'] / alone['median']:.2f} | closed {closed['closed']} of {closed['of']}"
                     f" (the last {closed['last_after_s']} s after they opened) |")
    fault = f["abandoned_streams"]
    lines += [f"| a client hanging up after the first chunk ({fault['count']} streams) | {fault['probe_s']['median']} | "
              f"{fault['probe_s']['median'] / alone['median']:.2f} | rows left afterwards: {f['rows_left']:.0f} |", "",
              f"SIGKILL with {k['streams']} streams running: {k['outcomes']} (the last error "
              f"{k['slowest_error_s']} s after the kill; hung: {k['hung']}); restarted, it answered a completion "
              f"{k['restart_to_first_answer_s']} s after starting.", "", "Checks:", "",
              *[f"- [{'x' if ok else ' '}] {name}" for name, ok in summary["checks"].items()]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--duration", type=float, default=600, help="seconds of soak (default 600)")
    parser.add_argument("--users", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--fault-seconds", type=float, default=30, help="probe time alone and under each fault")
    parser.add_argument("--fault-clients", type=int, default=32, help="idle / half-body connections per fault")
    parser.add_argument("--keep-alive", type=float, default=5, help="the server's --keep-alive")
    parser.add_argument("--read-timeout", type=float, default=10, help="the server's --read-timeout")
    parser.add_argument("--rss-bound-mb", type=float, default=64,
                        help="the most resident memory may grow in the soak's second half (default 64)")
    parser.add_argument("--out", required=True, help="directory for summary.md, summary.json, locust.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server(args, free_port(), secrets.token_hex(16))
    summary = {"model": args.model or "embedded gemma-3-270m", "command": " ".join(sys.argv)}
    try:
        summary["first_start_s"] = round(server.start(), 1)
        summary["soak"] = soak(server, args, out)
        summary["faults"] = faults(server, args)
        summary["kill"] = kill_under_load(server, args)
    finally:
        server.stop()
    summary["checks"] = checks(summary, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = report(summary)
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
