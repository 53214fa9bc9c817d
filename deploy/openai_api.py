"""The OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

A request becomes one engine row per choice (``n`` per prompt, choice ``j`` seeded with
``seed + j``), decoded with everyone else's requests. Stop strings are looked for in the
decoded text as tokens arrive: the text ends before the first one found (left out), the
row is stopped, and ``finish_reason`` is ``stop``, as for the end of text (EOD) or a
chat's end of turn; ``length`` when ``max_tokens`` is reached; ``timeout`` when the
server's time limit ends the row first (an extension: OpenAI has no such reason). A
full queue (``--max-queue``) answers 429 with ``Retry-After: 1``, which the OpenAI client
retries.

Streaming sends OpenAI's chunks (``text_completion`` / ``chat.completion.chunk``) as
Server-Sent Events, then ``data: [DONE]``; text that could be the start of a stop string,
or half of a character, is held back until the next token settles it, so the streamed
deltas add up to the text a non-streamed request gets. ``stream_options.include_usage``
adds a last chunk with ``usage`` and no choices.

Log-probabilities (completions: ``logprobs: N``; chat: ``logprobs: true`` and
``top_logprobs: N``) are the model's raw next-token distribution
(:mod:`training.inference.decode`); a token is shown as the bytes it stands for
(``Tokenizer.token_bytes``: a SentencePiece piece with ``▁`` as a space, a byte-fallback
piece ``<0xNN>`` as its byte, a byte-level BPE token's bytes) decoded as UTF-8, U+FFFD for
part of a character; ``bytes`` has the bytes.

``usage`` counts a prompt's tokens once per prompt (special tokens included) and every
choice's generated tokens, up to the one completing a stop string.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from deploy.deployment import RETRY_AFTER_S, AnswerText, Deployment, Row, TokenStream
from deploy.engine import EngineBusy, Finished
from deploy.openai_schema import (
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    OpenAIError,
    choices,
    model_ids,
)
from deploy.request_body import openai_error
from deploy.schema import sse
from preprocessing.tokenizer import Tokenizer
from training.inference.decode import SampledToken
from training.inference.loading import ServedModel

FINISH_REASONS = {"eod": "stop", "stop": "stop", "length": "length", "timeout": "timeout"}
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
Request = CompletionRequest | ChatCompletionRequest


def add_routes(app: FastAPI, deployment: Deployment) -> None:
    """Serve the OpenAI-compatible endpoints of ``deployment`` on ``app``."""

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        served = deployment.engine.served
        info = served.info
        model = {
            "id": info.name,
            "object": "model",
            "created": int(info.loaded_at),
            "owned_by": "megalith",
            "max_model_len": info.max_positions,
            "version": info.version,
            "alias": info.alias,
            "aliases": model_ids(served)[1:],
        }
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> JSONResponse | StreamingResponse:
        return await answer(deployment, body)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        return await answer(deployment, body)


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def answer(deployment: Deployment, body: Request) -> JSONResponse | StreamingResponse:
    """Queue every choice of ``body``; answer them whole, or stream them."""
    stream = TokenStream()
    config = deployment.config

    def plan(served: ServedModel) -> tuple[list[Choice], list[Row], float]:
        planned = choices(body, served, config.max_tokens)
        return planned, [(c.prompt_ids, c.sampling) for c in planned], config.timeout_s

    try:
        served, planned = deployment.submit(plan, stream)
    except OpenAIError as error:
        return error_response(error)
    except EngineBusy as busy:
        busy_error = OpenAIError(429, f"server busy: {busy}", None, "queue_full")
        return JSONResponse(
            busy_error.body(), status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    reply = Reply(body, served, planned)
    if body.stream:
        return StreamingResponse(
            reply.chunks(stream, config.timeout_s), media_type="text/event-stream"
        )
    try:
        async for index, item in stream.events(config.timeout_s):
            reply.take(index, item, stream)
    except asyncio.TimeoutError:
        return error_response(
            OpenAIError(504, "generation did not answer in time", None, "timeout")
        )
    except Exception as error:
        return error_response(OpenAIError(500, f"generation failed: {error}", None, "server_error"))
    return JSONResponse(reply.whole())


class ChoiceText:
    """One choice's tokens as they arrive, and its text with the stop strings applied."""

    def __init__(self, served: ServedModel, choice: Choice, stops: tuple[str, ...]) -> None:
        self.choice = choice
        self.answer = AnswerText(served, choice.prompt_ids)
        self.stops = stops
        self.tokens: list[SampledToken] = []
        self.offsets: list[int] = []  # where each token's text starts in the full text
        self.full = ""  # the decoded answer, before any stop string is cut
        self.text = ""  # the answer: up to the first stop string
        self.finish: str | None = None
        self.sent = ""  # the text streamed so far
        self.tokens_sent = 0
        self.closed = False  # its last chunk is sent

    def push(self, token: SampledToken) -> bool:
        """Add a token; True when it completes a stop string (the choice is then done)."""
        if self.finish is not None:
            return False  # generated after the stop string, before the row stopped
        self.offsets.append(len(self.full))
        self.tokens.append(token)
        self.full = self.answer.push(token.id)
        cut = _first_stop(self.full, self.stops)
        self.text = self.full if cut is None else self.full[:cut]
        if cut is not None:
            self.finish = "stop"
        return cut is not None

    def end(self, finished: Finished) -> None:
        if self.finish is None:
            self.finish = FINISH_REASONS.get(finished.finish_reason, finished.finish_reason)

    def delta(self) -> str:
        """The text not streamed yet that no later token can change or cut."""
        text = self.text
        if self.finish is None:
            text = text[: len(text) - _held_back(text, self.stops)].rstrip("\ufffd")
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def new_tokens(self) -> list[SampledToken]:
        """The tokens not streamed yet (their log-probabilities go with the next chunk)."""
        new, self.tokens_sent = self.tokens[self.tokens_sent :], len(self.tokens)
        return new


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that starts a stop string."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return held


class Reply:
    """The answer to one request: its choices, and its OpenAI JSON, whole or as chunks."""

    def __init__(self, body: Request, served: ServedModel, planned: list[Choice]) -> None:
        self.body = body
        self.served = served
        self.chat = isinstance(body, ChatCompletionRequest)
        self.choices = [ChoiceText(served, choice, body.stops) for choice in planned]
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.prompt_tokens = sum(len(c.prompt_ids) for c in planned if c.index % body.n == 0)
        if self.chat:
            self.top = (body.top_logprobs or 0) if body.logprobs else None
        else:
            self.top = body.logprobs

    def take(self, index: int, item: SampledToken | Finished, stream: TokenStream) -> None:
        choice = self.choices[index]
        if isinstance(item, Finished):
            choice.end(item)
        elif choice.push(item):
            stream.cancel(index)  # a stop string: end the row at the engine's next step

    # --- whole answers ----------------------------------------------------------------

    def whole(self) -> dict[str, Any]:
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [self._whole_choice(c) for c in self.choices],
            "usage": self.usage(),
        }

    def _whole_choice(self, choice: ChoiceText) -> dict[str, Any]:
        logprobs = self._logprobs(choice, choice.tokens, 0)
        out: dict[str, Any] = {"index": choice.choice.index}
        if self.chat:
            out["message"] = {"role": "assistant", "content": choice.text}
        else:
            out["text"] = choice.text
        return {**out, "logprobs": logprobs, "finish_reason": choice.finish}

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.tokens) for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def _head(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.served.info.name,
            "system_fingerprint": "fp_" + self.served.info.content_id[:12],
        }

    # --- streaming --------------------------------------------------------------------

    async def chunks(self, stream: TokenStream, timeout_s: float) -> AsyncIterator[bytes]:
        if self.chat:
            for choice in self.choices:
                delta = {"role": "assistant", "content": ""}
                yield self._chunk(choice, delta, None, None)
        try:
            async for batch in stream.batches(timeout_s):
                touched: dict[int, ChoiceText] = {}
                for index, item in batch:
                    self.take(index, item, stream)
                    touched[index] = self.choices[index]
                # One chunk a choice for everything that arrived together: under load a
                # request's tokens pile up between the loop's visits, and a chunk each
                # would cost the loop the same work per token that it is behind on.
                for choice in touched.values():
                    if (chunk := self._next_chunk(choice)) is not None:
                        yield chunk
        except asyncio.TimeoutError:
            yield _error_event(504, "generation did not answer in time", "timeout")
        except Exception as error:
            yield _error_event(500, f"generation failed: {error}", "server_error")
        else:
            if self.body.include_usage:
                yield sse({**self._head(self._chunk_kind()), "choices": [], "usage": self.usage()})
        yield sse("[DONE]")

    def _next_chunk(self, choice: ChoiceText) -> bytes | None:
        """The chunk of what ``choice`` got since its last one: new text and
        log-probabilities, and its end (at a stop string, or when its row ends)."""
        if choice.closed:
            return None  # a token after the stop string, or the stopped row's end
        done = choice.finish is not None
        text = choice.delta()
        tokens = choice.new_tokens()
        if not (text or tokens or done):
            return None
        choice.closed = done
        logprobs = self._logprobs(choice, tokens, choice.tokens_sent - len(tokens))
        delta: dict[str, Any] = {"content": text} if self.chat else {"text": text}
        if self.chat and not text:
            delta = {}
        return self._chunk(choice, delta, logprobs, choice.finish)

    def _chunk(
        self, choice: ChoiceText, delta: dict[str, Any], logprobs: Any, finish: str | None
    ) -> bytes:
        entry: dict[str, Any] = {"index": choice.choice.index}
        entry.update({"delta": delta} if self.chat else delta)
        entry.update({"logprobs": logprobs, "finish_reason": finish})
        return sse({**self._head(self._chunk_kind()), "choices": [entry]})

    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    # --- log-probabilities ------------------------------------------------------------

    def _logprobs(
        self, choice: ChoiceText, tokens: list[SampledToken], start: int
    ) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object for ``tokens`` (from index ``start`` of the choice)."""
        if self.top is None:
            return None
        tokenizer = self.served.tokenizer
        if self.chat:
            return {"content": [_chat_logprob(tokenizer, token) for token in tokens]}
        return {
            "tokens": [token_text(tokenizer, t.id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [_top_by_text(tokenizer, t) for t in tokens],
            "text_offset": choice.offsets[start : start + len(tokens)],
        }


def _top_by_text(tokenizer: Tokenizer, token: SampledToken) -> dict[str, float]:
    """The legacy completions format, keyed by text: of two alternatives that show the
    same text (two partial bytes) the more likely one is kept."""
    top: dict[str, float] = {}
    for i, value in token.top_logprobs:
        top.setdefault(token_text(tokenizer, i), value)
    return top


def _chat_logprob(tokenizer: Tokenizer, token: SampledToken) -> dict[str, Any]:
    text = token_text(tokenizer, token.id)
    top = [
        {"token": token_text(tokenizer, i), "logprob": v, "bytes": list(tokenizer.token_bytes(i))}
        for i, v in token.top_logprobs
    ]
    return {
        "token": text,
        "logprob": token.logprob,
        "bytes": list(tokenizer.token_bytes(token.id)),
        "top_logprobs": top,
    }


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as logprobs show it: its bytes (:meth:`Tokenizer.token_bytes`: SentencePiece's
    ``▁`` as a space, a byte piece ``<0xNN>`` or a byte-level BPE's ``Ġ`` as their bytes) as
    text, U+FFFD for part of a character."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _error_event(status: int, message: str, code: str) -> bytes:
    return sse(openai_error(status, message, None, code))
