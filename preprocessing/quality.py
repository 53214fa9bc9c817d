"""Document quality heuristics in the style of Gopher, C4 and FineWeb.

Each rule looks at one document and says whether it fails; ``quality_failure`` returns
the first failing rule's name and why, in the order of ``QUALITY_RULES`` (cheap counts
first, n-gram repetition last). Thresholds come from ``QualityConfig``; a threshold of
None switches its rule off. The defaults are Gopher's (Rae et al. 2021, appendix A):
made for web text, so a corpus of templates (the shipped sample) needs looser repetition
limits.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from megalith.config import QualityConfig
from preprocessing.text_norm import plain_words

QUALITY_RULES: tuple[str, ...] = (
    "word_count",
    "mean_word_length",
    "symbol_ratio",
    "bullet_lines",
    "ellipsis_lines",
    "alpha_words",
    "stop_words",
    "duplicate_lines",
    "top_ngram",
    "duplicate_ngrams",
)
BULLETS = ("•", "-", "*", "‣", "●", "◦", "▪", "–")
ELLIPSES = ("...", "…")
_LETTER = re.compile(r"[^\W\d_]")
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection mod 2^64


class Document:
    """The pieces of a text the rules count, computed once."""

    def __init__(self, text: str):
        self.text = text
        self.words = text.split()  # as written
        self.plain = plain_words(text)  # lower case, no punctuation
        self.lines = [line.strip() for line in text.splitlines() if line.strip()]
        ids: dict[str, int] = {}
        self.ids = np.fromiter((ids.setdefault(w, len(ids)) for w in self.plain), np.uint64)
        self.lengths = np.fromiter(map(len, self.plain), np.int64, count=len(self.plain))
        self._grams: dict[int, np.ndarray] = {1: self.ids}

    @property
    def characters(self) -> int:
        return int(self.lengths.sum())

    def ngram_keys(self, n: int) -> np.ndarray:
        """One uint64 per word n-gram (position i: words i..i+n-1), equal for equal n-grams
        (a polynomial hash, wrapping; a collision needs 2^-64 luck)."""
        if n not in self._grams:
            shorter = self.ngram_keys(n - 1)
            self._grams[n] = shorter[:-1] * _MULTIPLIER + self.ids[n - 1 :]
        return self._grams[n]


Rule = Callable[[Document, QualityConfig], str | None]


def quality_failure(text: str, config: QualityConfig) -> tuple[str, str] | None:
    """``(rule, why)`` for the first rule the document fails, or None when it passes."""
    document = Document(text)
    for name, rule in RULES.items():
        why = rule(document, config)
        if why is not None:
            return name, why
    return None


def _word_count(doc: Document, config: QualityConfig) -> str | None:
    count = len(doc.plain)
    if config.min_words is not None and count < config.min_words:
        return f"{count} words < {config.min_words}"
    if config.max_words is not None and count > config.max_words:
        return f"{count} words > {config.max_words}"
    return None


def _mean_word_length(doc: Document, config: QualityConfig) -> str | None:
    if not doc.plain:
        return None
    mean = sum(map(len, doc.plain)) / len(doc.plain)
    low, high = config.min_mean_word_length, config.max_mean_word_length
    if low is not None and mean < low:
        return f"mean word length {mean:.2f} < {low}"
    if high is not None and mean > high:
        return f"mean word length {mean:.2f} > {high}"
    return None


def _symbol_ratio(doc: Document, config: QualityConfig) -> str | None:
    if config.max_symbol_ratio is None or not doc.words:
        return None
    symbols = doc.text.count("#") + sum(doc.text.count(e) for e in ELLIPSES)
    ratio = symbols / len(doc.words)
    return _above("symbols per word", ratio, config.max_symbol_ratio)


def _bullet_lines(doc: Document, config: QualityConfig) -> str | None:
    if config.max_bullet_lines is None or not doc.lines:
        return None
    share = sum(line.startswith(BULLETS) for line in doc.lines) / len(doc.lines)
    return _above("share of bullet lines", share, config.max_bullet_lines)


def _ellipsis_lines(doc: Document, config: QualityConfig) -> str | None:
    if config.max_ellipsis_lines is None or not doc.lines:
        return None
    share = sum(line.endswith(ELLIPSES) for line in doc.lines) / len(doc.lines)
    return _above("share of lines ending in an ellipsis", share, config.max_ellipsis_lines)


def _alpha_words(doc: Document, config: QualityConfig) -> str | None:
    if config.min_alpha_words is None or not doc.words:
        return None
    share = sum(1 for word in doc.words if _LETTER.search(word)) / len(doc.words)
    if share < config.min_alpha_words:
        return f"share of words with a letter {share:.3f} < {config.min_alpha_words}"
    return None


def _stop_words(doc: Document, config: QualityConfig) -> str | None:
    if config.min_stop_words is None:
        return None
    found = len(set(config.stop_words).intersection(doc.plain))
    if found < config.min_stop_words:
        return f"{found} distinct stop words < {config.min_stop_words}"
    return None


def _duplicate_lines(doc: Document, config: QualityConfig) -> str | None:
    if not doc.lines:
        return None
    seen: set[str] = set()
    repeated = repeated_chars = 0
    for line in doc.lines:
        if line in seen:
            repeated += 1
            repeated_chars += len(line)
        seen.add(line)
    share = repeated / len(doc.lines)
    chars = repeated_chars / max(1, sum(map(len, doc.lines)))
    return _above("share of repeated lines", share, config.max_duplicate_lines) or _above(
        "share of characters in repeated lines", chars, config.max_duplicate_line_chars
    )


def _top_ngram(doc: Document, config: QualityConfig) -> str | None:
    for n, limit in sorted(config.max_top_ngram.items()):
        if len(doc.plain) < n:
            continue
        keys = doc.ngram_keys(n)
        _, first, counts = np.unique(keys, return_index=True, return_counts=True)
        top = int(np.argmax(counts))
        if counts[top] < 2:
            continue
        start = int(first[top])
        share = int(doc.lengths[start : start + n].sum()) * int(counts[top]) / doc.characters
        if share > limit:
            gram = " ".join(doc.plain[start : start + n])
            return f"most frequent {n}-gram {gram!r} covers {share:.3f} > {limit}"
    return None


def _duplicate_ngrams(doc: Document, config: QualityConfig) -> str | None:
    for n, limit in sorted(config.max_duplicate_ngrams.items()):
        if len(doc.plain) < n:
            continue
        keys = doc.ngram_keys(n)
        _, first = np.unique(keys, return_index=True)
        repeats = np.ones(len(keys), dtype=bool)
        repeats[first] = False  # an n-gram's first occurrence is not a repeat
        # Words inside any repeated n-gram: +1 where one starts, -1 n words later.
        edges = np.zeros(len(doc.plain) + 1, dtype=np.int64)
        starts = np.flatnonzero(repeats)
        np.add.at(edges, starts, 1)
        np.add.at(edges, starts + n, -1)
        covered = np.cumsum(edges[:-1]) > 0
        share = int(doc.lengths[covered].sum()) / doc.characters
        if share > limit:
            return f"repeated {n}-grams cover {share:.3f} > {limit}"
    return None


def _above(what: str, value: float, limit: float | None) -> str | None:
    if limit is not None and value > limit:
        return f"{what} {value:.3f} > {limit}"
    return None


RULES: dict[str, Rule] = dict(
    zip(
        QUALITY_RULES,
        (
            _word_count,
            _mean_word_length,
            _symbol_ratio,
            _bullet_lines,
            _ellipsis_lines,
            _alpha_words,
            _stop_words,
            _duplicate_lines,
            _top_ngram,
            _duplicate_ngrams,
        ),
        strict=True,
    )
)
