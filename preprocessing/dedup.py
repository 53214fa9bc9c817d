"""Exact and near-duplicate detection over a document stream, first occurrence kept.

Exact duplicates share the hash of their normalized text (lower case, whitespace
collapsed). Near duplicates share, with high probability, one LSH band of the MinHash
signature of their word shingles (datasketch's ``MinHash`` and ``MinHashLSH``): two
documents whose shingle sets have Jaccard similarity s collide with probability
1 - (1 - s^rows)^bands. Only kept documents enter the index, so memory grows with
what is kept, and the decisions depend only on the input order and the seed.
"""

from __future__ import annotations

import hashlib
import zlib

from datasketch import MinHash, MinHashLSH

from megalith.config import NearDedupConfig
from preprocessing.text_norm import normalized, plain_words

SCHEME = "affine32"  # datasketch's default since 2.0: uint32 signatures


def text_key(text: str) -> bytes:
    """16 bytes identifying a document's normalized text."""
    return hashlib.blake2b(normalized(text).encode("utf-8"), digest_size=16).digest()


class ExactDuplicates:
    """Remembers the first document of each normalized text."""

    def __init__(self) -> None:
        self.first: dict[bytes, int] = {}

    def check(self, text: str, ordinal: int) -> int | None:
        """The ordinal of an earlier document with the same text; else remember this one."""
        first = self.first.setdefault(text_key(text), ordinal)
        return None if first == ordinal else first


def shingles(text: str, size: int) -> list[bytes]:
    """Distinct word ``size``-grams of the text (lower case, punctuation removed); a text
    shorter than ``size`` words is one shingle."""
    words = plain_words(text)
    if len(words) <= size:
        return [" ".join(words).encode("utf-8")]
    grams = {" ".join(words[i : i + size]) for i in range(len(words) - size + 1)}
    return [gram.encode("utf-8") for gram in sorted(grams)]


def _crc32(data: bytes) -> int:
    # zlib's C crc32: 5x faster than datasketch's default sha1 per shingle, and datasketch
    # mixes it (MurmurHash3's finalizer) before permuting.
    return zlib.crc32(data)


def _band_key(data: bytes) -> bytes:
    # An LSH band of `rows` uint32 values kept as 8 bytes: less index memory per document.
    return hashlib.blake2b(data, digest_size=8).digest()


class NearDuplicates:
    """A MinHash LSH index of the kept documents."""

    def __init__(self, config: NearDedupConfig):
        self.config = config
        params = (config.bands, config.rows) if config.bands is not None else None
        self.lsh = MinHashLSH(
            threshold=config.threshold, num_perm=config.num_perm, params=params, hashfunc=_band_key
        )
        template = MinHash(num_perm=config.num_perm, seed=config.seed, scheme=SCHEME)
        self.permutations = template.permutations

    @property
    def bands(self) -> int:
        return self.lsh.b

    @property
    def rows(self) -> int:
        return self.lsh.r

    def signature(self, text: str) -> MinHash:
        minhash = MinHash(
            num_perm=self.config.num_perm,
            seed=self.config.seed,
            hashfunc=_crc32,
            permutations=self.permutations,
            scheme=SCHEME,
        )
        minhash.update_batch(shingles(text, self.config.shingle_size))
        return minhash

    def check(self, text: str, ordinal: int) -> int | None:
        """The earliest kept document this one nearly duplicates; else index this one."""
        minhash = self.signature(text)
        candidates = self.lsh.query(minhash)
        if candidates:
            return min(candidates)
        self.lsh.insert(ordinal, minhash, check_duplication=False)
        return None
