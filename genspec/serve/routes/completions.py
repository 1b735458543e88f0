"""``POST /v1/completions``: text completion of one prompt or several (text or token ids)."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from genspec.serve.protocol import CompletionRequest
from genspec.serve.requests import documented_body
from genspec.serve.service import Service, service

router = APIRouter()

#: tokens a completion generates when its request gives no max_tokens (OpenAI's default)
DEFAULT_MAX_TOKENS = 16


@router.post("/v1/completions", openapi_extra=documented_body(CompletionRequest))
async def completions(request: Request, server: Annotated[Service, Depends(service)]):
    body = await server.parse(request, CompletionRequest)
    server.check_model(body.model)
    prompts = await server.prompt_ids(body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    return await server.respond(body, prompts, max_tokens, (), request, chat=False)
