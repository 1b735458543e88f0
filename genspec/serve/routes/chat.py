"""``POST /v1/chat/completions``: a reply to a conversation, rendered by the model's chat template (or
as plain ``Role: text`` paragraphs for a model without one: :func:`~genspec.serve.requests.plain_chat_prompt`)."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from genspec.serve.protocol import ChatCompletionRequest
from genspec.serve.requests import documented_body
from genspec.serve.service import Service, service

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=documented_body(ChatCompletionRequest))
async def chat_completions(request: Request, server: Annotated[Service, Depends(service)]):
    body = await server.parse(request, ChatCompletionRequest)
    server.check_model(body.model)
    ids, extra_stops = await server.chat_prompt(body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await server.respond(body, [ids], max_tokens, extra_stops, request, chat=True)
