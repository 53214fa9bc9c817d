"""The OpenAI-compatible requests: their schemas, the error shape, and what the engine runs.

``POST /v1/completions`` (:class:`CompletionRequest`) continues one prompt or several;
``POST /v1/chat/completions`` (:class:`ChatCompletionRequest`) answers ``messages``
through the model's chat template (``deploy.schema.chat_prompt_ids``, as ``/v1/chat``).
Both take OpenAI's sampling fields plus two of vLLM's extensions: ``top_k`` (``-1`` or
``0`` is off) and ``ignore_eos`` (decode ``max_tokens`` past the end-of-document token).
Fields OpenAI has and this server does not implement are refused by name, except the
penalties at their neutral 0 and ``user``, which many clients always send.

Every refusal is ``{"error": {"message", "type", "param", "code"}}``
(``deploy.request_body.openai_error``):
400 for a bad field (NaN, ``Infinity`` and out-of-range values included), a prompt that
leaves no room in the model's context or ``max_tokens`` past it (``code:
context_length_exceeded``); 404 for a model this server does not serve.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deploy.request_body import openai_error
from deploy.schema import RequestRejected, Temperature, chat_prompt_ids, token_budget
from training.inference.decode import (
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_TOP_P,
    SamplingConfig,
)
from training.inference.loading import ServedModel

MAX_N = 16  # choices one request may ask for
MAX_STOPS = 16
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

NonEmpty = Annotated[str, Field(min_length=1, max_length=1000)]
Prompt = Annotated[str, Field(min_length=1)]  # bounded by the context and the body limit


class OpenAIError(Exception):
    """A request refused in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return openai_error(self.status, str(self), self.param, self.code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class OpenAISampling(BaseModel):
    """The fields both endpoints share, with OpenAI's defaults."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = Field(default=1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, ge=MIN_TOP_P, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0: all tokens")
    stop: NonEmpty | list[NonEmpty] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    presence_penalty: float = Field(default=0.0, ge=0, le=0, description="only 0")
    frequency_penalty: float = Field(default=0.0, ge=0, le=0, description="only 0")
    ignore_eos: bool = Field(default=False, description="decode past end-of-document (vLLM's)")

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(value)}")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions``: continue ``prompt`` (or each of a list of prompts)."""

    prompt: Prompt | list[Prompt] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) > MAX_N:
            raise ValueError(f"at most {MAX_N} prompts, got {len(value)}")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatCompletionMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted, unused

    def as_turn(self) -> dict[str, str]:
        """The turn as the chat template reads it (``developer`` is OpenAI's new ``system``)."""
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(OpenAISampling):
    """``POST /v1/chat/completions``: the assistant's reply to ``messages``."""

    messages: list[ChatCompletionMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


@dataclass(frozen=True)
class Choice:
    """One answer the engine decodes: choice ``index`` of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingConfig


def check_model(requested: str, served: ServedModel) -> None:
    """404 unless ``requested`` names the served model (see :func:`model_ids`)."""
    if requested not in model_ids(served):
        raise OpenAIError(
            404,
            f"The model '{requested[:200]}' does not exist on this server; it serves "
            f"'{served.info.name}'",
            "model",
            "model_not_found",
        )


def model_ids(served: ServedModel) -> list[str]:
    """The names a request may use for the served model: its registry name (a package's
    directory name), and ``NAME@ALIAS``, ``NAME/VERSION`` and the source it was given."""
    info = served.info
    ids = [info.name]
    if info.alias:
        ids.append(f"{info.name}@{info.alias}")
    if info.version is not None:
        ids.append(f"{info.name}/{info.version}")
    if info.source.startswith("models:/"):
        ids.append(info.source)
    return ids


def choices(
    body: CompletionRequest | ChatCompletionRequest, served: ServedModel, max_tokens_limit: int
) -> list[Choice]:
    """The answers to decode, ``n`` per prompt; raises ``OpenAIError``."""
    check_model(body.model, served)
    try:
        if isinstance(body, CompletionRequest):
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            encoded = [(served.prompt_ids(p), ()) for p in prompts]
            requested, default, logprobs = body.max_tokens, DEFAULT_COMPLETION_TOKENS, body.logprobs
        else:
            turns = [message.as_turn() for message in body.messages]
            encoded = [chat_prompt_ids(turns, served)]
            requested, default = body.max_completion_tokens or body.max_tokens, None
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        budgets = [
            token_budget(ids, served, requested, max_tokens_limit, default) for ids, _ in encoded
        ]
    except RequestRejected as rejected:
        raise _as_openai(rejected) from None
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    out = []
    for p, ((ids, stop_ids), budget) in enumerate(zip(encoded, budgets, strict=True)):
        for j in range(body.n):
            sampling = SamplingConfig(
                max_new_tokens=budget,
                temperature=body.temperature,
                top_k=body.top_k if body.top_k and body.top_k > 0 else None,
                top_p=body.top_p,
                seed=(seed + j) % (MAX_SEED + 1),
                stop_ids=stop_ids,
                logprobs=logprobs,
                stop_at_eod=not body.ignore_eos,
            )
            out.append(Choice(p * body.n + j, p, ids, sampling))
    return out


def _as_openai(rejected: RequestRejected) -> OpenAIError:
    error = rejected.detail[0]
    field = str(error["loc"][-1])
    code = {
        "value_error.prompt_too_long": "context_length_exceeded",
        "value_error.context_length": "context_length_exceeded",
    }.get(error["type"])
    return OpenAIError(400, error["msg"], field, code)


def validation_error(errors: list[dict[str, Any]], shown: int) -> OpenAIError:
    """FastAPI's validation errors as one 400: the first field as ``param``, every error
    (up to ``shown``) in the message, without echoing the input."""
    where = [_dotted(error["loc"]) for error in errors]
    message = "; ".join(
        f"{place or 'body'}: {error['msg']}"
        for place, error in zip(where[:shown], errors[:shown], strict=True)
    )
    param = where[0].split(".")[0].split("[")[0] if where and where[0] else None
    return OpenAIError(400, message, param, "invalid_value")


def _dotted(loc: tuple[str | int, ...] | list[str | int]) -> str:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if len(part) <= 80 else part[:77] + "..."
            out += f".{text}" if out else text
    return out
