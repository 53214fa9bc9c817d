"""Chat / instruction records for supervised fine-tuning: validation and the chat template.

Input format (jsonl, one conversation per line)::

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "...", "system": "..."}     # one-turn shorthand

Roles are ``system``, ``user`` and ``assistant``; every conversation needs at least one
assistant turn; contents are strings (they may be empty) that must not contain the
template's reserved tokens (``DEFAULT_SPECIAL_TOKENS``: a user could otherwise forge a
turn). Other keys are ignored. A record that breaks a rule is a bad record under the
readers' policy (``data.on_bad_record``): "fail" stops with ``file:line: key: problem``,
"skip" counts it under the reason ``invalid_chat`` (or ``missing_field`` /
``not_a_string`` / ``empty_text`` for those problems).

The template (deterministic, no free text of its own)::

    <|system|>CONTENT<|end|><|user|>CONTENT<|end|><|assistant|>CONTENT<|end|>...

each message is its role's marker token, the SentencePiece encoding of its content
(encoded alone, so a content's tokens never depend on its neighbours), then ``<|end|>``.
A conversation is one document; no EOD is appended (packing keeps documents apart).
The loss mask is 1 on the content tokens and the ``<|end|>`` of assistant turns, 0
elsewhere (markers, system and user turns): the model learns to answer and to stop.
To generate, feed the prompt turns plus ``<|assistant|>`` and stop at ``<|end|>``.

Why special tokens rather than plain-text markers such as ``### User:``: they are single
ids that BPE can never merge with the surrounding text, so turn boundaries and masks are
exact and the template cannot be imitated by content; Megalith tokenizers already
reserve them (``tokenizer.special_tokens`` defaults include all four), so no retraining is
needed. A tokenizer without them is refused with a message naming the missing tokens.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from megalith.config import DEFAULT_SPECIAL_TOKENS
from megalith.errors import MegalithError

ROLES = ("system", "user", "assistant")
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end|>"
TEMPLATE_TOKENS = (*ROLE_MARKERS.values(), END_OF_TURN)
RESERVED = tuple(dict.fromkeys([*DEFAULT_SPECIAL_TOKENS, *TEMPLATE_TOKENS]))
MASK_DTYPE = np.dtype(np.uint8)


class ChatRecordError(ValueError):
    """One invalid conversation: ``reason`` (a reject reason) and ``key`` (where)."""

    def __init__(self, reason: str, key: str, problem: str):
        super().__init__(f"{key}: {problem}" if key else problem)
        self.reason = reason
        self.key = key


class ChatTemplateError(MegalithError):
    """A tokenizer that lacks the template's special tokens."""


# --------------------------------------------------------------------------- records


def conversation_from_record(record: Any) -> list[dict[str, str]]:
    """The checked messages of one parsed JSON record (``messages`` or ``prompt``/``response``)."""
    if not isinstance(record, dict):
        raise ChatRecordError("missing_field", "", f"not a JSON object (got {_kind(record)})")
    if "messages" in record and ("prompt" in record or "response" in record):
        raise ChatRecordError(
            "invalid_chat", "messages", "give either 'messages' or 'prompt'/'response', not both"
        )
    if "messages" in record:
        messages = _messages(record["messages"])
    elif "prompt" in record or "response" in record:
        messages = _shorthand(record)
    else:
        raise ChatRecordError(
            "missing_field", "messages", "is missing (or give 'prompt' and 'response')"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatRecordError("invalid_chat", "messages", "has no assistant turn to learn from")
    return messages


def prompt_messages(value: Any) -> list[dict[str, str]]:
    """The checked messages of a generation request: the same rules as a record's, and the
    last turn is not the assistant's (the reply is the next one)."""
    messages = _messages(value)
    if messages[-1]["role"] == "assistant":
        key = f"messages[{len(messages) - 1}].role"
        raise ChatRecordError("invalid_chat", key, "is 'assistant'; end with the turn to answer")
    return messages


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise ChatRecordError("invalid_chat", "messages", f"is {_kind(value)}, not an array")
    if not value:
        raise ChatRecordError("empty_text", "messages", "is empty")
    checked = []
    for index, message in enumerate(value):
        key = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ChatRecordError("invalid_chat", key, f"is {_kind(message)}, not an object")
        role = message.get("role")
        if role not in ROLES:
            raise ChatRecordError(
                "invalid_chat", f"{key}.role", f"is {role!r}; expected one of {', '.join(ROLES)}"
            )
        checked.append({"role": role, "content": _content(message, "content", f"{key}.content")})
    return checked


def _shorthand(record: dict) -> list[dict[str, str]]:
    messages = []
    if record.get("system") is not None:
        messages.append({"role": "system", "content": _content(record, "system", "system")})
    messages.append({"role": "user", "content": _content(record, "prompt", "prompt")})
    messages.append({"role": "assistant", "content": _content(record, "response", "response")})
    return messages


def _content(record: dict, field: str, key: str) -> str:
    if field not in record or record[field] is None:
        raise ChatRecordError(
            "missing_field", key, "is missing" if field not in record else "is null"
        )
    value = record[field]
    if not isinstance(value, str):
        raise ChatRecordError("not_a_string", key, f"is {_kind(value)}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ChatRecordError("invalid_utf8", key, "holds a lone surrogate") from None
    for token in RESERVED:
        if token in value:
            raise ChatRecordError("invalid_chat", key, f"contains the reserved token {token!r}")
    return value


def _kind(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    return names.get(type(value), "null" if value is None else "a number")


def canonical_text(messages: list[dict[str, str]]) -> str:
    """One string per conversation for the document stream (the readers yield text): compact
    JSON, so its length is a fair size measure for the shard plan."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def conversation_contents(texts: Iterable[str]) -> Iterator[str]:
    """The message contents of canonical conversations: what a tokenizer trains on."""
    for text in texts:
        for message in json.loads(text):
            if message["content"]:
                yield message["content"]


# --------------------------------------------------------------------------- template


def apply_template(
    messages: list[dict[str, str]], content_ids: list[list[int]], ids: dict[str, int]
) -> tuple[list[int], list[int]]:
    """Tokens and loss mask of one conversation, given each message's encoded content."""
    tokens: list[int] = []
    mask: list[int] = []
    for message, content in zip(messages, content_ids, strict=True):
        learn = int(message["role"] == "assistant")
        tokens += [ids[ROLE_MARKERS[message["role"]]], *content, ids[END_OF_TURN]]
        mask += [0] + [learn] * (len(content) + 1)
    return tokens, mask


def encode_conversations(
    tokenizer, texts: list[str], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize canonical conversations: flat tokens, per-conversation lengths, flat mask."""
    ids = _tokenizer_template_ids(tokenizer)
    conversations = [json.loads(text) for text in texts]
    contents = [m["content"] for messages in conversations for m in messages]
    encoded = iter(tokenizer.encode_batch(contents, num_threads=1))
    all_tokens, all_masks, lengths = [], [], []
    for messages in conversations:
        tokens, mask = apply_template(messages, list(itertools.islice(encoded, len(messages))), ids)
        all_tokens.append(tokens)
        all_masks.append(mask)
        lengths.append(len(tokens))
    flat = np.fromiter(itertools.chain.from_iterable(all_tokens), dtype=dtype)
    masks = np.fromiter(itertools.chain.from_iterable(all_masks), dtype=MASK_DTYPE)
    return flat, np.asarray(lengths, dtype=np.int64), masks


def render(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The template applied with a loaded :class:`~preprocessing.tokenizer.Tokenizer`:
    exactly the tokens and mask that preprocessing writes for these messages."""
    ids = _tokenizer_template_ids(tokenizer)
    return apply_template(messages, [tokenizer.encode(m["content"]) for m in messages], ids)


def generation_prompt(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], int]:
    """Prompt tokens for generating the next assistant turn (the messages, then
    ``<|assistant|>``) and the id to stop at (``<|end|>``)."""
    ids = _tokenizer_template_ids(tokenizer)
    tokens, _ = apply_template(messages, [tokenizer.encode(m["content"]) for m in messages], ids)
    return tokens + [ids[ROLE_MARKERS["assistant"]]], ids[END_OF_TURN]


def _tokenizer_template_ids(tokenizer) -> dict[str, int]:
    ids = {token: tokenizer.special_ids.get(token, -1) for token in TEMPLATE_TOKENS}
    missing = [token for token, i in ids.items() if i < 0]
    if missing:
        raise ChatTemplateError(
            f"{tokenizer.model_path}: lacks the chat template tokens {missing}: train it with "
            f"tokenizer.special_tokens including {list(TEMPLATE_TOKENS)} (the default), or add "
            "them to a tokenizer.json as special tokens"
        )
    return ids
