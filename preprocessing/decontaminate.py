"""Decontamination: find documents that share a long word n-gram with an evaluation item.

The items come from task files: jsonl (every string in a record, joined in order, is
one item's text: a task's context followed by its choices) or plain text (one item per
line). Words are compared lower-cased with punctuation removed. An item shorter than n
words has no n-gram and cannot be matched; their number is reported (GPT-3 used 13-grams
and the same convention).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from megalith import safe_read
from megalith.errors import MegalithError
from preprocessing.text_norm import plain_words

MAX_TASK_FILE_BYTES = 256 << 20  # evaluation sets are megabytes; /dev/zero is not one


class TaskFileError(MegalithError):
    """A decontamination task file that cannot be read; the message names file:line."""


def ngram_keys(words: list[str], n: int) -> Iterator[int]:
    """64 bits per word n-gram, the same in every process: the keys are built on the driver
    and matched in worker processes (Python's ``hash`` is salted per process). The words
    hold no space (``plain_words``), so joining them with one is unambiguous."""
    for start in range(len(words) - n + 1):
        gram = " ".join(words[start : start + n]).encode("utf-8")
        yield int.from_bytes(hashlib.blake2b(gram, digest_size=8).digest(), "little")


def item_texts(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[str]:
    """The text of each item in a task file (jsonl records, or lines of plain text).
    A task file is read whole, within ``MAX_TASK_FILE_BYTES``, and must be a regular file."""
    jsonl = url.endswith((".jsonl", ".json", ".ndjson"))
    try:
        data = safe_read.read_bytes_bounded(url, MAX_TASK_FILE_BYTES, storage_options)
    except safe_read.UnsafeFileError as exc:
        raise TaskFileError(str(exc)) from None
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            yield line.strip()
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{url}:{number}: not JSON ({exc.msg})") from None
        yield " ".join(_strings(record))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


@dataclass
class Contamination:
    """The n-grams of every evaluation item, and how many items were too short to have one."""

    n: int
    files: list[str] = field(default_factory=list)
    keys: dict[int, str] = field(default_factory=dict)  # n-gram hash -> the task file
    items: int = 0
    short_items: int = 0

    @classmethod
    def build(
        cls, files: Sequence[str], n: int, storage_options: dict[str, Any] | None = None
    ) -> Contamination:
        found = cls(n=n, files=list(files))
        for url in files:
            try:
                texts = list(item_texts(url, storage_options))
            except (OSError, UnicodeDecodeError) as exc:
                raise TaskFileError(f"{url}: cannot read the task file ({exc})") from None
            for text in texts:
                words = plain_words(text)
                found.items += 1
                if len(words) < n:
                    found.short_items += 1
                for key in ngram_keys(words, n):
                    found.keys.setdefault(key, url)
        return found

    def match(self, text: str) -> str | None:
        """The first of the document's n-grams that an evaluation item holds, with its file."""
        if not self.keys:
            return None
        words = plain_words(text)
        for start, key in enumerate(ngram_keys(words, self.n)):
            if key in self.keys:
                gram = " ".join(words[start : start + self.n])
                return f"shares {self.n}-gram {gram!r} with {self.keys[key]}"
        return None
