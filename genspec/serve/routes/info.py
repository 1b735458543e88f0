"""What a server tells about itself: ``GET /health`` (503 once it is shutting down), ``GET /metrics``
(Prometheus), ``GET /v1/models`` (the served model, its context and the drafters a request may choose)
and ``GET /``, the playground page."""
from __future__ import annotations

from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse, Response

from genspec.serve.protocol import now
from genspec.serve.service import Service, service

router = APIRouter()


@router.get("/health")
async def health(server: Annotated[Service, Depends(service)]):
    if not server.worker.accepting:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(server: Annotated[Service, Depends(service)]):
    return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(server: Annotated[Service, Depends(service)]):
    worker = server.worker
    return {"object": "list", "data": [{
        "id": server.settings.model_name, "object": "model", "created": now(), "owned_by": "genspec",
        "max_model_len": worker.max_context, "default_drafter": worker.default_drafter, "drafters": worker.drafters}]}


@router.get("/", response_class=HTMLResponse)
async def playground():
    return resources.files("genspec.serve").joinpath("static/index.html").read_text(encoding="utf-8")
