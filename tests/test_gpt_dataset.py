"""GPT training dataset over shard sets: samples, splits, epochs, cache, blending, s3."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from megalith.config import DataConfig, DatasetSource
from megalith.storage import sha256_of_file
from preprocessing.indexed_dataset import IndexedDatasetWriter
from preprocessing.manifest import (
    FileInfo,
    Manifest,
    RejectedRecords,
    ShardInfo,
    TokenizerInfo,
    read_manifest,
    write_manifest,
)
from training.data import (
    BlendedDataset,
    GPTDataset,
    ShardSetError,
    blending,
    build_gpt_datasets,
    gpt_dataset,
)
from training.data.blending import blending_indices
from training.data.gpt_dataset import split_document_ranges

SEQ = 8
DOC_STRIDE = (
    1000  # token = DOC_STRIDE * global document id + position: every token names its document
)
VOCAB = 1 << 24  # holds every id above (training checks ids against the vocabulary)


def make_documents(count: int, seed: int, first_id: int = 0, max_len: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, size=count)
    return [DOC_STRIDE * (first_id + i) + np.arange(n) for i, n in enumerate(lengths)]


def write_shard_set(
    root: Path, shards: list[list[np.ndarray]], tokenizer_id: str = "tok-a", vocab: int = VOCAB
) -> list[np.ndarray]:
    """Write shards with our writer and a manifest with real sha256s; return all documents."""
    root.mkdir(parents=True, exist_ok=True)
    infos = []
    for index, documents in enumerate(shards):
        name = f"shard-{index:05d}"
        with IndexedDatasetWriter(str(root / name), np.int32) as writer:
            writer.add_documents(np.concatenate(documents), np.array([d.size for d in documents]))
        files = {
            f"{name}{suffix}": FileInfo(
                sha256=sha256_of_file(str(root / f"{name}{suffix}")),
                bytes=(root / f"{name}{suffix}").stat().st_size,
            )
            for suffix in (".bin", ".idx")
        }
        infos.append(
            ShardInfo(
                name=name,
                documents=len(documents),
                tokens=sum(d.size for d in documents),
                files=files,
            )
        )
    manifest = Manifest(
        created_at="2026-01-01T00:00:00+00:00",
        megalith_version="test",
        tokenizer=TokenizerInfo(
            id=tokenizer_id, path="tok.model", vocab_size=vocab, padded_vocab_size=vocab, eod_id=0
        ),
        dtype="int32",
        append_eod=True,
        documents=sum(s.documents for s in infos),
        tokens=sum(s.tokens for s in infos),
        shards=infos,
        inputs=[],
        rejected=RejectedRecords(),
        config={},
    )
    write_manifest(str(root), manifest)
    return [doc for documents in shards for doc in documents]


@pytest.fixture
def shard_set(tmp_path) -> tuple[Path, list[np.ndarray]]:
    """Three shards, 120 documents of 0-39 tokens (some empty)."""
    documents = make_documents(120, seed=0)
    root = tmp_path / "set-a"
    write_shard_set(root, [documents[:50], documents[50:51], documents[51:]])
    return root, documents


def config(tmp_path: Path, *paths: Path, **overrides) -> DataConfig:
    values = {"seq_length": SEQ, "seed": 7, "split": (1.0, 0.0, 0.0)}
    values.update(overrides)
    if "cache_dir" not in values:
        values["cache_dir"] = str(tmp_path / "cache")
    return DataConfig(blend=[DatasetSource(path=str(p)) for p in paths], **values)


def all_tokens(dataset) -> list[np.ndarray]:
    return [dataset[i]["tokens"].numpy() for i in range(len(dataset))]


def test_samples_are_slices_of_the_shuffled_stream(tmp_path, shard_set):
    root, documents = shard_set
    total = sum(d.size for d in documents)
    num_samples = 3 * total // SEQ + 5  # a bit over three epochs
    train, valid, test = build_gpt_datasets(config(tmp_path, root), (num_samples, 0, 0))
    assert isinstance(train, GPTDataset) and valid is None and test is None
    assert len(train) == num_samples

    # Every epoch is one permutation of all documents.
    epochs = np.asarray(train.document_index).reshape(-1, len(documents))
    assert len(epochs) >= 4
    for epoch in epochs:
        assert sorted(epoch) == list(range(len(documents)))
    assert not np.array_equal(epochs[0], epochs[1])

    stream = np.concatenate([documents[d] for d in train.document_index])
    for index in range(num_samples):
        sample = train[index]["tokens"]
        assert sample.dtype.is_floating_point is False and sample.shape == (SEQ + 1,)
        start = int(train.shuffle_index[index]) * SEQ
        np.testing.assert_array_equal(sample.numpy(), stream[start : start + SEQ + 1])
    # The shuffle covers each block of stream samples exactly once.
    per_block = train.plan.samples_per_block
    assert sorted(train.shuffle_index[:per_block]) == list(range(per_block))


def test_splits_are_disjoint_by_document(tmp_path, shard_set):
    root, documents = shard_set
    data = config(tmp_path, root, split=(0.6, 0.2, 0.2))
    datasets = build_gpt_datasets(data, (200, 40, 40))
    ranges = split_document_ranges(len(documents), data.split)
    assert [len(r) for r in ranges] == [72, 24, 24]
    seen = []
    for dataset, documents_range in zip(datasets, ranges, strict=True):
        ids = {int(t) // DOC_STRIDE for sample in all_tokens(dataset) for t in sample}
        assert ids <= set(documents_range)
        seen.append(ids)
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


def test_empty_split_is_none(tmp_path, shard_set):
    root, _ = shard_set
    train, valid, test = build_gpt_datasets(
        config(tmp_path, root, split=(0.9, 0.1, 0.0)), (10, 5, 5)
    )
    assert train is not None and valid is not None and test is None


def test_same_sample_at_every_index(tmp_path, shard_set):
    root, _ = shard_set
    first = build_gpt_datasets(config(tmp_path, root, cache_dir=str(tmp_path / "c1")), (500, 0, 0))[
        0
    ]
    again = build_gpt_datasets(config(tmp_path, root, cache_dir=str(tmp_path / "c2")), (500, 0, 0))[
        0
    ]
    longer = build_gpt_datasets(
        config(tmp_path, root, cache_dir=str(tmp_path / "c3")), (900, 0, 0)
    )[0]
    other_seed = build_gpt_datasets(config(tmp_path, root, seed=8), (500, 0, 0))[0]
    reference = all_tokens(first)
    np.testing.assert_array_equal(reference, all_tokens(again))
    # Asking for more samples extends the sequence without changing its start.
    np.testing.assert_array_equal(reference, all_tokens(longer)[:500])
    assert not np.array_equal(reference, all_tokens(other_seed))
    # A copy (what a spawned DataLoader worker gets) re-maps the indices and agrees.
    np.testing.assert_array_equal(reference, all_tokens(copy.deepcopy(first)))


def test_restart_reuses_the_cache(tmp_path, shard_set, monkeypatch):
    root, documents = shard_set
    other = tmp_path / "set-b"
    write_shard_set(other, [make_documents(30, seed=1, first_id=500)])
    data = config(tmp_path, root, other, split=(0.8, 0.2, 0.0))
    built = build_gpt_datasets(data, (300, 30, 0))
    files = sorted((tmp_path / "cache").iterdir())
    assert len(files) == 4 * 4 + 2 * 3  # (2 sets x 2 splits) GPT entries of 4 files, 2 blends of 3
    mtimes = [f.stat().st_mtime_ns for f in files]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("indices were rebuilt")

    monkeypatch.setattr(gpt_dataset, "build_sample_indices", no_rebuild)
    monkeypatch.setattr(blending, "blending_indices", no_rebuild)
    rebuilt = build_gpt_datasets(data, (300, 30, 0))
    assert sorted((tmp_path / "cache").iterdir()) == files
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    for before, after in zip(built[:2], rebuilt[:2], strict=True):
        np.testing.assert_array_equal(all_tokens(before), all_tokens(after))


def test_index_cache_beside_local_data_by_default(tmp_path, shard_set):
    root, _ = shard_set
    data = config(tmp_path, root)
    data.cache_dir = None
    build_gpt_datasets(data, (10, 0, 0))
    assert len(list((root / "index-cache").glob("*.npy"))) == 3


def test_split_shorter_than_one_sample(tmp_path):
    root = tmp_path / "tiny"
    documents = [np.arange(3), np.arange(100, 102)]  # 5 tokens, a sample needs 9
    write_shard_set(root, [documents])
    train = build_gpt_datasets(config(tmp_path, root), (20, 0, 0))[0]
    assert train.plan.epochs_per_block == 2
    stream = np.concatenate([documents[d] for d in train.document_index])
    for index in range(20):
        start = int(train.shuffle_index[index]) * SEQ
        np.testing.assert_array_equal(
            train[index]["tokens"].numpy(), stream[start : start + SEQ + 1]
        )


def test_blend_follows_weights(tmp_path):
    roots = []
    for k in range(3):
        roots.append(tmp_path / f"set-{k}")
        write_shard_set(roots[-1], [make_documents(40, seed=k, first_id=100 * k)])
    weights = [0.2, 0.3, 0.5]
    data = config(tmp_path, *roots)
    data.blend = [
        DatasetSource(path=str(r), weight=w * 10) for r, w in zip(roots, weights, strict=True)
    ]
    train = build_gpt_datasets(data, (2000, 0, 0))[0]
    assert isinstance(train, BlendedDataset) and len(train) == 2000

    # Where each sample came from, read off its tokens.
    origin = np.array([train[i]["tokens"][0].item() // DOC_STRIDE // 100 for i in range(2000)])
    np.testing.assert_array_equal(origin, np.asarray(train.dataset_index))
    counts = np.cumsum(np.eye(3)[origin], axis=0)
    expected = np.arange(1, 2001)[:, None] * np.array(weights)
    assert np.abs(counts - expected).max() <= 1.0
    # Each dataset's samples are taken in order 0, 1, 2, ...
    for k in range(3):
        picked = np.asarray(train.dataset_sample_index)[origin == k]
        np.testing.assert_array_equal(picked, np.arange(picked.size))


def test_blend_matches_megatron_within_one_sample():
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    weights = np.array([0.17, 0.33, 0.05, 0.45])
    size = 50_000
    theirs = np.empty(size, dtype=np.int16)
    helpers.build_blending_indices(theirs, np.empty(size, np.int64), weights, 4, size, False)
    ours = blending_indices(weights, size)["dataset_index"]
    difference = np.cumsum(np.eye(4)[ours] - np.eye(4)[theirs], axis=0)
    assert np.abs(difference).max() <= 1


def test_blend_indices_do_not_depend_on_length():
    long = blending_indices([1, 2, 3], (1 << 20) + 1000)  # crosses a sort window
    short = blending_indices([1, 2, 3], 5000)
    for name in ("dataset_index", "dataset_sample_index"):
        np.testing.assert_array_equal(long[name][:5000], short[name])
    counts = np.bincount(long["dataset_index"])
    np.testing.assert_allclose(counts / counts.sum(), [1 / 6, 2 / 6, 3 / 6], atol=1e-5)


def test_blend_needs_one_tokenizer(tmp_path, shard_set):
    root, _ = shard_set
    other = tmp_path / "other-tok"
    write_shard_set(other, [make_documents(10, seed=3)], tokenizer_id="tok-b")
    with pytest.raises(ShardSetError, match="different tokenizers") as info:
        build_gpt_datasets(config(tmp_path, root, other), (10, 0, 0))
    assert str(root) in str(info.value) and str(other) in str(info.value)


def test_files_must_match_the_manifest(tmp_path, shard_set):
    root, _ = shard_set
    data = config(tmp_path, root)
    with open(root / "shard-00001.bin", "ab") as handle:
        handle.write(b"\x00" * 4)
    with pytest.raises(
        ShardSetError, match=r"shard-00001\.bin: \d+ bytes, but .*manifest\.json says \d+"
    ):
        build_gpt_datasets(data, (10, 0, 0))
    (root / "shard-00001.bin").unlink()
    with pytest.raises(ShardSetError, match=r"shard-00001\.bin: missing"):
        build_gpt_datasets(data, (10, 0, 0))


def test_counts_must_match_the_manifest(tmp_path, shard_set):
    root, _ = shard_set
    manifest = read_manifest(str(root))
    manifest.shards[2].documents += 1
    write_manifest(str(root), manifest)
    with pytest.raises(ShardSetError, match=r"shard-00002: holds 69 documents .* manifest says 70"):
        build_gpt_datasets(config(tmp_path, root), (10, 0, 0))


def test_not_a_shard_set(tmp_path):
    with pytest.raises(ShardSetError, match="manifest.json not found"):
        build_gpt_datasets(config(tmp_path, tmp_path / "nowhere"), (10, 0, 0))


def test_s3_shard_set_is_downloaded_and_verified(tmp_path, shard_set, s3_endpoint, s3_bucket):
    import s3fs

    root, _ = shard_set
    fs = s3fs.S3FileSystem(**s3_endpoint)
    remote = f"{s3_bucket}/set-a"
    for path in root.iterdir():
        fs.put_file(str(path), f"{remote}/{path.name}")

    local = build_gpt_datasets(config(tmp_path, root), (100, 0, 0))[0]
    data = config(tmp_path, remote, cache_dir=str(tmp_path / "s3-cache"))
    data.storage_options = s3_endpoint
    from_s3 = build_gpt_datasets(data, (100, 0, 0))[0]
    np.testing.assert_array_equal(all_tokens(local), all_tokens(from_s3))
    assert len(list((tmp_path / "s3-cache" / "shards").glob("*/shard-*.bin"))) == 3

    # A remote file changed after the manifest was written: same size, other bytes.
    data_bin = (root / "shard-00002.bin").read_bytes()
    fs.pipe_file(f"{remote}/shard-00002.bin", data_bin[::-1])
    data.cache_dir = str(tmp_path / "fresh-cache")
    with pytest.raises(ShardSetError, match=r"shard-00002\.bin: sha256 .* does not match"):
        build_gpt_datasets(data, (100, 0, 0))
    assert not list((tmp_path / "fresh-cache" / "shards").glob("*/shard-00002.bin"))
