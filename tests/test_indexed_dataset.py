"""Megatron indexed dataset: our writer/reader against megatron-core's own classes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from preprocessing.indexed_dataset import (
    DTYPE_CODES,
    IndexedDatasetError,
    IndexedDatasetReader,
    IndexedDatasetWriter,
    token_dtype,
)

megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def random_documents(rng: np.random.Generator, count: int, vocab: int) -> list[np.ndarray]:
    lengths = rng.integers(0, 50, size=count)
    lengths[0] = 0  # an empty document is legal
    return [rng.integers(0, vocab, size=n) for n in lengths]


def write_documents(prefix: str, documents: list[np.ndarray], dtype) -> None:
    """Half the documents one at a time, the rest as one batch."""
    half = len(documents) // 2
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents[:half]:
            writer.add_document(doc)
        rest = documents[half:]
        writer.add_documents(np.concatenate(rest), np.array([d.size for d in rest]))
    assert writer.num_documents == len(documents)
    assert writer.num_tokens == sum(d.size for d in documents)


def test_token_dtype_follows_megatron():
    assert token_dtype(32000) == np.uint16
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(128256) == np.int32
    for vocab in (100, 65499, 65500, 200000):
        assert token_dtype(vocab) == megatron_indexed.DType.optimal_dtype(vocab)
    for code, dtype in DTYPE_CODES.items():
        assert megatron_indexed.DType.code_from_dtype(dtype.type) == code


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    documents = random_documents(rng, 40, 30000)
    prefix = str(tmp_path / "shard")
    write_documents(prefix, documents, np.uint16)

    reader = IndexedDatasetReader(prefix)
    assert len(reader) == reader.num_documents == len(documents)
    assert reader.dtype == np.uint16
    assert reader.num_tokens == sum(d.size for d in documents)
    np.testing.assert_array_equal(reader.document_indices, np.arange(len(documents) + 1))
    for i, doc in enumerate(documents):
        np.testing.assert_array_equal(reader[i], doc)
    i = int(np.argmax([d.size for d in documents]))
    doc = documents[i]
    np.testing.assert_array_equal(reader.get(i, offset=2), doc[2:])
    np.testing.assert_array_equal(reader.get(i, offset=1, length=3), doc[1:4])
    with pytest.raises(IndexError):
        reader.get(i, offset=doc.size, length=1)
    with pytest.raises(IndexError):
        reader[len(documents)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_our_files(tmp_path, dtype):
    rng = np.random.default_rng(1)
    vocab = 60000 if dtype == np.uint16 else 150000
    documents = random_documents(rng, 30, vocab)
    prefix = str(tmp_path / "ours")
    write_documents(prefix, documents, dtype)

    theirs = megatron_indexed.IndexedDataset(prefix)
    assert theirs.index.dtype == dtype
    assert len(theirs) == len(documents)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(documents) + 1))
    for i, doc in enumerate(documents):
        np.testing.assert_array_equal(theirs[i], doc)
        if doc.size > 2:
            np.testing.assert_array_equal(theirs.get(i, offset=1, length=2), doc[1:3])


def test_we_read_megatron_files(tmp_path):
    import torch

    rng = np.random.default_rng(2)
    prefix = str(tmp_path / "theirs")
    builder = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    sequences, document_ends = [], [0]
    for _ in range(12):  # documents of 1-3 sequences
        for _ in range(rng.integers(1, 4)):
            seq = rng.integers(0, 100000, size=rng.integers(1, 30))
            builder.add_item(torch.from_numpy(seq))
            sequences.append(seq)
        builder.end_document()
        document_ends.append(len(sequences))
    doc = rng.integers(0, 100000, size=10)  # and one via add_document with two sequences
    builder.add_document(torch.from_numpy(doc), [4, 6])
    sequences += [doc[:4], doc[4:]]
    document_ends.append(len(sequences))
    builder.finalize(prefix + ".idx")

    reader = IndexedDatasetReader(prefix)
    assert reader.dtype == np.int32
    assert len(reader) == len(sequences)
    assert reader.num_documents == len(document_ends) - 1
    np.testing.assert_array_equal(reader.document_indices, document_ends)
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(reader[i], seq)
    reference = megatron_indexed.IndexedDataset(prefix)
    np.testing.assert_array_equal(reader.sequence_pointers, reference.index.sequence_pointers)


@pytest.fixture
def good_prefix(tmp_path) -> str:
    prefix = str(tmp_path / "good")
    write_documents(prefix, random_documents(np.random.default_rng(3), 10, 1000), np.uint16)
    return prefix


def patch_bytes(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


@pytest.mark.parametrize(
    ("offset", "data", "message"),
    [
        (0, b"NOTMAGIC!", "bad magic"),
        (9, struct.pack("<Q", 2), "version 2"),
        (17, struct.pack("<B", 9), "unknown dtype code 9"),
        (18, struct.pack("<Q", 11), "truncated"),
    ],
)
def test_corrupt_header(good_prefix, offset, data, message):
    patch_bytes(good_prefix + ".idx", offset, data)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDatasetReader(good_prefix)
    assert "good.idx" in str(info.value)


def test_truncated_files(good_prefix):
    idx = good_prefix + ".idx"
    with open(idx, "r+b") as handle:
        size = handle.seek(0, 2)
        handle.truncate(size - 3)
    with pytest.raises(IndexedDatasetError, match="good.idx: index truncated"):
        IndexedDatasetReader(good_prefix)
    with open(idx, "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(IndexedDatasetError, match="header alone"):
        IndexedDatasetReader(good_prefix)


def test_bin_size_mismatch(good_prefix):
    with open(good_prefix + ".bin", "ab") as handle:
        handle.write(b"\x00\x00")
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: .* bytes, but the \.idx lists"):
        IndexedDatasetReader(good_prefix)


def test_missing_files(tmp_path, good_prefix):
    with pytest.raises(IndexedDatasetError, match="missing"):
        IndexedDatasetReader(str(tmp_path / "nothing"))
    (tmp_path / "good.bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: missing"):
        IndexedDatasetReader(good_prefix)


def test_writer_rejects_bad_input(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "w"), np.uint16) as writer:
        with pytest.raises(ValueError, match="outside what uint16 holds"):
            writer.add_documents(np.array([1, 70000]), np.array([2]))
        with pytest.raises(ValueError, match="lengths sum to 3"):
            writer.add_documents(np.array([1, 2]), np.array([3]))
    with pytest.raises(RuntimeError), IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("interrupted")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetWriter(prefix, np.int32).finalize()
    reader = IndexedDatasetReader(prefix)
    assert len(reader) == 0 and reader.num_documents == 0 and reader.num_tokens == 0
