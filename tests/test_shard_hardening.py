"""Crafted shard sets (issue 16): every bad .idx, manifest or token id is refused cleanly.

Real files through the real readers, and ``megalith`` as a subprocess where the user
meets them; the fuzz tests feed generated .idx bytes and manifests to the same readers
and accept no error but the project's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megalith.config import DataConfig, TokenizerConfig
from megalith.errors import MegalithError
from megalith.storage import sha256_of_file
from preprocessing.indexed_dataset import (
    MAGIC,
    IndexedDatasetError,
    IndexedDatasetReader,
    IndexedDatasetWriter,
    write_index,
)
from preprocessing.manifest import MANIFEST_NAME, ManifestError, read_manifest
from preprocessing.prepare import check_token_ids, prepare_dataset
from preprocessing.tokenizer import Tokenizer, train_tokenizer
from preprocessing.verify import verify_shard_set
from tests.test_data_cli import assert_clean_error, megalith
from tests.test_gpt_dataset import config, write_shard_set
from training.data import ShardSetError, build_gpt_datasets, open_shard_set

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "preprocessing" / "sample_corpus" / "stories.jsonl"
VOCAB = 1000
BAD_ID = 5000  # past the vocabulary, and past tiny-cpu's 2048-row embedding

# A good uint16 index: four sequences (one empty) in three documents, 20 bytes of tokens.
LENGTHS = [3, 0, 5, 2]
POINTERS = [0, 6, 6, 16]
DOCUMENTS = [0, 1, 3, 4]
BIN_BYTES = 20


def write_pair(
    prefix: Path,
    lengths: list[int] = LENGTHS,
    pointers: list[int] = POINTERS,
    documents: list[int] = DOCUMENTS,
    bin_bytes: int = BIN_BYTES,
) -> str:
    """A .idx written by the real writer function from these arrays, and a .bin of zeros."""
    write_index(
        f"{prefix}.idx",
        np.dtype(np.uint16),
        np.array(lengths, dtype=np.int32),
        np.array(pointers, dtype=np.int64),
        np.array(documents, dtype=np.int64),
    )
    Path(f"{prefix}.bin").write_bytes(bytes(bin_bytes))
    return str(prefix)


def test_the_crafted_baseline_is_sound(tmp_path: Path) -> None:
    reader = IndexedDatasetReader(write_pair(tmp_path / "s"))
    assert (len(reader), reader.num_documents, reader.num_tokens) == (4, 3, 10)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lengths": [3, 0, -5, 2]}, r"s\.idx: sequence 2 has length -5"),
        ({"pointers": [2, 8, 8, 18]}, r"s\.idx: sequence 0 starts at byte 2 .*expected 0"),
        ({"pointers": [0, 6, 6, 4]}, r"s\.idx: sequence 3 starts at byte 4 .*expected 16"),
        ({"pointers": [0, 6, 0, 16]}, r"s\.idx: sequence 2 starts at byte 0 .*expected 6"),
        ({"pointers": [0, 6, 6, 1 << 40]}, r"sequence 3 starts at byte 1099511627776"),
        ({"lengths": [3, 0, 5, 2**31 - 1]}, r"s\.bin: 20 bytes, .*ending at byte 4294967310"),
        (
            {"bin_bytes": 22},
            r"s\.bin: 22 bytes, but the \.idx lists sequences .* ending at byte 20",
        ),
        ({"bin_bytes": 18}, r"s\.bin: 18 bytes"),
        ({"documents": [1, 1, 3, 4]}, r"s\.idx: document indices must run from 0 .* \[1, 4\]"),
        ({"documents": [0, 1, 3, 3]}, r"document indices must run from 0 to the sequence count 4"),
        ({"documents": [0, 3, 1, 4]}, r"s\.idx: document index 2 is 1, below the one before it"),
    ],
)
def test_each_defect_of_an_index_is_named(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    prefix = write_pair(tmp_path / "s", **change)
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDatasetReader(prefix)


def header(count: int, doc_count: int, code: int = 8, version: int = 1) -> bytes:
    return struct.pack("<9sQBQQ", MAGIC, version, code, count, doc_count)


@pytest.mark.parametrize(
    ("count", "doc_count"), [(1 << 60, 1), (2**64 - 1, 2**64 - 1), (0, 1 << 62), (3, 2**63)]
)
def test_huge_counts_in_a_tiny_index_are_refused_at_once(
    tmp_path: Path, count: int, doc_count: int
) -> None:
    (tmp_path / "s.idx").write_bytes(header(count, doc_count) + bytes(64))
    (tmp_path / "s.bin").write_bytes(bytes(16))
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(IndexedDatasetError, match=r"s\.idx: index truncated: 98 bytes"):
            IndexedDatasetReader(str(tmp_path / "s"))
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0
    assert peak < 1 << 20, f"{peak} bytes allocated for a 98-byte index"


def test_an_index_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir.idx").mkdir()
    with pytest.raises(IndexedDatasetError, match=r"dir\.idx: not a regular file"):
        IndexedDatasetReader(str(tmp_path / "dir"))
    prefix = write_pair(tmp_path / "s")
    os.unlink(f"{prefix}.bin")
    os.mkfifo(f"{prefix}.bin")  # opening a pipe would block forever
    with pytest.raises(IndexedDatasetError, match=r"s\.bin: not a regular file"):
        IndexedDatasetReader(prefix)


# ------------------------------------------------------------------ token ids


def documents_with(bad_document: int | None, count: int = 6) -> list[np.ndarray]:
    documents = [np.arange(i, i + 40) % VOCAB for i in range(count)]
    if bad_document is not None:
        documents[bad_document][17] = BAD_ID
    return documents


def stories() -> list[str]:
    return [json.loads(line)["text"] for line in STORIES.read_text().splitlines()[:300]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tokenizer") / "tok"
    return train_tokenizer(stories(), TokenizerConfig(vocab_size=VOCAB), str(prefix))


@pytest.fixture
def bad_ids(tmp_path: Path, tokenizer: Tokenizer) -> Path:
    """Two shards made with a real tokenizer; document 2 of shard-00001 holds one id past
    its vocabulary."""
    root = tmp_path / "bad-ids"
    write_shard_set(root, [documents_with(None), documents_with(2)], vocab=VOCAB)
    edit_manifest(root, lambda m: m["tokenizer"].update(id=tokenizer.id, path=tokenizer.model_path))
    return root


def test_verify_names_the_shard_and_document_of_an_id_past_the_vocabulary(bad_ids: Path):
    problems = verify_shard_set(str(bad_ids))
    assert len(problems) == 1, problems
    assert "shard-00001.bin: document 2 holds token id 5000; expected below 1000" in problems[0]


def test_verify_cli_fails_on_an_id_past_the_vocabulary(bad_ids: Path) -> None:
    result = megalith("data", "verify", bad_ids)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "shard-00001.bin: document 2 holds token id 5000" in result.stderr


def test_verify_passes_ids_inside_the_vocabulary(tmp_path: Path) -> None:
    write_shard_set(tmp_path / "good", [documents_with(None)], vocab=VOCAB)
    assert verify_shard_set(str(tmp_path / "good")) == []


def test_the_training_guard_names_shard_and_document_through_a_worker(
    tmp_path: Path, bad_ids: Path
) -> None:
    train, _, _ = build_gpt_datasets(config(tmp_path, bad_ids), (40, 0, 0))
    loader = torch.utils.data.DataLoader(train, batch_size=4, num_workers=1)
    with pytest.raises(ShardSetError) as info:
        for _ in loader:
            pass
    message = str(info.value)
    assert message.startswith(f"{bad_ids}/shard-00001: document 2 holds token id 5000")
    assert "\n" not in message and "Traceback" not in message


def test_megalith_train_stops_cleanly_at_an_id_past_the_vocabulary(
    tmp_path: Path, bad_ids: Path
) -> None:
    result = megalith(
        "train",
        "--config",
        REPO / "configs/tiny-cpu.yaml",
        "--output",
        tmp_path / "run",
        "--quiet",
        *("--set", f"data.blend=[{{path: {bad_ids}}}]"),
        *("--set", "data.split=[1, 0, 0]", "--set", "data.seq_length=16"),
        *("--set", "training.train_iters=10", "--set", "training.num_workers=1"),
        *("--set", "training.micro_batch_size=4", "--set", "training.global_batch_size=4"),
        *("--set", "logging.mlflow=false"),
        cwd=tmp_path,
    )
    assert_clean_error(result, "shard-00001: document 2 holds token id 5000", "vocabulary")


def test_prepare_refuses_ids_outside_the_tokenizers_vocabulary(tokenizer: Tokenizer) -> None:
    ids = np.array([i for text in stories()[:20] for i in tokenizer.encode(text)], np.int32)
    check_token_ids(ids, tokenizer, "shard-00000")  # what the tokenizer produces passes
    ids[7] = tokenizer.vocab_size
    with pytest.raises(MegalithError, match=r"tok\.model: produced token id 1000 for shard-00003"):
        check_token_ids(ids, tokenizer, "shard-00003")


# ------------------------------------------------------------------ manifests


@pytest.fixture
def good_set(tmp_path: Path) -> Path:
    root = tmp_path / "set"
    write_shard_set(root, [documents_with(None), documents_with(None)], vocab=VOCAB)
    return root


def edit_manifest(root: Path, edit) -> None:  # noqa: ANN001 - a function of the manifest dict
    path = root / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def set_files_key(manifest: dict, old: str, new: str) -> None:
    files = manifest["shards"][0]["files"]
    files[new] = files.pop(old)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m["shards"][0]["files"]["shard-00000.bin"].update(bytes="abc"),
            r"shards\.0\.files\.shard-00000\.bin\.bytes: Input should be a valid integer",
        ),
        (
            lambda m: m["shards"][0]["files"]["shard-00000.bin"].update(bytes="120"),
            r"shards\.0\.files\.shard-00000\.bin\.bytes: Input should be a valid integer",
        ),
        (lambda m: m["shards"][1].update(documents=-1), r"shards\.1\.documents: .*0"),
        (lambda m: m.update(dtype="object"), r"dtype: Input should be 'uint8'"),
        (lambda m: m["tokenizer"].update(vocab_size=True), r"tokenizer\.vocab_size: .*integer"),
        (lambda m: m["tokenizer"].update(eod_id=VOCAB), r"eod_id 1000 is outside the vocabulary"),
        (lambda m: m.update(tokenizer="tok"), r"tokenizer: Input should be .*TokenizerInfo"),
        (lambda m: m.update(version="1"), r"manifest version '1' is not supported"),
        (lambda m: m["shards"][0].update(name="../shard-00000"), r"shards\.0\.name '\.\./shard"),
        (lambda m: m["shards"][0].update(name="/etc/passwd"), r"shards\.0\.name '/etc/passwd'"),
        (lambda m: m["shards"][0].update(name=".."), r"shards\.0\.name '\.\.' is not a plain"),
        (
            lambda m: set_files_key(m, "shard-00000.bin", "../shard-00000.bin"),
            r"shards\.0\.files lists \['\.\./shard-00000\.bin', 'shard-00000\.idx'\]; expected",
        ),
        (
            lambda m: set_files_key(m, "shard-00000.bin", "/etc/passwd"),
            r"shards\.0\.files lists \['/etc/passwd', 'shard-00000\.idx'\]",
        ),
        (lambda m: m["shards"][1].update(name="shard-00000"), r"'shard-00000' is listed twice"),
    ],
)
def test_a_bad_manifest_field_is_named(good_set: Path, edit, message: str) -> None:  # noqa: ANN001
    edit_manifest(good_set, edit)
    with pytest.raises(ManifestError, match=message) as info:
        read_manifest(str(good_set))
    assert f"{good_set}/manifest.json" in str(info.value)
    with pytest.raises(ShardSetError, match=message):
        open_shard_set(str(good_set))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "megalith-shards", "vers', r"not valid JSON"),
        ("[]", r"expected a JSON object at the top, found array"),
        ("[" * 100_000, r"nested deeper than 64 levels"),
        ("", r"not valid JSON"),
    ],
)
def test_a_corrupt_manifest_is_a_clean_error(good_set: Path, text: str, message: str) -> None:
    (good_set / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError, match=message):
        read_manifest(str(good_set))
    [problem] = verify_shard_set(str(good_set))
    assert "manifest.json" in problem


def test_a_shard_file_linked_out_of_the_folder_is_refused(good_set: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere.bin"
    (good_set / "shard-00001.bin").rename(elsewhere)
    (good_set / "shard-00001.bin").symlink_to(elsewhere)
    with pytest.raises(ManifestError, match=r"shard-00001\.bin: a symbolic link to .*outside"):
        read_manifest(str(good_set))
    assert "symbolic link" in verify_shard_set(str(good_set))[0]


def test_a_manifest_linked_out_of_the_folder_is_refused(good_set: Path, tmp_path: Path):
    (good_set / MANIFEST_NAME).rename(tmp_path / "other.json")
    (good_set / MANIFEST_NAME).symlink_to(tmp_path / "other.json")
    with pytest.raises(ManifestError, match=r"manifest\.json: a symbolic link"):
        read_manifest(str(good_set))


def test_a_link_inside_the_folder_is_allowed(good_set: Path) -> None:
    (good_set / "shard-00001.bin").rename(good_set / "real.bin")
    (good_set / "shard-00001.bin").symlink_to("real.bin")
    assert verify_shard_set(str(good_set)) == []


def test_verify_and_inspect_cli_name_the_bad_key(good_set: Path) -> None:
    edit_manifest(
        good_set, lambda m: m["shards"][0]["files"]["shard-00000.idx"].update(bytes="abc")
    )
    assert_clean_error(
        megalith("data", "inspect", good_set), "manifest.json", "shards.0.files", "bytes"
    )
    verified = megalith("data", "verify", good_set)
    assert verified.returncode == 1 and "Traceback" not in verified.stderr
    assert "shard-00000.idx.bytes: Input should be a valid integer" in verified.stderr


def test_a_manifest_in_a_symlink_loop_is_one_line(good_set: Path) -> None:
    manifest = good_set / "manifest.json"
    manifest.unlink()
    manifest.symlink_to("manifest.json")  # points at itself: ELOOP on every open
    for command in ("verify", "inspect"):
        result = megalith("data", command, good_set)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "manifest.json: Too many levels of symbolic links (ELOOP)" in result.stderr


def test_inspect_and_verify_cli_refuse_a_corrupt_index(bad_ids: Path) -> None:
    """A pointer rewritten and the manifest's hash updated to match: the index check itself
    must catch it, in verify and in inspect --decode."""
    idx = bad_ids / "shard-00000.idx"
    with open(idx, "r+b") as handle:
        handle.seek(34 + 4 * 6 + 8 * 2)  # header, six lengths, then the third pointer
        handle.write(struct.pack("<q", 3))
    edit_manifest(
        bad_ids,
        lambda m: m["shards"][0]["files"]["shard-00000.idx"].update(
            sha256=sha256_of_file(str(idx))
        ),
    )
    expected = "shard-00000.idx: sequence 2 starts at byte 3 of the .bin; expected 320"
    verified = megalith("data", "verify", bad_ids)
    assert verified.returncode == 1 and "Traceback" not in verified.stderr
    assert expected in verified.stderr
    assert_clean_error(megalith("data", "inspect", "--decode", "2", bad_ids), expected)


def test_megalith_train_on_a_truncated_manifest_is_a_clean_error(
    good_set: Path, tmp_path: Path
) -> None:
    text = (good_set / MANIFEST_NAME).read_text()
    (good_set / MANIFEST_NAME).write_text(text[: len(text) // 2])
    result = megalith(
        "train",
        "--config",
        REPO / "configs/tiny-cpu.yaml",
        "--set",
        f"data.blend=[{{path: {good_set}}}]",
        "--set",
        "logging.mlflow=false",
        "--output",
        tmp_path / "run",
        cwd=tmp_path,
    )
    assert_clean_error(result, f"{good_set}/manifest.json: not valid JSON")
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ fuzz

FUZZ = settings(max_examples=150, deadline=None)


@FUZZ
@given(
    code=st.integers(0, 10),
    version=st.sampled_from([1, 1, 1, 2]),
    lengths=st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(0, 6), max_size=6),
    pointers=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 40), max_size=6),
    documents=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 6), max_size=7),
    claimed=st.none() | st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    tail=st.binary(max_size=16),
    bin_bytes=st.integers(0, 64),
)
def test_fuzz_index_files_only_raise_our_error(
    code, version, lengths, pointers, documents, claimed, tail, bin_bytes
) -> None:  # noqa: ANN001 - hypothesis arguments
    count, doc_count = claimed or (len(lengths), len(documents))
    body = (
        np.array(lengths, np.int32).tobytes()
        + np.array(pointers, np.int64).tobytes()
        + np.array(documents, np.int64).tobytes()
    )
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "s")
        Path(f"{prefix}.idx").write_bytes(header(count, doc_count, code, version) + body + tail)
        Path(f"{prefix}.bin").write_bytes(bytes(bin_bytes))
        try:
            reader = IndexedDatasetReader(prefix)
        except MegalithError:
            return
        for i in range(len(reader)):  # a reader that opened serves every sequence
            assert reader[i].size == reader.sequence_lengths[i]
        reader.first_token_outside(VOCAB)


@pytest.fixture(scope="module")
def fuzz_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("fuzz") / "set"
    write_shard_set(root, [documents_with(None)], vocab=VOCAB)
    return root, json.loads((root / MANIFEST_NAME).read_text())


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


def replace_at(value: Any, path: list[int], new: Any) -> Any:
    """``value`` with the node reached by following ``path`` (indices modulo each container's
    size) replaced by ``new``."""
    if not path or not isinstance(value, dict | list) or not value:
        return new
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    key = keys[path[0] % len(keys)]
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[key] = replace_at(value[key], path[1:], new)
    return copy


@FUZZ
@given(
    path=st.lists(st.integers(0, 50), max_size=6),
    new=JSON_VALUES,
    raw=st.none() | st.binary(max_size=64),
)
def test_fuzz_manifests_only_raise_our_error(fuzz_set, path, new, raw) -> None:  # noqa: ANN001
    root, manifest = fuzz_set
    data = raw if raw is not None else json.dumps(replace_at(manifest, path, new)).encode()
    (root / MANIFEST_NAME).write_bytes(data)
    with contextlib.suppress(MegalithError):
        open_shard_set(str(root))
    assert isinstance(verify_shard_set(str(root)), list)


def test_a_cache_description_linked_to_dev_zero_is_rebuilt(tmp_path: Path, good_set: Path):
    data = config(tmp_path, good_set)
    first = build_gpt_datasets(data, (8, 0, 0))[0]
    [described] = (tmp_path / "cache").glob("*-description.json")
    described.unlink()
    described.symlink_to("/dev/zero")  # read whole, this would never end
    again = build_gpt_datasets(data, (8, 0, 0))[0]
    assert [again[i]["tokens"].tolist() for i in range(8)] == [
        first[i]["tokens"].tolist() for i in range(8)
    ]
    assert described.is_file() and not described.is_symlink()


def test_inspect_decode_refuses_an_id_past_the_vocabulary(tmp_path: Path, tokenizer: Tokenizer):
    root = tmp_path / "set"
    write_shard_set(root, [documents_with(1)], vocab=VOCAB)
    edit_manifest(root, lambda m: m["tokenizer"].update(id=tokenizer.id, path=tokenizer.model_path))
    assert_clean_error(
        megalith("data", "inspect", "--decode", "3", root),
        "shard-00000.bin: document 1 holds a token id outside the tokenizer's 1000 ids",
    )


def test_a_manifest_tokenizer_path_to_dev_zero_is_refused(good_set: Path) -> None:
    edit_manifest(good_set, lambda m: m["tokenizer"].update(path="/dev/zero"))
    assert_clean_error(
        megalith("data", "inspect", "--decode", "1", good_set), "/dev/zero: not a regular file"
    )


def test_a_pipe_listed_as_an_empty_shard_file_is_refused_not_hashed(good_set: Path):
    (good_set / "shard-00001.bin").unlink()
    os.mkfifo(good_set / "shard-00001.bin")  # reading it to hash it would wait forever
    edit_manifest(good_set, lambda m: m["shards"][1]["files"]["shard-00001.bin"].update(bytes=0))
    [problem] = verify_shard_set(str(good_set))
    assert problem.endswith("shard-00001.bin: not a regular file (a device, pipe or folder)")
    with pytest.raises(ShardSetError, match="shard-00001.bin: not a regular file"):
        open_shard_set(str(good_set))


def test_a_loss_mask_value_above_one_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "chat"
    documents = documents_with(None)
    write_shard_set(root, [documents], vocab=VOCAB)
    masks = [np.ones(d.size, np.uint8) for d in documents]
    masks[1][5] = 7  # would weight that token's loss 7 times
    with IndexedDatasetWriter(str(root / "shard-00000.mask"), np.uint8) as writer:
        writer.add_documents(np.concatenate(masks), np.array([m.size for m in masks]))

    def as_chat(manifest: dict) -> None:
        manifest["data_format"] = "chat"
        for suffix in (".mask.bin", ".mask.idx"):
            path = root / f"shard-00000{suffix}"
            info = {"sha256": sha256_of_file(str(path)), "bytes": path.stat().st_size}
            manifest["shards"][0]["files"][path.name] = info

    edit_manifest(root, as_chat)
    [problem] = verify_shard_set(str(root))
    assert "shard-00000.mask.bin: document 1 holds loss-mask value 7; expected below 2" in problem
    train, _, _ = build_gpt_datasets(config(tmp_path, root, format="chat"), (12, 0, 0))
    with pytest.raises(
        ShardSetError, match=r"shard-00000\.mask: document 1 holds loss-mask value 7"
    ):
        for index in range(len(train)):
            train[index]


def test_prepare_redoes_a_shard_whose_state_record_is_damaged(tmp_path: Path, tokenizer):  # noqa: ANN001
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in stories()[:60]) + "\n")
    data = DataConfig(inputs=[str(corpus)], output=str(tmp_path / "out"), workers=1, shards=2)
    first = prepare_dataset(data, tokenizer, show_progress=False).manifest
    state = tmp_path / "out" / ".prepare"
    marker = json.loads((state / "shard-00001.json").read_text())
    marker["shard"]["documents"] = "x"
    (state / "shard-00001.json").write_text(json.dumps(marker))
    (state / "shard-00000.json").write_text("5")
    scan = json.loads((state / "scan.json").read_text())
    (state / "scan.json").write_text(json.dumps({**scan, "unknown": 1}))
    again = prepare_dataset(data, tokenizer, show_progress=False)
    assert sorted(again.written) == ["shard-00000", "shard-00001"]
    assert again.manifest.shards == first.shards
    assert verify_shard_set(str(tmp_path / "out")) == []
