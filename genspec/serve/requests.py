"""From an HTTP request to what the engine runs, shared by the completion and chat routes: the body read
within its size limit (:func:`read_body`) and parsed (:func:`parse_body`), the prompts as token ids
(:func:`prompt_ids`, :func:`chat_prompt`), and the request's fields as a
:class:`~genspec.engine.GenerationConfig` (:func:`generation_config`).

The routes parse their bodies here rather than let FastAPI do it, which would parse them on the event
loop, read them whole whatever their size, and answer some faults in its own shape.
"""
from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from genspec.engine import NO_DRAFTER, GenerationConfig
from genspec.errors import GenspecError
from genspec.serve.errors import invalid_request, too_large
from genspec.serve.protocol import APIError, ChatMessage

#: the text format for models without a chat template
PLAIN_CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, refused with 413 when it is larger than ``max_bytes``: before any of it is
    read if its Content-Length says so, else as soon as the bytes received pass it (a chunked body
    announces no length)."""
    try:
        announced = int(request.headers.get("content-length", "0"))
    except ValueError:
        announced = 0
    if announced > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # gone (or closed for reading too slowly) before its body arrived: not a server error
        raise APIError("the connection closed before the request body arrived", code="client_disconnected") from None
    return b"".join(chunks)


def parse_body(model: type[BaseModel], raw: bytes):
    """A request of type ``model`` from its body (the JSON parser limits nesting depth)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not UTF-8 text (byte {exc.start} is not)") from None
    try:
        body = model.model_validate_json(text)
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None
    body.check_supported()
    return body


def documented_body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses ``model`` itself (FastAPI then does not declare it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def prompt_ids(tokenizer, prompt: str | list[int] | list[list[int]] | list[str]) -> list[list[int]]:
    """A completion request's prompts as token ids (CPU work: call it in the thread pool)."""
    if isinstance(prompt, str):
        prompts = [encode(tokenizer, prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [encode(tokenizer, p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if any(not p for p in prompts):
        raise APIError("prompt is empty", param="prompt")
    return prompts


def plain_chat_prompt(messages: list[tuple[str, str]]) -> tuple[str, list[str]]:
    """``Role: text`` paragraphs and a final ``Assistant:``, and the stop string that ends the reply
    (the model starting the user's next turn)."""
    lines = [f"{PLAIN_CHAT_ROLES[role]}: {text}" for role, text in messages]
    return "\n\n".join(lines + ["Assistant:"]), ["\n\nUser:"]


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> tuple[list[int], tuple[str, ...]]:
    """A chat's prompt as token ids, and the stop strings its rendering adds: the model's chat template,
    else :func:`plain_chat_prompt` (CPU work: call it in the thread pool)."""
    turns = [(m.role, m.text()) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in turns],
                                             tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), ()
    text, stops = plain_chat_prompt(turns)
    return encode(tokenizer, text), tuple(stops)


def generation_config(body, prompt_tokens: int, max_tokens: int | None, extra_stops: list[str],
                      context: int | None, default_max_tokens: int) -> GenerationConfig:
    """What the engine runs for one prompt of ``prompt_tokens`` tokens of a completion or chat request
    ``body``: its sampling, stop strings (and ``extra_stops``, a chat rendering's own) and
    ``speculative`` options; ``max_tokens`` it asked for (None: ``default_max_tokens``, within the
    model's ``context``). A prompt or request past the context, or options the engine refuses, are 400s."""
    if context is not None and prompt_tokens >= context:
        raise APIError(f"This model's maximum context length is {context} tokens, but the prompt has "
                       f"{prompt_tokens} tokens", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = default_max_tokens if context is None else min(default_max_tokens, context - prompt_tokens)
    if context is not None and prompt_tokens + max_tokens > context:
        raise APIError(f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for "
                       f"the completion)", param="max_tokens", code="context_length_exceeded")
    speculative = body.speculative
    options = {}
    if speculative is not None:
        if not speculative.enabled:
            options["drafter"] = NO_DRAFTER
        elif speculative.drafter is not None:
            options["drafter"] = speculative.drafter
        if speculative.num_draft_tokens is not None:
            options["num_draft_tokens"] = speculative.num_draft_tokens
        if speculative.draft_length is not None:
            options["draft_length"] = speculative.draft_length
        options.update(speculative.model_dump(include={"rule", "epsilon", "delta", "residual"}, exclude_none=True))
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            repetition_penalty=body.repetition_penalty or 1.0, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, logit_bias=body.logit_bias or {}, seed=body.seed,
            logprobs=body.top_logprobs_asked(), stop_strings=tuple(body.stop or ()) + tuple(extra_stops), **options)
    except GenspecError as exc:
        raise APIError(str(exc)) from exc
