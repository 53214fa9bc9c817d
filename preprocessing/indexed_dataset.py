"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), written and read with numpy.

``.bin`` holds the token ids back to back. ``.idx`` is little-endian with no padding::

    b"MMIDIDX\\x00\\x00"   magic (9 bytes)
    uint64              version (1)
    uint8               dtype code (see DTYPE_CODES)
    uint64              N, the number of sequences
    uint64              D, the number of documents + 1
    int32[N]            sequence lengths
    int64[N]            byte offset of each sequence in .bin
    int64[D]            document indices: 0, then the sequence count at the end of each document

Files written here are read by megatron-core's ``IndexedDataset`` unchanged and the
reader reads what megatron-core's ``IndexedDatasetBuilder`` writes. Nothing here
imports torch or megatron.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megalith.errors import MegalithError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D
CHECK_CHUNK = 1 << 22  # entries per vectorised check: bounds the temporaries on big shards

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(MegalithError):
    """A .bin/.idx pair that is missing, truncated or not in Megatron's format."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 when the vocabulary is below 65,500 ids, int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype: np.dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no indexed-dataset code") from None


def bin_path(path_prefix: str) -> str:
    return f"{path_prefix}.bin"


def idx_path(path_prefix: str) -> str:
    return f"{path_prefix}.idx"


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin`` as documents arrive and ``PREFIX.idx`` on ``finalize()``.

    One sequence per document. The .idx goes through a temporary name, so its
    presence means the pair is complete. Leaving a ``with`` block normally
    finalizes; leaving it with an exception deletes the partial .bin.
    """

    def __init__(self, path_prefix: str, dtype: np.dtype):
        self.path_prefix = str(path_prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # fail early on an unsupported dtype
        self._bin = open(bin_path(self.path_prefix), "wb")  # noqa: SIM115 - closed in finalize
        self._lengths: list[np.ndarray] = []
        self._num_documents = 0
        self._num_tokens = 0
        self._finalized = False

    @property
    def num_documents(self) -> int:
        return self._num_documents

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append a batch: ``tokens`` is every document's ids back to back, ``lengths`` their sizes."""
        if self._finalized:
            raise RuntimeError(f"{self.path_prefix}: writer is already finalized")
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths)
        if tokens.ndim != 1 or lengths.ndim != 1:
            raise ValueError("tokens and lengths must be 1-D arrays")
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("document lengths must lie in [0, 2**31 - 1]")
        total = int(lengths.sum(dtype=np.int64))
        if total != tokens.size:
            raise ValueError(f"lengths sum to {total} but {tokens.size} tokens were given")
        self._bin.write(memoryview(self._cast(tokens)))
        self._lengths.append(lengths.astype(np.int32))
        self._num_documents += lengths.size
        self._num_tokens += total

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens.reshape(-1), np.array([tokens.size], dtype=np.int64))

    def _cast(self, tokens: np.ndarray) -> np.ndarray:
        if tokens.dtype == self.dtype:
            return np.ascontiguousarray(tokens)
        # A silent wrap-around here would corrupt the data set, so check the range once per batch.
        if tokens.size and self.dtype.kind in "iu" and tokens.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = tokens.min(), tokens.max()
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids span [{low}, {high}], outside what {self.dtype} holds "
                    f"([{info.min}, {info.max}])"
                )
        return tokens.astype(self.dtype)

    def finalize(self) -> None:
        if self._finalized:
            return
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        document_indices = np.arange(lengths.size + 1, dtype=np.int64)
        write_index(idx_path(self.path_prefix), self.dtype, lengths, pointers, document_indices)
        self._finalized = True

    def abort(self) -> None:
        self._bin.close()
        Path(bin_path(self.path_prefix)).unlink(missing_ok=True)
        self._finalized = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif not self._finalized:
            self.abort()


def write_index(
    path: str,
    dtype: np.dtype,
    lengths: np.ndarray,
    pointers: np.ndarray,
    document_indices: np.ndarray,
) -> None:
    """Write a .idx file through a temporary name in the same directory."""
    header = _HEADER.pack(MAGIC, VERSION, dtype_code(dtype), lengths.size, document_indices.size)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            handle.write(header)
            handle.write(memoryview(np.ascontiguousarray(lengths, dtype=np.int32)))
            handle.write(memoryview(np.ascontiguousarray(pointers, dtype=np.int64)))
            handle.write(memoryview(np.ascontiguousarray(document_indices, dtype=np.int64)))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class IndexedDatasetReader:
    """Memory-maps a .bin/.idx pair after checking its header and file sizes."""

    def __init__(self, path_prefix: str):
        self.path_prefix = str(path_prefix)
        path = idx_path(self.path_prefix)
        index = _map(path)
        self.dtype, count, doc_count, offset = _parse_header(path, index)
        self.sequence_lengths = np.frombuffer(index, np.int32, count, offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(index, np.int64, count, offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(index, np.int64, doc_count, offset)
        bin_size = _bin_size(bin_path(self.path_prefix))
        check_index(
            path,
            self.dtype,
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
            bin_size,
        )
        self.num_tokens = bin_size // self.dtype.itemsize
        self.tokens = self._map_tokens(bin_size)

    def _map_tokens(self, size: int) -> np.ndarray:
        if size == 0:  # mmap refuses empty files
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(bin_path(self.path_prefix), dtype=self.dtype, mode="r")

    @property
    def num_documents(self) -> int:
        return self.document_indices.size - 1

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (a read-only view)."""
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.path_prefix}")
        i %= n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {size}"
            )
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def first_token_outside(self, vocab_size: int) -> tuple[int, int] | None:
        """``(document, id)`` of the first token id outside ``[0, vocab_size)``, else None.

        One pass over the ``.bin`` in chunks: ``data verify`` runs it on every shard.
        """
        for start, stop in _chunks(self.tokens.size):
            chunk = self.tokens[start:stop]
            if chunk.min() >= 0 and chunk.max() < vocab_size:
                continue
            position = start + int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
            return self.document_of_token(position), int(self.tokens[position])
        return None

    def document_of_token(self, position: int) -> int:
        """The document holding token ``position`` of the ``.bin``."""
        starts = self.sequence_pointers // self.dtype.itemsize
        sequence = int(np.searchsorted(starts, position, side="right")) - 1
        return int(np.searchsorted(self.document_indices, sequence, side="right")) - 1

    # DataLoader workers started by spawn pickle the dataset: reopen the files instead
    # of copying the mapped arrays.
    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"])


def _map(path: str) -> np.ndarray:
    size = _regular_file_size(path, "missing")
    if size < _HEADER.size:
        raise IndexedDatasetError(
            f"{path}: truncated index ({size} bytes, the header alone is {_HEADER.size})"
        )
    return np.memmap(path, dtype=np.uint8, mode="r")


def _bin_size(path: str) -> int:
    return _regular_file_size(path, "missing (its .idx exists)")


def _regular_file_size(path: str, missing: str) -> int:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise IndexedDatasetError(f"{path}: {missing}") from None
    if not stat.S_ISREG(info.st_mode):
        raise IndexedDatasetError(f"{path}: not a regular file (a device, pipe or folder)")
    return info.st_size


def _chunks(size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, size, CHECK_CHUNK):
        yield start, min(start + CHECK_CHUNK, size)


def check_index(
    path: str,
    dtype: np.dtype,
    lengths: np.ndarray,
    pointers: np.ndarray,
    document_indices: np.ndarray,
    bin_size: int,
) -> None:
    """Raise :class:`IndexedDatasetError` at the first entry of ``path`` that breaks the format.

    Sequences lie back to back from byte 0 and end at the end of the ``.bin``; document
    indices run from 0 to the sequence count, never decreasing. Checked in chunks, so
    the temporaries stay small however large the shard.
    """
    end = 0  # the byte where the next sequence must start
    for start, stop in _chunks(lengths.size):
        sizes = lengths[start:stop].astype(np.int64)
        negative = np.flatnonzero(sizes < 0)
        if negative.size:
            i = start + int(negative[0])
            raise IndexedDatasetError(
                f"{path}: sequence {i} has length {int(lengths[i])}; expected at least 0"
            )
        ends = end + np.cumsum(sizes * dtype.itemsize)
        starts = np.concatenate(([end], ends[:-1]))
        wrong = np.flatnonzero(pointers[start:stop] != starts)
        if wrong.size:
            i = int(wrong[0])
            raise IndexedDatasetError(
                f"{path}: sequence {start + i} starts at byte {int(pointers[start + i])} of the "
                f".bin; expected {int(starts[i])}, where the sequence before it ends"
            )
        end = int(ends[-1])
    if end != bin_size:
        raise IndexedDatasetError(
            f"{bin_path(path.removesuffix('.idx'))}: {bin_size} bytes, but the .idx lists "
            f"sequences of {dtype} ending at byte {end} (truncated or mismatched pair)"
        )
    _check_document_indices(path, document_indices, lengths.size)


def _check_document_indices(path: str, documents: np.ndarray, count: int) -> None:
    if documents.size == 0 or documents[0] != 0 or documents[-1] != count:
        found = [int(documents[0]), int(documents[-1])] if documents.size else "none"
        raise IndexedDatasetError(
            f"{path}: document indices must run from 0 to the sequence count {count}, found {found}"
        )
    for start, stop in _chunks(documents.size - 1):
        falling = np.flatnonzero(np.diff(documents[start : stop + 1]) < 0)
        if falling.size:
            i = start + int(falling[0]) + 1
            raise IndexedDatasetError(
                f"{path}: document index {i} is {int(documents[i])}, below the one before it "
                f"({int(documents[i - 1])}); expected a non-decreasing list"
            )


def _parse_header(path: str, index: np.ndarray) -> tuple[np.dtype, int, int, int]:
    magic, version, code, count, doc_count = _HEADER.unpack(bytes(index[: _HEADER.size]))
    if magic != MAGIC:
        raise IndexedDatasetError(
            f"{path}: bad magic {magic!r}, expected {MAGIC!r} (not a Megatron indexed dataset)"
        )
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: index version {version} is not supported (expected 1)")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(
            f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})"
        )
    expected = _HEADER.size + 12 * count + 8 * doc_count
    # Multimodal indices carry one int8 mode per sequence after the document indices.
    if index.size not in (expected, expected + count):
        problem = "truncated" if index.size < expected else "has trailing bytes"
        raise IndexedDatasetError(
            f"{path}: index {problem}: {index.size} bytes, but a header with {count} sequences "
            f"and {doc_count} document indices needs {expected}"
        )
    return DTYPE_CODES[code], count, doc_count, _HEADER.size
