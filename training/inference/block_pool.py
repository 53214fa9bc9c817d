"""The blocks of a paged KV cache: allocation with reference counts, and a prefix cache.

KV memory is ``num_blocks`` blocks of ``block_size`` positions
(:mod:`training.inference.paged_cache` holds the tensors); a sequence owns a list of
block ids, its block table. A block may be shared: a prompt whose leading full blocks
hold the same tokens as a cached prompt's (a common system prompt, say) reuses those
blocks instead of computing them again, and each user holds a reference.

A full prompt block is named by a hash chained over its tokens and every token before
it (:func:`block_hashes`): equal hashes mean equal prefixes, so equal keys and values.
Once its keys and values are written, a sequence *publishes* such a block under its
hash. When the last reference goes, a published block stays in the cache, reusable,
until a new allocation needs it and evicts it, least recently freed first; an
unpublished block is simply free.

Prefix counters are in tokens, as vLLM's: ``prefix_queries`` counts the prompt tokens
of every admitted sequence, ``prefix_hits`` those whose keys and values came from the cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """One hash per full block of ``tokens``, each over the block and all blocks before it."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha256(previous)
        digest.update(array("q", tokens[start : start + block_size]).tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class BlockPool:
    """Block ids ``0 .. num_blocks-1`` with reference counts and the prefix cache."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # unpublished; pop() takes block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # published, unreferenced: LRU
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.prefix_hits = 0
        self.prefix_queries = 0

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def cached(self) -> int:
        """Published blocks no sequence holds: free, but reusable as a prefix until evicted."""
        return len(self._evictable)

    def available(self, shared: Sequence[int] = ()) -> int:
        """Blocks an allocation can take once ``shared`` (cached blocks about to be
        reused) are referenced."""
        reviving = sum(1 for block in shared if self.refs[block] == 0)
        return len(self._free) + len(self._evictable) - reviving

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of leading ``hashes`` (not yet referenced)."""
        blocks = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += prompt_tokens
        self.prefix_hits += hit_tokens

    def share(self, blocks: Sequence[int]) -> None:
        """Take a reference to each of ``blocks`` (cached ones leave the eviction order)."""
        for block in blocks:
            if self.refs[block] == 0:
                del self._evictable[block]
            self.refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks with one reference each: free ones first, then the least
        recently freed published ones (their hashes are forgotten)."""
        if count > self.available():
            raise ValueError(f"{count} blocks asked, {self.available()} available")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop a reference to each of ``blocks``."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def publish(self, block: int, digest: bytes) -> None:
        """Offer a written full prompt block for reuse under its hash; a hash already
        cached (two equal prompts computed at once) keeps its first block."""
        if digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest] = block
            self._hash_of[block] = digest
