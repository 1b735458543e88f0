"""OpenAI-compatible request and response shapes, with genspec's per-request ``speculative`` object.

Requests are validated with pydantic; anything wrong (malformed JSON, a body that is not UTF-8, a
wrong type, a value out of range, a number that is not finite, an unknown drafter or model) becomes an
OpenAI-style error body with a 4xx status, never a traceback. Responses carry ``usage`` and, in vLLM's
shape, per-request speculation metrics (``metrics.speculative_decoding``).

Seeds: ``seed`` takes any 64-bit signed integer, the range OpenAI's API accepts; a negative seed stands
for its 64-bit two's complement (``seed mod 2**64``), since the engine's seeds are non-negative. So
every accepted seed has a stream of its own, and a non-negative seed gives what ``genspec generate
--seed`` gives. Seeds outside that range get a 400 naming ``seed``.
"""
from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from genspec.config import MAX_TOP_LOGPROBS
from genspec.engine import RequestStats
from genspec.records import TokenLogprob
from genspec.sampling import LOGIT_BIAS_RANGE, PENALTY_RANGE


class APIError(Exception):
    """An error the client caused (or a full queue): sent as ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param, self.code = message, status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


#: the seeds a request may give: OpenAI's range, 64-bit signed integers
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


class _Request(BaseModel):
    """A request's part: numbers must be finite (JSON has no NaN or infinity; Python's parser reads
    ``1e309`` as infinity and accepts ``NaN``), and pydantic says which field is not. Types are strict, as
    the manual promises: ``"8"`` or ``8.0`` is no ``max_tokens``, ``true`` no token id, ``"no"`` no
    boolean (an integer is a number, as in JSON)."""

    model_config = ConfigDict(allow_inf_nan=False, strict=True)


class SpeculativeOptions(_Request):
    """Per-request speculation (genspec's extension): which drafter, how many tokens, which
    draft-length policy, or ``enabled: false`` for plain decoding; and the acceptance rule (default the
    lossless standard rule, or the lossless coupled rule for a seeded request whose drafter samples its
    drafts (``rule`` "auto"); ``epsilon`` > 0, ``residual`` "uno" or ``rule`` "typical" are lossy, opt-in,
    and reported in the response's metrics with ``lossless: false``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    drafter: str | None = None
    num_draft_tokens: int | None = Field(None, ge=1, le=64)
    draft_length: Literal["fixed", "heuristic", "cost"] | None = None
    rule: Literal["auto", "overaccept", "typical", "coupled"] | None = None
    epsilon: float | None = Field(None, ge=0.0, le=1.0)
    delta: float | None = Field(None, ge=0.0)
    residual: Literal["opt", "uno"] | None = None


class StreamOptions(_Request):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


#: the most ``logprobs`` a completion request may ask for (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5


class _Common(_Request):
    """Fields shared by completions and chat completions. A field this server does not know is refused
    (400 naming it, as OpenAI's own API answers "Unrecognized request argument"), and so is a known field
    it does not honour, unless it has its neutral value (:meth:`check_supported`); fields that do not
    change the answer (``user``, ``store``, ``metadata``, ...) are accepted and ignored.

    ``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` are OpenAI's, applied identically to
    draft and target (:mod:`genspec.sampling`); ``top_k`` and ``repetition_penalty`` are vLLM's."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 0: the most likely token only (greedy)
    top_k: int | None = Field(None, ge=0)  # vLLM's extension
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM's extension
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    # accepted and ignored: they do not change the answer
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        # how many and how long: the server's limits (``genspec serve --max-stop-strings``), checked at admission
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("seed")
    @classmethod
    def _engine_seed(cls, value):
        return None if value is None else value % 2**64  # see the module's docstring

    @field_validator("logit_bias")
    @classmethod
    def _token_bias(cls, value):
        if value is None:
            return None
        low, high = LOGIT_BIAS_RANGE
        bias = {}
        for key, amount in value.items():
            if not key.isdigit():  # OpenAI's keys are token ids as JSON strings
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not low <= amount <= high:
                raise ValueError(f"values must be in [{low:g}, {high:g}], got {amount} for token {key}")
            bias[int(key)] = amount
        return bias

    #: fields this server knows and does not honour -> the values that ask nothing of it
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    def check_supported(self) -> None:
        """Refuse (400 naming the field) a field that would change the answer in a way this server does not
        honour."""
        for name, neutral in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in neutral:
                raise APIError(f"{name} is not supported by this server", param=name, code="unsupported_parameter")

    def top_logprobs_asked(self) -> int | None:
        """The log-probabilities the request asks for: None, or the number of alternatives per token."""
        raise NotImplementedError


class CompletionRequest(_Common):
    # in this order pydantic validates a body of 750,000 token ids (3.4 MB) in 0.07 s, in the order
    # str | list[str] | list[int] | list[list[int]] in 0.22 s (model_validate_json on the 2-core VM),
    # holding the GIL: the other requests wait meanwhile
    prompt: str | list[int] | list[list[int]] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"suffix": (None, "")}

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1, self.n):  # best_of == n returns every sample: nothing is chosen
            raise APIError("best_of other than n is not supported by this server", param="best_of",
                           code="unsupported_parameter")
        if self.echo and self.logprobs is not None:
            raise APIError("echo with logprobs is not supported by this server (the prompt's log-probabilities "
                           "are not computed)", param="echo", code="unsupported_parameter")

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class ChatMessage(_Request):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text (OpenAI content parts of type "text" are joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None  # without tools, nothing to call
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None  # a latency hint: the answer is the same with or without it
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
        "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
        "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
        "reasoning_effort": (None,), "verbosity": (None,)}

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: list[str], logprobs: list[TokenLogprob], top: list[dict[str, float]],
                        offsets: list[int]) -> dict:
    """A completion choice's ``logprobs`` (OpenAI's legacy shape): per token its text, log-probability, the
    ``top`` alternatives (text -> log-probability, the token itself among them) and where its text starts."""
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[TokenLogprob], alternatives: list[list[tuple[str, float]]]) -> dict:
    """A chat choice's ``logprobs``: per token its text, UTF-8 bytes, log-probability and the likeliest
    alternatives, each the same way."""
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(text, lp.logprob), "top_logprobs": [entry(t, v) for t, v in alts]}
                        for text, lp, alts in zip(tokens, logprobs, alternatives)], "refusal": None}


def speculation_metrics(stats: list[RequestStats]) -> dict:
    """vLLM's per-request speculative-decoding figures, pooled over a request's samples (``n``), and
    genspec's ``acceptance``: the rule, its parameters and whether it is lossless (one config per request)."""
    steps = sum(s.target_calls for s in stats)
    drafted = sum(s.drafted_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    histogram: list[int] = []
    for s in stats:
        histogram.extend([0] * (len(s.accepted_length_histogram) - len(histogram)))
        for i, count in enumerate(s.accepted_length_histogram):
            histogram[i] += count
    return {"speculative_decoding": {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "acceptance": stats[0].acceptance if stats else None,
    }}
