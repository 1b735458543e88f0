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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from genspec.engine import RequestStats


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
    ``1e309`` as infinity and accepts ``NaN``), and pydantic says which field is not."""

    model_config = ConfigDict(allow_inf_nan=False)


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


class _Common(_Request):
    """Fields shared by completions and chat completions. Unknown fields are ignored (as OpenAI's
    own server does for fields it does not know); known fields are checked."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # vLLM's extension
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM's extension
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    speculative: SpeculativeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("seed")
    @classmethod
    def _engine_seed(cls, value):
        return None if value is None else value % 2**64  # see the module's docstring

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value:
            raise ValueError("logprobs are not supported by this server")
        return value


class CompletionRequest(_Common):
    # in this order pydantic validates a body of 750,000 token ids (3.4 MB) in 0.07 s, in the order
    # str | list[str] | list[int] | list[list[int]] in 0.22 s (model_validate_json on the 2-core VM),
    # holding the GIL: the other requests wait meanwhile
    prompt: str | list[int] | list[list[int]] | list[str]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty")
        return value


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


# ------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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
