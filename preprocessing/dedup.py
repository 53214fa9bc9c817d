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
        return self.check_key(text_key(text), ordinal)

    def check_key(self, key: bytes, ordinal: int) -> int | None:
        """``check`` for a ``text_key`` computed elsewhere (in a worker)."""
        first = self.first.setdefault(key, ordinal)
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


class NearDuplicates:
    """A MinHash LSH index of the kept documents: per band, the band's key -> the kept
    document that has it.

    datasketch's ``MinHashLSH`` chooses the bands and rows; its tables (a set of keys per
    band value, and every document's band values again for removal) are not used: a band
    value seen once makes every later document that has it a duplicate, which is never
    indexed, so one ordinal per value is the whole answer (about 0.8 KB per kept document
    with 9 bands, against 2.6 KB in MinHashLSH's tables)."""

    def __init__(self, config: NearDedupConfig):
        self.config = config
        params = (config.bands, config.rows) if config.bands is not None else None
        shape = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm, params=params)
        self.bands, self.rows = shape.b, shape.r
        self.tables: list[dict[int, int]] = [{} for _ in range(self.bands)]
        template = MinHash(num_perm=config.num_perm, seed=config.seed, scheme=SCHEME)
        self.permutations = template.permutations

    def __len__(self) -> int:
        """Documents in the index."""
        return len(self.tables[0])

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

    def band_keys(self, minhash: MinHash) -> list[int]:
        """Each band's ``rows`` signature values as one 64-bit key."""
        values = minhash.hashvalues
        return [
            int.from_bytes(
                hashlib.blake2b(values[b * self.rows : (b + 1) * self.rows].tobytes(), digest_size=8).digest(),
                "little",
            )
            for b in range(self.bands)
        ]  # fmt: skip

    def check(self, text: str, ordinal: int) -> int | None:
        """The earliest kept document this one nearly duplicates; else index this one."""
        return self.check_keys(self.band_keys(self.signature(text)), ordinal)

    def check_keys(self, keys: list[int], ordinal: int) -> int | None:
        """``check`` for ``band_keys`` computed elsewhere (in a worker)."""
        found = [table[key] for table, key in zip(self.tables, keys, strict=True) if key in table]
        if found:
            return min(found)
        for table, key in zip(self.tables, keys, strict=True):
            table[key] = ordinal
        return None
