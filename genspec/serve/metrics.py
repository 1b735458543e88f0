"""Prometheus metrics of ``genspec serve`` (``GET /metrics``), named in parallel to vLLM's so existing
dashboards map over (``vllm:`` -> ``genspec:``). Each app has its own registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from genspec.engine import StepRecord

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("genspec:spec_decode_num_drafts", "Verification steps with at least one draft token",
                                  registry=r)
        self.num_draft_tokens = Counter("genspec:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter("genspec:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("genspec:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (1 = first)", ["position"],
                                        registry=r)
        self.success = Counter("genspec:request_success", "Requests finished, by finish reason", ["finished_reason"],
                               registry=r)
        self.lossy = Counter("genspec:request_lossy", "Requests finished with a lossy acceptance rule (their "
                             "output does not have the model's law), by rule and residual", ["rule", "residual"],
                             registry=r)
        self.failure = Counter("genspec:request_failure",
                               "Requests not finished: invalid, queue_full, cancelled (client gone), error; "
                               "refused: unauthorized (no or a wrong API key), limit, rate_limited",
                               ["reason"], registry=r)
        self.waiting = Gauge("genspec:num_requests_waiting", "Requests waiting for a slot in the running batch",
                             registry=r)
        self.running = Gauge("genspec:num_requests_running", "Requests in the running batch", registry=r)
        self.generation_tokens = Counter("genspec:generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("genspec:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.time_to_first_token = Histogram("genspec:time_to_first_token_seconds", "Time to the first output token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("genspec:time_per_output_token_seconds",
                                               "Time per output token after the first", buckets=_TOKEN_BUCKETS,
                                               registry=r)
        self.e2e_latency = Histogram("genspec:e2e_request_latency_seconds", "Request latency, end to end",
                                     buckets=_LATENCY_BUCKETS, registry=r)

        # where a step's time goes (vLLM's model_forward / model_execute times): a step much longer than
        # its forward pass means the server (or drafting) is the bottleneck, not the model
        self.step_time = Histogram("genspec:engine_step_seconds", "Engine step time (prefills, drafting, "
                                   "verification, bookkeeping)", buckets=_STEP_BUCKETS, registry=r)
        self.forward_time = Histogram("genspec:model_forward_seconds", "The target's verify pass in a step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.prefill_time = Histogram("genspec:prefill_seconds", "Prefills of requests joining the batch in a step",
                                      buckets=_STEP_BUCKETS, registry=r)

    def observe_step(self, record: StepRecord, waiting: int, running: int) -> None:
        self.step_time.observe(record.total_time_s)
        if record.target_time_s:
            self.forward_time.observe(record.target_time_s)
        if record.joined:
            self.prefill_time.observe(record.prefill_time_s)
        for step in record.requests.values():
            self.generation_tokens.inc(len(step.new_tokens))
            if step.drafted:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(step.drafted)
                self.num_accepted_tokens.inc(step.accepted)
                for position, kept in enumerate(step.accepted_per_position, start=1):
                    if kept:
                        self.accepted_per_pos.labels(position=str(position)).inc()
        self.waiting.set(waiting)
        self.running.set(running)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def merge_expositions(texts: list[bytes]) -> bytes:
    """Several servers' ``/metrics`` bodies as one (the Ray backend's replicas): each sample summed over
    them (counters, histogram buckets, sums and counts; the gauges of requests running and waiting
    become the service's totals); ``_created`` timestamps are dropped, since they do not add up."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, dict]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            _, _, samples = families.setdefault(family.name, (family.type, family.documentation, {}))
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples[key] = samples.get(key, 0.0) + sample.value
    lines = []
    for name, (kind, documentation, samples) in families.items():
        lines += [f"# HELP {name} {_escape(documentation, quote=False)}", f"# TYPE {name} {kind}"]
        for (sample_name, labels), value in samples.items():
            text = ",".join(f'{key}="{_escape(label)}"' for key, label in labels)
            lines.append(f"{sample_name}{{{text}}} {value!r}" if labels else f"{sample_name} {value!r}")
    return ("\n".join(lines) + "\n").encode()


def _escape(text: str, quote: bool = True) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text

