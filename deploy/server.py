"""The HTTP generation server (FastAPI): generate, stream, report the model, reload it.

Endpoints (docs/serving.md has the user's guide):

- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``: the
  OpenAI-compatible API (``deploy.openai_api``), errors in OpenAI's shape.
- ``GET /metrics``: Prometheus metrics (``deploy.metrics``).

- ``POST /v1/generate``: ``{"prompt", "max_tokens", "temperature", "top_k", "top_p",
  "seed", "stream", "timeout_s"}`` (``deploy.schema.GenerateRequest``) returns ``{"text",
  "prompt_tokens", "completion_tokens", "finish_reason", "seed", "model"}``. With
  ``"stream": true`` it answers ``text/event-stream``: one ``data: {"text": delta,
  "token_id": id}`` event per token, then ``data: {...}`` with the whole response and
  ``"done": true``, then ``data: [DONE]``.
- ``POST /v1/chat``: ``{"messages": [{"role", "content"}, ...]}`` plus the same sampling
  fields (``deploy.schema.ChatRequest``); the reply to the last turn, through the chat
  template the model was fine-tuned with, stopping at ``<|end|>``. Same answers.
- ``GET /health``, ``GET /v1/model`` (source, name, version, alias, content id, limits;
  a package directory is named, not shown by its path).
- ``POST /admin/reload``: load what the source names now (the alias's current version)
  beside the model being served, swap, and let requests already submitted finish on the
  old model (the engine's ``retire``). ``--watch SECONDS`` does the same on a timer.

A GPT is served by continuous batching over a paged KV cache (``deploy.continuous``,
``ServeConfig.engine = "continuous"``, the default); a T5, or any model with
``engine = "static"``, by the static batching engine (``deploy.engine``).

Finish reasons: ``eod`` (the model ended the text), ``stop`` (a chat reply's end of
turn), ``length`` (``max_tokens`` reached),
``timeout`` (the request's time limit passed: the answer is 200 with the text generated
so far; a request that timed out while waiting has no text). 504 is only answered when
the engine gives no answer at all within the limit plus ``STUCK_GRACE_S``.
Errors of the two endpoints above: 422 for a bad body (FastAPI's ``detail`` list naming the field: types, ranges, NaN,
``Infinity``, invalid or too deeply nested JSON), 415 for a body that is not
``application/json``, 413 for a body over ``max_body_bytes`` (refused before it is read
whole: ``deploy.request_body``) or a prompt that fills the model's context, 429 with
``Retry-After`` when ``--max-queue`` requests already wait, 409 for a reload that cannot load (the alias is
gone, a file is altered): the old model stays.

``/admin/reload`` asks for ``Authorization: Bearer TOKEN`` when the server has an admin
token (``MEGALITH_ADMIN_TOKEN``; 401 otherwise) and is open without one. The server binds
127.0.0.1 unless told otherwise; generation itself has no authentication, so put a proxy
that checks callers in front of a server other hosts reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deploy import openai_api
from deploy.deployment import (
    RETRY_AFTER_S,
    AnswerText,
    Deployment,
    Row,
    ServeConfig,
    TokenStream,
    public_info,
)
from deploy.engine import EngineBusy, Finished
from deploy.metrics import CONTENT_TYPE, RequestCounter
from deploy.openai_schema import validation_error
from deploy.request_body import RequestBodyGuard
from deploy.schema import ChatRequest, GenerateRequest, Prepared, RequestRejected, prepare, sse
from megalith.errors import MegalithError
from training.inference.loading import ServedModel

__all__ = ["Deployment", "ServeConfig", "TokenStream", "create_app"]

MAX_ERRORS_SHOWN = 10  # a body with 10,000 unknown keys needs no 10,000-line answer


class TextDelta:
    """The text each new token adds, for streaming (held back while a character is split)."""

    def __init__(self, served: ServedModel, prompt_ids: list[int]) -> None:
        self.answer = AnswerText(served, prompt_ids)
        self.sent = ""

    def push(self, token: int) -> str:
        text = self.answer.push(token)
        if not text.startswith(self.sent) or text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def response_body(served: ServedModel, prepared: Prepared, finished: Finished) -> dict[str, Any]:
    text = served.text(prepared.prompt_ids, finished.token_ids)
    return {
        "text": text,
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": len(finished.token_ids),
        "finish_reason": finished.finish_reason,
        "seed": prepared.sampling.seed,
        "model": {
            "name": served.info.name,
            "version": served.info.version,
            "content_id": served.info.content_id,
        },
    }


def create_app(deployment: Deployment) -> FastAPI:
    """The FastAPI app serving ``deployment`` (already loaded: bad sources fail before)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(deployment.watch()) if deployment.config.watch_s else None
        yield
        if watcher is not None:
            watcher.cancel()
        await asyncio.to_thread(deployment.close)

    app = FastAPI(title="Megalith generation server", lifespan=lifespan)
    app.state.deployment = deployment
    app.add_middleware(
        RequestBodyGuard,
        max_bytes=deployment.config.max_body_bytes,
        json_paths=("/v1/generate", "/v1/chat"),
        openai_paths=openai_api.OPENAI_PATHS,
    )
    app.add_exception_handler(RequestValidationError, _invalid_request)

    @app.get("/health")
    def health() -> dict[str, Any]:
        engine = deployment.engine
        return {"status": "ok", "version": engine.served.info.version, "queued": engine.queued}

    @app.get("/v1/model")
    def model_info() -> dict[str, Any]:
        private = ("model", "tracking_uri", "admin_token")
        limits = {k: v for k, v in asdict(deployment.config).items() if k not in private}
        stats = asdict(deployment.engine.stats)
        info = public_info(deployment.engine.served)
        return {**info, "limits": limits, "stats": stats, "reloads": deployment.reloads}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(deployment.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/admin/reload", response_model=None)
    async def reload(authorization: str = Header(default="")) -> dict[str, Any] | JSONResponse:
        if not _authorized(deployment.config.admin_token, authorization):
            return JSONResponse(
                {"detail": "reload needs the header 'Authorization: Bearer <admin token>'"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            return await deployment.reload()
        except MegalithError as error:  # unknown alias, bad files: keep serving the old model
            return JSONResponse({"detail": f"reload failed: {error}"}, status_code=409)

    @app.post("/v1/generate", response_model=None)
    async def generate(body: GenerateRequest) -> JSONResponse | StreamingResponse:
        return await _answer(deployment, body)

    @app.post("/v1/chat", response_model=None)
    async def chat(body: ChatRequest) -> JSONResponse | StreamingResponse:
        return await _answer(deployment, body)

    openai_api.add_routes(app, deployment)
    paths = [route.path for route in app.routes if hasattr(route, "path")]
    app.add_middleware(RequestCounter, metrics=deployment.metrics, paths=paths)  # outermost
    return app


async def _invalid_request(request: Request, error: Exception) -> JSONResponse:
    """FastAPI's 422, without echoing the input: it may be megabytes, or NaN, which JSON
    cannot carry (the default handler then fails with a 500). The OpenAI endpoints answer
    400 in OpenAI's error shape instead."""
    assert isinstance(error, RequestValidationError)
    errors = list(error.errors())
    if request.url.path in openai_api.OPENAI_PATHS:
        return openai_api.error_response(validation_error(errors, MAX_ERRORS_SHOWN))
    detail = [
        {"loc": [_short(part) for part in item["loc"]], "msg": item["msg"], "type": item["type"]}
        for item in errors[:MAX_ERRORS_SHOWN]
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def _short(part: str | int) -> str | int:
    return part if isinstance(part, int) or len(part) <= 80 else part[:77] + "..."


def _authorized(token: str | None, authorization: str) -> bool:
    if token is None:
        return True
    return hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


async def _answer(
    deployment: Deployment, body: GenerateRequest | ChatRequest
) -> JSONResponse | StreamingResponse:
    """Queue ``body`` and answer it whole, or stream it."""
    stream = TokenStream()
    config = deployment.config

    def plan(served: ServedModel) -> tuple[Prepared, list[Row], float]:
        prepared = prepare(
            body, served, max_tokens_limit=config.max_tokens, timeout_s=config.timeout_s
        )
        return prepared, [(prepared.prompt_ids, prepared.sampling)], prepared.timeout_s

    try:
        served, prepared = deployment.submit(plan, stream)
    except RequestRejected as rejected:
        return JSONResponse({"detail": rejected.detail}, status_code=rejected.status)
    except EngineBusy as busy:
        return JSONResponse(
            {"detail": f"server busy: {busy}"},
            status_code=429,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if body.stream:
        events = _sse_events(stream, served, prepared)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        async for _, item in stream.events(prepared.timeout_s):
            if isinstance(item, Finished):
                return JSONResponse(response_body(served, prepared, item))
    except asyncio.TimeoutError:
        return JSONResponse({"detail": "generation did not answer in time"}, status_code=504)
    except Exception as error:
        return JSONResponse({"detail": f"generation failed: {error}"}, status_code=500)
    raise AssertionError("the engine ended a request without a result")


async def _sse_events(
    stream: TokenStream, served: ServedModel, prepared: Prepared
) -> AsyncIterator[bytes]:
    delta = TextDelta(served, prepared.prompt_ids)
    try:
        async for _, item in stream.events(prepared.timeout_s):
            if isinstance(item, Finished):
                yield sse({**response_body(served, prepared, item), "done": True})
            else:
                yield sse({"text": delta.push(item.id), "token_id": item.id})
    except asyncio.TimeoutError:
        yield sse({"detail": "generation did not answer in time"}, event="error")
    except Exception as error:
        yield sse({"detail": f"generation failed: {error}"}, event="error")
    yield sse("[DONE]")
