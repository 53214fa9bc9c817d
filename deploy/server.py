"""The HTTP generation server (FastAPI): generate, stream, report the model, reload it.

Endpoints:

- ``POST /v1/generate``: ``{"prompt", "max_tokens", "temperature", "top_k", "top_p",
  "seed", "stream", "timeout_s"}`` (``deploy.schema.GenerateRequest``) returns ``{"text",
  "prompt_tokens", "completion_tokens", "finish_reason", "seed", "model"}``. With
  ``"stream": true`` it answers ``text/event-stream``: one ``data: {"text": delta,
  "token_id": id}`` event per token, then ``data: {...}`` with the whole response and
  ``"done": true``, then ``data: [DONE]``.
- ``POST /v1/chat``: ``{"messages": [{"role", "content"}, ...]}`` plus the same sampling
  fields (``deploy.schema.ChatRequest``); the reply to the last turn, through the chat
  template the model was fine-tuned with, stopping at ``<|end|>``. Same answers.
- ``GET /health``, ``GET /v1/model`` (source, name, version, alias, content id, limits).
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
Errors: 422 for a bad body (FastAPI's ``detail`` list naming the field: types, ranges, NaN,
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
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from deploy.continuous import ContinuousEngine
from deploy.engine import BatchingEngine, EngineBusy, EngineClosed, Finished, PendingRequest
from deploy.request_body import DEFAULT_MAX_BODY_BYTES, RequestBodyGuard
from deploy.schema import (
    ChatRequest,
    GenerateRequest,
    Prepared,
    RequestRejected,
    prepare,
    sse,
)
from megalith.errors import MegalithError
from training.inference.decode import SampledToken
from training.inference.loading import ServedModel, load_served_model, source_version
from training.inference.runtime import AUTOCAST_DTYPES, resolve_precision
from training.runtime.device import resolve_device

log = logging.getLogger(__name__)

STUCK_GRACE_S = 5.0
RETRY_AFTER_S = 1  # what a 429 (the queue is full) tells a client to wait
MAX_ERRORS_SHOWN = 10  # a body with 10,000 unknown keys needs no 10,000-line answer


@dataclass(frozen=True)
class ServeConfig:
    """``megalith serve``'s settings (its flags have the same names)."""

    model: str  # models:/NAME@ALIAS, models:/NAME/VERSION or a package directory
    tracking_uri: str | None = None
    device: str = "cpu"
    precision: str = "fp32"  # fp32, bf16 or fp16 autocast
    max_tokens: int = 256  # the most tokens one request may ask for
    timeout_s: float = 60.0  # the longest a request may run
    engine: str = "continuous"  # continuous (GPT; a T5 is served statically) or static
    max_batch_size: int = 8  # static
    batch_window_ms: float = 5.0  # static
    max_running: int = 64  # continuous: sequences decoding at once
    block_size: int = 16  # continuous: positions per KV block
    kv_blocks: int | None = None  # continuous: KV blocks; None: max_running full contexts
    prefill_chunk: int = 512  # continuous: most prompt tokens read in one step
    max_queue: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies answer 413
    watch_s: float | None = None  # reload when the alias moves, checked this often
    # /admin/reload wants "Authorization: Bearer TOKEN" when set (MEGALITH_ADMIN_TOKEN).
    admin_token: str | None = field(default=None, repr=False)


Engine = BatchingEngine | ContinuousEngine
ENGINES = ("continuous", "static")


class Deployment:
    """The engine serving the current model, and the swap to a new one."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.autocast_dtype = AUTOCAST_DTYPES[resolve_precision(config.precision, self.device)]
        self.engine = self._start(self._load())
        self.reloads = 0
        self._reload_lock = asyncio.Lock()

    def _load(self) -> ServedModel:
        return load_served_model(
            self.config.model, tracking_uri=self.config.tracking_uri, device=self.device
        )

    def _start(self, served: ServedModel) -> Engine:
        config = self.config
        if config.engine not in ENGINES:
            raise ValueError(f"engine {config.engine!r} is not one of {', '.join(ENGINES)}")
        if config.engine == "continuous" and not served.seq2seq:
            return ContinuousEngine(
                served,
                block_size=config.block_size,
                num_blocks=config.kv_blocks,
                max_running=config.max_running,
                prefill_chunk=config.prefill_chunk,
                max_queue=config.max_queue,
                autocast_dtype=self.autocast_dtype,
            ).start()
        return BatchingEngine(
            served,
            max_batch_size=config.max_batch_size,
            batch_window_s=config.batch_window_ms / 1000,
            max_queue=config.max_queue,
            autocast_dtype=self.autocast_dtype,
        ).start()

    async def reload(self) -> dict[str, Any]:
        """Serve what the source names now; a no-op when that is the version served."""
        async with self._reload_lock:
            old = self.engine
            version = await asyncio.to_thread(
                source_version, self.config.model, tracking_uri=self.config.tracking_uri
            )
            if version is not None and version == old.served.info.version:
                return {"reloaded": False, "model": old.served.info.to_dict()}
            served = await asyncio.to_thread(self._load)
            if served.info.content_id == old.served.info.content_id:
                return {"reloaded": False, "model": old.served.info.to_dict()}
            self.engine = self._start(served)  # new requests go to the new model from here
            old.retire()  # the old one finishes what it holds, then its thread ends
            self.reloads += 1
            log.info("now serving %s (was %s)", served.info, old.served.info)
            return {
                "reloaded": True,
                "model": served.info.to_dict(),
                "previous": old.served.info.to_dict(),
            }

    async def watch(self) -> None:
        """Reload every ``watch_s`` seconds when the source points elsewhere."""
        while True:
            await asyncio.sleep(self.config.watch_s or 0)
            try:
                await self.reload()
            except Exception:  # keep serving the current model; try again next time
                log.exception("reload of %s failed", self.config.model)

    def submit(
        self, body: GenerateRequest | ChatRequest, stream: TokenStream
    ) -> tuple[ServedModel, Prepared]:
        """Validate ``body`` against the current model and queue it there."""
        while True:
            engine = self.engine
            prepared = prepare(
                body,
                engine.served,
                max_tokens_limit=self.config.max_tokens,
                timeout_s=self.config.timeout_s,
            )
            stream.request = PendingRequest(
                prepared.prompt_ids,
                prepared.sampling,
                time.monotonic() + prepared.timeout_s,
                stream.on_token,
                stream.on_done,
            )
            try:
                engine.submit(stream.request)
            except EngineClosed:
                continue  # swapped meanwhile: go to the new engine
            return engine.served, prepared

    def close(self) -> None:
        self.engine.retire()
        self.engine.join(timeout=STUCK_GRACE_S)


class TokenStream:
    """Carries a request's tokens from the engine's thread to the event loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[SampledToken | Finished | BaseException] = asyncio.Queue()
        self.request: PendingRequest | None = None
        self.done = False

    def on_token(self, token: SampledToken) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, token)

    def on_done(self, result: Finished | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, result)

    async def events(self, timeout_s: float) -> AsyncIterator[SampledToken | Finished]:
        """Tokens, then the ``Finished`` record; ``TimeoutError`` if the engine is stuck."""
        deadline = time.monotonic() + timeout_s + STUCK_GRACE_S
        try:
            while True:
                item = await asyncio.wait_for(self._queue.get(), deadline - time.monotonic())
                if isinstance(item, BaseException):
                    self.done = True
                    raise item
                if isinstance(item, Finished):
                    self.done = True  # before the yield: the caller may stop iterating there
                    yield item
                    return
                yield item
        finally:
            if not self.done and self.request is not None:
                self.request.cancelled.set()  # the client left, or we gave up: stop its row


class TextDelta:
    """The text each new token adds, for streaming (held back while a character is split)."""

    def __init__(self, served: ServedModel, prompt_ids: list[int]) -> None:
        self.served = served
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.served.text(self.prompt_ids, self.ids)
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
        info = deployment.engine.served.info.to_dict()
        return {**info, "limits": limits, "stats": stats, "reloads": deployment.reloads}

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

    return app


async def _invalid_request(_: Request, error: Exception) -> JSONResponse:
    """FastAPI's 422, without echoing the input: it may be megabytes, or NaN, which JSON
    cannot carry (the default handler then fails with a 500)."""
    assert isinstance(error, RequestValidationError)
    detail = [
        {"loc": [_short(part) for part in item["loc"]], "msg": item["msg"], "type": item["type"]}
        for item in error.errors()[:MAX_ERRORS_SHOWN]
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
    try:
        served, prepared = deployment.submit(body, stream)
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
        async for item in stream.events(prepared.timeout_s):
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
        async for item in stream.events(prepared.timeout_s):
            if isinstance(item, Finished):
                yield sse({**response_body(served, prepared, item), "done": True})
            else:
                yield sse({"text": delta.push(item.id), "token_id": item.id})
    except asyncio.TimeoutError:
        yield sse({"detail": "generation did not answer in time"}, event="error")
    except Exception as error:
        yield sse({"detail": f"generation failed: {error}"}, event="error")
    yield sse("[DONE]")
