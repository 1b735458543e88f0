"""The soak and fault run (benchmarks/serving/serve_soak.py) as a test: a short smoke run on the tiny model in
the default suite (about a minute on a 2-core CPU, most of it starting the server twice), the 10-minute soak
of the embedded model under ``-m slow``. The script itself checks what matters (no failed request,
``/metrics`` equal to what the clients saw, no row left, stalled connections closed by the server, no client
hung when the server was killed, the restarted server answering); the tests read its summary.

Locust runs in a process of its own (it patches the standard library with gevent when imported).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving" / "serve_soak.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="needs locust (pip install locust)")


def _run(args: list[str], out: Path, timeout: float) -> dict:
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True,
                            timeout=timeout)
    print(result.stdout)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
    assert summary is not None, result.stderr[-3000:]
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert result.returncode == 0 and not failed, (failed, result.stdout, result.stderr[-3000:])
    return summary


def test_a_short_soak_with_faults_and_a_kill(tmp_path, tiny_model_dir):
    # too short for memory to settle: the bound on its growth is loose here (the long soak's is 64 MB)
    summary = _run(["--model", str(tiny_model_dir), "--duration", "8", "--users", "4", "--fault-seconds", "2",
                    "--fault-clients", "8", "--keep-alive", "1", "--read-timeout", "2", "--rss-bound-mb", "256"],
                   tmp_path, timeout=600)
    soak, faults, kill = summary["soak"], summary["faults"], summary["kill"]
    assert soak["requests"] > 0 and soak["failures"] == 0
    assert soak["server_finished"] + soak["server_cancelled"] == soak["samples_asked"] > 0
    assert faults["idle_connections"]["closed_by_server"]["closed"] == 8
    assert faults["half_bodies"]["closed_by_server"]["closed"] == 8
    assert faults["abandoned_streams"]["count"] >= 1 and faults["rows_left"] == 0
    assert kill["hung"] == 0 and sum(kill["outcomes"].values()) == 4
    assert (tmp_path / "summary.md").read_text().startswith("# genspec serve soak")


@pytest.mark.slow
def test_the_ten_minute_soak(tmp_path):
    """What the manual's figures come from: python benchmarks/serving/serve_soak.py --out
    benchmarks/results/serve_soak (the embedded model, 8 clients, 10 minutes)."""
    summary = _run([], tmp_path, timeout=3600)
    assert summary["soak"]["seconds"] >= 600 and summary["soak"]["users"] == 8
