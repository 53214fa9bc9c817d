"""The generation requests: their JSON schemas, and the checks that need the model and limits.

``POST /v1/generate`` continues a plain ``prompt``; ``POST /v1/chat`` answers ``messages``
through the chat template the model was fine-tuned with (``preprocessing.chat``): the
turns, then ``<|assistant|>``, stopping at ``<|end|>``. Both share the sampling fields.

Pydantic checks the body itself (unknown fields, types, an empty prompt, ranges) and
FastAPI answers 422 with ``{"detail": [{"loc": ["body", FIELD], "msg": ...}]}``.
``prepare`` adds the checks that need the tokenizer and the server's limits, in the same
shape: ``max_tokens`` above the server's limit (422), a prompt that leaves no room in
the model's context (413), a prompt plus ``max_tokens`` longer than the context (422).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from preprocessing.chat import (
    ChatRecordError,
    ChatTemplateError,
    generation_prompt,
    prompt_messages,
)
from training.inference.decode import (
    MAX_SEED,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingConfig,
)
from training.inference.loading import ServedModel


def _greedy_or_usable(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"expected 0 (greedy) or at least {MIN_TEMPERATURE}")
    return value


# 0 is greedy; between 0 and MIN_TEMPERATURE sampling would turn every probability into NaN.
Temperature = Annotated[float, AfterValidator(_greedy_or_usable)]


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Omitted ``max_tokens``: the server's limit, or the
    room left in the context if that is less. Omitted ``seed``: a random one (returned)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = Field(default=0.8, ge=0, le=MAX_TEMPERATURE, description="0: greedy")
    top_k: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=0.95, ge=MIN_TOP_P, le=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    timeout_s: float | None = Field(
        default=None, gt=0, description="at most the server's --timeout"
    )


class GenerateRequest(SamplingRequest):
    """``POST /v1/generate``: continue ``prompt``."""

    prompt: str = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingRequest):
    """``POST /v1/chat``: the assistant's reply to ``messages`` (the last not the assistant's)."""

    messages: list[ChatMessage] = Field(min_length=1)


class RequestRejected(Exception):
    """A request the server cannot take: HTTP ``status`` with FastAPI's error shape."""

    def __init__(self, status: int, field: str, message: str, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.detail = [{"loc": ["body", field], "msg": message, "type": kind}]


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]  # EOD then the prompt, the chat template, or a T5's prompt then EOD
    sampling: SamplingConfig
    timeout_s: float


def prepare(
    body: GenerateRequest | ChatRequest,
    served: ServedModel,
    *,
    max_tokens_limit: int,
    timeout_s: float,
) -> Prepared:
    """Tokenize the prompt and fix the sampling settings; raises ``RequestRejected``."""
    prompt_ids, stop_ids = _prompt_ids(body, served)
    budget = token_budget(prompt_ids, served, body.max_tokens, max_tokens_limit)
    sampling = SamplingConfig(
        max_new_tokens=budget,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=secrets.randbelow(2**31) if body.seed is None else body.seed,
        stop_ids=stop_ids,
    )
    timeout = min(body.timeout_s or timeout_s, timeout_s)
    return Prepared(prompt_ids, sampling, timeout)


def token_budget(
    prompt_ids: list[int],
    served: ServedModel,
    requested: int | None,
    limit: int,
    default: int | None = None,
) -> int:
    """The tokens a request may generate: ``requested``, or ``default`` (the server's
    ``limit``) capped by the room the prompt leaves in the model's context; raises
    ``RequestRejected`` when the prompt leaves none or ``requested`` does not fit."""
    if requested is not None and requested > limit:
        raise RequestRejected(
            422,
            "max_tokens",
            f"max_tokens is {requested}; this server allows at most {limit}",
            "value_error.max_tokens_limit",
        )
    context = served.info.max_positions
    # A T5 decoder starts empty; a GPT's answer follows the prompt in the same positions.
    room = context if served.seq2seq else context - len(prompt_ids)
    if room < 1 or len(prompt_ids) > context:
        raise RequestRejected(
            413,
            "prompt",
            f"prompt is {len(prompt_ids)} tokens (special tokens included); the model's "
            f"context is {context} tokens, which leaves no room to generate",
            "value_error.prompt_too_long",
        )
    if requested is not None and requested > room:
        if served.seq2seq:
            where = f"the model's decoder has {context} positions"
        else:
            where = f"prompt uses {len(prompt_ids)} of the model's {context} positions"
        raise RequestRejected(
            422,
            "max_tokens",
            f"{where}: max_tokens must be at most {room}, got {requested}",
            "value_error.context_length",
        )
    return requested or min(default or limit, limit, room)


def _prompt_ids(
    body: GenerateRequest | ChatRequest, served: ServedModel
) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's tokens and the tokens that end the reply besides EOD."""
    if isinstance(body, GenerateRequest):
        return served.prompt_ids(body.prompt), ()
    return chat_prompt_ids([message.model_dump() for message in body.messages], served)


def chat_prompt_ids(
    messages: list[dict[str, str]], served: ServedModel
) -> tuple[list[int], tuple[int, ...]]:
    """A chat's prompt through the model's template (a T5's encoder input), and its
    end-of-turn token; raises ``RequestRejected`` naming the message at fault."""
    try:
        messages = prompt_messages(messages)
        tokens, end_of_turn = generation_prompt(served.tokenizer, messages)
    except ChatRecordError as error:
        raise RequestRejected(422, error.key, str(error), "value_error.chat") from None
    except ChatTemplateError:
        message = "this model's tokenizer has no chat template tokens; use /v1/generate"
        raise RequestRejected(422, "messages", message, "value_error.no_chat_template") from None
    return served.chat_prompt_ids(tokens), (end_of_turn,)


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event: ``event: NAME`` (optional) and one ``data:`` line of JSON."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()
