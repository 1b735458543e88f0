"""``genspec serve --backend ray``: the OpenAI app behind Ray Serve, on a local Ray instance the test
starts (loopback, 2 replicas of a tiny model, stopped at the end). Skipped without the ``ray`` extra."""
from __future__ import annotations

import socket
import sys
import time

import httpx
import pytest

from genspec.cli import main
from genspec.serve.ray_backend import threads_per_replica


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_threads_per_replica_share_the_cores():
    assert threads_per_replica(2, 2) == 1
    assert threads_per_replica(8, 3) == 2
    assert threads_per_replica(2, 4) == 1  # never 0
    assert threads_per_replica(16, 1) == 16


def test_without_ray_the_flag_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["serve", "--backend", "ray", "--replicas", "2"]) == 2
    assert "pip install 'genspec[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, fragment", [(["--replicas", "0"], "--replicas must be >= 1"),
                                            (["--replicas", "two"], "number or auto"),
                                            (["--replicas", "auto", "--min-replicas", "3", "--max-replicas", "2"],
                                             "min <= max")])
def test_bad_replica_settings(flags, fragment, capsys):
    assert main(["serve", "--backend", "ray", *flags]) == 2
    assert fragment in capsys.readouterr().err


def test_a_missing_model_is_a_one_line_error_before_ray_starts(tmp_path, capsys):
    assert main(["serve", "--backend", "ray", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no model at" in err and "Traceback" not in err


def test_two_replicas_serve_completions_and_streams(tiny_model_dir):
    """Smoke test (about 30 s): two replicas behind Ray Serve's proxy on loopback answer completions and
    streams through the openai client, greedy output equal to the engine's own; killing one replica's
    process leaves the service answering."""
    ray = pytest.importorskip("ray")
    from ray import serve

    import openai

    import genspec
    from genspec.serve.ray_backend import deployment

    port = _free_port()
    settings = {"model": str(tiny_model_dir), "drafter": "prompt-lookup", "draft_model": None, "dtype": "float32",
                "extra_drafters": {}, "drafter_options": {}, "max_batch_size": 4, "max_queue": 8, "grace_s": 5.0,
                "name": "tiny", "measure_costs": False}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(settings, replicas=2, cores=2), name="genspec", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = "abc abc abc abd abc"
        expected = genspec.load(str(tiny_model_dir), drafter="none").generate(prompt, max_new_tokens=24)[0].text
        for _ in range(4):  # several requests, whichever replica takes each
            completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            assert completion.choices[0].text == expected
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                      extra_body={"speculative": {"drafter": "no-such-drafter"}})

        # /metrics (one scrape, landing on one replica) counts the whole service: 5 requests x 24 tokens
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
        assert values["genspec:generation_tokens_total"] == 5 * 24
        assert values['genspec:request_success_total{finished_reason="length"}'] == 5

        # one replica's process dies: the service keeps answering and Serve starts a replacement
        def replicas():
            return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]}

        before = replicas()
        victim = sorted(before)[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        for _ in range(6):
            completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            assert completion.choices[0].text == expected
        deadline = time.time() + 60
        while not (len(replicas()) == 2 and victim not in replicas()):
            assert time.time() < deadline, "no replacement replica"
            time.sleep(0.5)
    finally:
        serve.shutdown()
        ray.shutdown()
