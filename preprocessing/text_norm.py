"""How curation compares texts: the same normalization for every rule."""

from __future__ import annotations

import string

PUNCTUATION = string.punctuation + "“”‘’«»…–—"
_REMOVE_PUNCTUATION = str.maketrans("", "", PUNCTUATION)


def normalized(text: str) -> str:
    """Lower case, whitespace collapsed: what exact deduplication compares."""
    return " ".join(text.lower().split())


def plain_words(text: str) -> list[str]:
    """Lower-cased words with punctuation removed: what n-grams and shingles are made of."""
    return text.lower().translate(_REMOVE_PUNCTUATION).split()
