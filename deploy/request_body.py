"""Checks on a request's body before FastAPI parses it: size, content type, JSON shape.

``RequestBodyGuard`` is an ASGI middleware. For every HTTP request it refuses, with the
same ``{"detail": [{"loc", "msg", "type"}]}`` shape as FastAPI's validation errors:

- a body larger than ``max_bytes`` (413), from its ``Content-Length`` before reading
  anything, or as soon as a chunked body passes the limit, so a client cannot make the
  server hold more than ``max_bytes`` of one request;
- on the JSON endpoints, a content type other than ``application/json`` (415), and a body
  that is not UTF-8 JSON or is nested deeper than ``safe_read.MAX_DEPTH`` (422: Python's
  ``json`` would otherwise raise ``RecursionError`` on ``[[[[...`` and FastAPI answer 400
  without saying why).

On ``openai_paths`` a refusal has OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``, and a malformed body is a 400, as OpenAI answers it.

A body that passes is replayed to the app unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from megalith.safe_read import UnsafeFileError, loads_json

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 1 << 20  # a full 8k-token context is ~40 KB of text


class BodyRefused(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def error_body(loc: list[str | int], message: str, kind: str) -> dict[str, Any]:
    """FastAPI's error shape: one entry naming where in the request and what was expected."""
    return {"detail": [{"loc": loc, "msg": message, "type": kind}]}


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, which the OpenAI-compatible endpoints answer with."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RequestBodyGuard:
    """Refuse oversized, mistyped or malformed bodies before the app sees them."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        json_paths: Collection[str],
        openai_paths: Collection[str] = (),
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.json_paths = frozenset(json_paths) | frozenset(openai_paths)
        self.openai_paths = frozenset(openai_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if scope["path"] in self.json_paths:
                _check_json(scope, body)
        except BodyRefused as refused:
            await _answer(send, refused, scope["path"] in self.openai_paths)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _too_large(self) -> BodyRefused:
        message = f"request body is larger than this server's {self.max_bytes}-byte limit"
        return BodyRefused(413, message, "value_error.body_too_large")


def _check_json(scope: Scope, body: bytes) -> None:
    content_type = (_header(scope, b"content-type") or "").lower()
    media, _, params = content_type.partition(";")
    charset = params.partition("charset=")[2].strip().strip('"')
    if media.strip() != "application/json" or charset not in ("", "utf-8", "utf8"):
        shown = content_type or "none"
        message = f"content type is {shown[:80]!r}; expected 'application/json' (UTF-8)"
        raise BodyRefused(415, message, "value_error.content_type")
    if not body:
        return  # FastAPI names the missing fields
    try:
        loads_json(body, "request body")
    except UnsafeFileError as error:
        raise BodyRefused(422, str(error), "value_error.json_invalid") from None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _answer(send: Send, refused: BodyRefused, openai_shape: bool) -> None:
    body = error_body(["body"], str(refused), refused.kind)
    status = refused.status
    if openai_shape:
        status = 400 if status == 422 else status
        body = openai_error(status, str(refused), None, refused.kind.removeprefix("value_error."))
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),  # the unread rest of a refused body must not be parsed
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
