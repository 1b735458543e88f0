"""A Locust scenario for ``genspec serve``: what :mod:`serve_soak` drives, and a load test of your own.

    GENSPEC_API_KEY=KEY locust -f benchmarks/serving/soak_locustfile.py --host http://127.0.0.1:8000 \\
        --headless -u 8 -r 8 --run-time 10m --stop-timeout 120

Each simulated client, in a loop with no pause, picks one of: a completion, a streamed completion, ``n = 3``
seeded samples, a completion ended by a stop string, a streamed chat, or a stream it abandons after the
first chunk (a client going away mid-stream); each with a drafter chosen at random among the server's
(``/v1/models``), or with speculation off. A request fails unless it is answered 200 and (streams) ends
with ``data: [DONE]`` after a finish reason, or (the abandoned stream) sends its first chunk. Latency is
client-side, to the end of the response. Request names end with ``n=N``, the samples each asks for:
``serve_soak`` compares them with the server's ``/metrics``.
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, task

PROMPTS = ["def fibonacci(n):\n    ", "The three primary colours are", "Question: what is 12 * 12?\nAnswer:",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n    ", "Dear team,\n\nThe meeting on"]


class GenspecUser(HttpUser):
    def on_start(self):
        key = os.environ.get("GENSPEC_API_KEY")
        self.client.headers.update({"Authorization": f"Bearer {key}"} if key else {})
        models = self.client.get("/v1/models", name="models").json()["data"][0]
        self.model = models["id"]
        self.drafters = [d for d in models["drafters"] if d != "none"]

    def speculative(self) -> dict:
        if random.random() < 0.2:
            return {"enabled": False}
        return {"drafter": random.choice(self.drafters)}

    def body(self, **fields) -> dict:
        return {"model": self.model, "prompt": random.choice(PROMPTS), "max_tokens": 32, "temperature": 0,
                "speculative": self.speculative(), **fields}

    def post(self, name: str, path: str, body: dict, stream: bool = False, first_chunk_only: bool = False):
        started = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=stream, catch_response=True) as response:
            try:
                if response.status_code != 200:
                    response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                elif not stream:
                    choices = response.json()["choices"]
                    if len(choices) != body.get("n", 1) or any(c["finish_reason"] is None for c in choices):
                        response.failure(f"incomplete answer: {choices}")
                else:
                    self.read_stream(response, first_chunk_only)
            except Exception as exc:  # noqa: BLE001 - a broken answer is the request's failure, not the user's
                response.failure(f"{type(exc).__name__}: {exc}")
            finally:
                if first_chunk_only:
                    response.close()  # hang up mid-stream
                response.request_meta["response_time"] = (time.perf_counter() - started) * 1000

    @staticmethod
    def read_stream(response, first_chunk_only: bool) -> None:
        finished = done = False
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if first_chunk_only:
                return
            if line == b"data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                response.failure(f"error event: {chunk['error']}")
                return
            finished |= any(c.get("finish_reason") for c in chunk["choices"])
        if not (done and finished):
            response.failure("the stream ended without a finish reason and [DONE]")

    @task(3)
    def completion(self):
        self.post("completion n=1", "/v1/completions", self.body())

    @task(3)
    def streamed(self):
        self.post("stream n=1", "/v1/completions", self.body(stream=True), stream=True)

    @task(2)
    def seeded_samples(self):
        self.post("seeded samples n=3", "/v1/completions",
                  self.body(n=3, temperature=0.8, seed=random.randrange(1 << 31), max_tokens=16))

    @task(2)
    def stop_string(self):
        self.post("stop string n=1", "/v1/completions", self.body(stop=["\n\n", "."], max_tokens=48))

    @task(2)
    def chat(self):
        body = self.body(stream=True, messages=[{"role": "user", "content": random.choice(PROMPTS)}])
        del body["prompt"]
        self.post("chat stream n=1", "/v1/chat/completions", body, stream=True)

    @task(1)
    def abandoned(self):
        self.post("abandoned stream n=1", "/v1/completions", self.body(stream=True, max_tokens=128), stream=True,
                  first_chunk_only=True)
