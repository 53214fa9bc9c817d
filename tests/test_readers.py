"""Corpus readers: formats, input resolution, bad-record policies and s3://."""

from __future__ import annotations

import gzip
import json
import os
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megalith.errors import MegalithError
from preprocessing import readers
from preprocessing.readers import (
    REJECT_REASONS,
    BadRecordError,
    InputError,
    InputFile,
    RejectLog,
    iter_text_batches,
    resolve_inputs,
)

# ---------------------------------------------------------------- helpers


def docs(n: int, prefix: str = "doc") -> list[str]:
    return [f"{prefix} {i} " + "word " * (i % 7) for i in range(n)]


def jsonl_bytes(texts: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({"id": i, key: t}) + "\n" for i, t in enumerate(texts)).encode()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        data = gzip.compress(data)
    elif path.suffix == ".zst":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def write_parquet(path: Path, table: pa.Table, row_group_size: int = 100) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def read_all(path, **kwargs) -> tuple[list[str], list[readers.TextBatch]]:
    (source,) = resolve_inputs([str(path)], kwargs.pop("input_format", "auto"))
    batches = list(iter_text_batches(source, **kwargs))
    return [t for b in batches for t in b.texts], batches


def read_skipping(path, **kwargs) -> tuple[list[str], RejectLog]:
    rejects = RejectLog()
    texts, _ = read_all(path, on_bad_record="skip", rejects=rejects, **kwargs)
    return texts, rejects


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("name", "compression"),
    [("a.jsonl", None), ("a.jsonl.gz", "gzip"), ("a.jsonl.zst", "zstd"), ("a.ndjson", None)],
)
def test_jsonl_formats(tmp_path, name, compression):
    texts = docs(1000)
    raw = jsonl_bytes(texts)
    path = write(tmp_path / name, raw)
    (source,) = resolve_inputs([str(path)])
    assert source == InputFile(str(path), path.stat().st_size, "jsonl", compression)
    batches = list(iter_text_batches(source, batch_size=64))
    assert [t for b in batches for t in b.texts] == texts
    assert len(batches) == 16 and all(len(b.texts) <= 64 for b in batches)
    assert sum(b.nbytes for b in batches) == len(raw)


def test_zstd_with_several_frames_is_read_to_the_end(tmp_path):
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "multi.jsonl.zst"
    path.write_bytes(
        compressor.compress(jsonl_bytes(["one", "two"])) + compressor.compress(jsonl_bytes(["3"]))
    )
    assert read_all(path)[0] == ["one", "two", "3"]


def test_jsonl_blank_lines_crlf_and_bom_are_handled(tmp_path):
    data = (
        b'\xef\xbb\xbf{"text": "a"}\r\n\r\n   \n{"text": "b"}\r\n  {"text": "c"}  \n{"text": "d"}'
    )
    path = write(tmp_path / "x.jsonl", data)
    assert read_all(path)[0] == ["a", "b", "c", "d"]


def test_parquet_reads_in_several_batches(tmp_path):
    texts = docs(1000)
    table = pa.table({"id": list(range(1000)), "text": texts})
    path = write_parquet(tmp_path / "a.parquet", table, row_group_size=100)
    got, batches = read_all(path, batch_size=64)
    assert got == texts
    assert len(batches) > 10 and all(len(b.texts) <= 64 for b in batches)
    assert sum(b.nbytes for b in batches) == sum(len(t.encode()) for t in texts)


def test_parquet_binary_and_dictionary_columns(tmp_path):
    binary = write_parquet(tmp_path / "b.parquet", pa.table({"text": pa.array([b"x", b"y"])}))
    assert read_all(binary)[0] == ["x", "y"]
    encoded = pa.array(["p", "q", "p"]).dictionary_encode()
    dictionary = write_parquet(tmp_path / "d.parquet", pa.table({"text": encoded}))
    assert read_all(dictionary)[0] == ["p", "q", "p"]


TEXT = b"First para\nstill first.\n\n\n  \nSecond para.\r\n\r\nThird\n"


def test_text_paragraph_mode(tmp_path):
    path = write(tmp_path / "a.txt", TEXT)
    assert read_all(path)[0] == ["First para\nstill first.", "Second para.", "Third"]


def test_text_line_mode(tmp_path):
    path = write(tmp_path / "a.txt.gz", TEXT)
    texts, batches = read_all(path, text_mode="line", batch_size=2)
    assert texts == ["First para", "still first.", "Second para.", "Third"]
    assert [len(b.texts) for b in batches] == [2, 2]
    assert sum(b.nbytes for b in batches) == len(TEXT)


def test_text_file_mode(tmp_path):
    a = write(tmp_path / "d" / "a.md", TEXT)
    write(tmp_path / "d" / "b.text.zst", b"whole file\n")
    sources = resolve_inputs([str(a.parent)])
    texts = [t for s in sources for b in iter_text_batches(s, text_mode="file") for t in b.texts]
    assert texts == [TEXT.decode(), "whole file\n"]


def test_custom_json_key(tmp_path):
    texts = docs(10)
    jsonl = write(tmp_path / "a.jsonl", jsonl_bytes(texts, key="content"))
    parquet = write_parquet(tmp_path / "a.parquet", pa.table({"content": texts}))
    for path in (jsonl, parquet):
        assert read_all(path, json_key="content")[0] == texts


def test_explicit_format_overrides_the_extension(tmp_path):
    path = write(tmp_path / "corpus.log", jsonl_bytes(["x"]))
    with pytest.raises(InputError, match=r"corpus\.log: unknown file extension"):
        resolve_inputs([str(path)])
    assert read_all(path, input_format="jsonl")[0] == ["x"]
    assert read_all(path, input_format="text", text_mode="line")[0] == ['{"id": 0, "text": "x"}']


def test_memory_stays_flat_on_a_large_file(tmp_path, monkeypatch):
    big = "x" * 1000
    path = write(tmp_path / "big.jsonl", jsonl_bytes([big] * 20_000))  # ~20 MB
    monkeypatch.setattr(readers, "MAX_BATCH_BYTES", 100 * 1000)
    (source,) = resolve_inputs([str(path)])
    tracemalloc.start()
    try:
        count = 0
        for batch in iter_text_batches(source, batch_size=256):
            assert 0 < len(batch.texts) <= 100  # cut by bytes before batch_size
            count += len(batch.texts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 20_000
    assert peak < 8 << 20, f"peak {peak / 1e6:.1f} MB while streaming a 20 MB file"


# ---------------------------------------------------------------- inputs


def test_directories_and_globs_expand_sorted_without_duplicates(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.jsonl", jsonl_bytes(["b"]))
    write(root / "a.jsonl.gz", jsonl_bytes(["a"]))
    write(root / "sub" / "c.txt", b"c\n")
    write(root / "sub" / "deeper" / "d.parquet", b"")
    write_parquet(root / "sub" / "deeper" / "d.parquet", pa.table({"text": ["d"]}))
    for ignored in ("README", "notes.csv", ".hidden.jsonl", "_SUCCESS"):
        write(root / ignored, b"ignore me")

    found = resolve_inputs([str(root)])
    assert [Path(f.url).relative_to(root).as_posix() for f in found] == [
        "a.jsonl.gz",
        "b.jsonl",
        "sub/c.txt",
        "sub/deeper/d.parquet",
    ]
    assert [f.format for f in found] == ["jsonl", "jsonl", "text", "parquet"]

    only_jsonl = resolve_inputs([str(root)], input_format="jsonl")
    assert [Path(f.url).name for f in only_jsonl] == ["a.jsonl.gz", "b.jsonl"]

    # Arguments keep their order; each expands sorted; duplicates are dropped.
    mixed = resolve_inputs([str(root / "sub" / "*.txt"), str(root / "*.jsonl*"), str(root)])
    assert [Path(f.url).name for f in mixed] == ["c.txt", "a.jsonl.gz", "b.jsonl", "d.parquet"]
    recursive = resolve_inputs([str(root / "**" / "*.parquet")])
    assert [Path(f.url).name for f in recursive] == ["d.parquet"]


def test_glob_matching_an_unsupported_file_is_an_error(tmp_path):
    write(tmp_path / "a.jsonl", jsonl_bytes(["a"]))
    write(tmp_path / "a.csv", b"x")
    with pytest.raises(InputError, match=r"a\.csv: unknown file extension"):
        resolve_inputs([str(tmp_path / "a.*")])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.jsonl", "no such file or directory"),
        (lambda d: d / "*.parquet", "the pattern matches no files"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "the directory holds no supported files"),
        (lambda d: write_raw(d / "bad.jsonl.gz", b"not gzip"), "cannot read input .*gzip"),
        (lambda d: write_raw(d / "bad.jsonl.zst", b"not zstd"), "cannot read input .*zstd"),
        (lambda d: write_raw(d / "bad.parquet", b"not parquet"), "cannot read input .*arquet"),
        (lambda d: write_raw(d / "x.parquet.gz", b"x"), "compressed parquet files are not"),
    ],
)
def test_bad_inputs_fail_before_any_work(tmp_path, make, message):
    write(tmp_path / "good.jsonl", jsonl_bytes(["ok"]))
    bad = str(make(tmp_path))
    with pytest.raises(InputError, match=message) as caught:
        resolve_inputs([str(tmp_path / "good.jsonl"), bad])
    assert bad in str(caught.value)
    assert isinstance(caught.value, MegalithError)


def test_unreadable_file_fails_in_resolve(tmp_path, monkeypatch):
    path = write(tmp_path / "secret.jsonl", jsonl_bytes(["x"]))
    if os.geteuid() == 0:  # root reads anything: simulate the permission error instead
        real_open = readers.filesystem

        def denying(url, options=None):
            fs, p = real_open(url, options)
            monkeypatch.setattr(fs, "open", _raise_permission_error)
            return fs, p

        monkeypatch.setattr(readers, "filesystem", denying)
    else:
        path.chmod(0)
    with pytest.raises(InputError, match=r"secret\.jsonl: cannot read input \(permission denied\)"):
        resolve_inputs([str(path)])


def _raise_permission_error(*args, **kwargs):
    raise PermissionError(13, "Permission denied")


def test_no_inputs_is_an_error():
    with pytest.raises(InputError, match="no inputs"):
        resolve_inputs([])


# ---------------------------------------------------------------- bad records

GOOD = '{"text": "good"}'
BAD_JSONL_LINES = [
    (b'{"text": "unterminated', "malformed_json", "malformed JSON (Unterminated string"),
    (b'{"text": "a"} trailing', "malformed_json", "malformed JSON (Extra data"),
    (b'{"body": "no text key"}', "missing_field", "field 'text' is missing"),
    (b'{"text": null}', "missing_field", "field 'text' is null"),
    (b"[1, 2]", "missing_field", "not a JSON object (got an array)"),
    (b'{"text": 42}', "not_a_string", "field 'text' is a number, not a string"),
    (b'{"text": ["a"]}', "not_a_string", "field 'text' is an array, not a string"),
    (b'{"text": "caf\xe9"}', "invalid_utf8", "invalid UTF-8 (byte 0xe9 at column 14)"),
    (b'{"text": "x\\ud800y"}', "invalid_utf8", "field 'text' holds a lone surrogate"),
    (b'{"text": " \\n\\t "}', "empty_text", "field 'text' is empty or whitespace"),
    (b'{"text": ""}', "empty_text", "field 'text' is empty or whitespace"),
]


@pytest.mark.parametrize(("line", "reason", "explanation"), BAD_JSONL_LINES)
def test_jsonl_bad_record_fail_policy_names_file_and_line(tmp_path, line, reason, explanation):
    path = write(tmp_path / "data" / "a.jsonl", f"{GOOD}\n\n".encode() + line + b"\n")
    with pytest.raises(BadRecordError) as caught:
        read_all(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: {explanation}")
    assert message.endswith("; use --on-bad-record skip to skip bad records")


@pytest.mark.parametrize(("line", "reason", "explanation"), BAD_JSONL_LINES)
def test_jsonl_bad_record_skip_policy_counts_and_keeps_examples(
    tmp_path, line, reason, explanation
):
    data = f"{GOOD}\n".encode() + line + b"\n" + line + f"\n{GOOD}\n".encode()
    path = write(tmp_path / "a.jsonl", data)
    texts, rejects = read_skipping(path)
    assert texts == ["good", "good"]
    assert rejects.counts == {reason: 2} and rejects.total == 2
    assert [e["location"] for e in rejects.examples] == [f"{path}:2", f"{path}:3"]
    assert all(e["reason"] == reason for e in rejects.examples)
    assert rejects.examples[0]["detail"].startswith(explanation)


def test_every_reason_is_covered_by_jsonl_cases():
    assert {reason for _, reason, _ in BAD_JSONL_LINES} == set(REJECT_REASONS)


def test_parquet_bad_rows(tmp_path):
    table = pa.table({"text": ["ok", None, "  ", "fine"]})
    path = write_parquet(tmp_path / "p.parquet", table, row_group_size=2)
    with pytest.raises(BadRecordError, match=r"p\.parquet:row 1: column 'text' is null; use"):
        read_all(path)
    texts, rejects = read_skipping(path)
    assert texts == ["ok", "fine"]
    assert rejects.counts == {"missing_field": 1, "empty_text": 1}
    assert [e["location"] for e in rejects.examples] == [f"{path}:row 1", f"{path}:row 2"]


def test_parquet_non_string_and_invalid_utf8_columns(tmp_path):
    numbers = write_parquet(tmp_path / "n.parquet", pa.table({"text": [1, 2]}))
    texts, rejects = read_skipping(numbers)
    assert texts == [] and rejects.counts == {"not_a_string": 2}
    raw = write_parquet(tmp_path / "r.parquet", pa.table({"text": pa.array([b"ok", b"\xff"])}))
    texts, rejects = read_skipping(raw)
    assert texts == ["ok"] and rejects.counts == {"invalid_utf8": 1}
    assert rejects.examples[0]["location"] == f"{raw}:row 1"


def test_parquet_missing_column(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", pa.table({"body": ["a", "b", "c"]}))
    with pytest.raises(BadRecordError, match=r"no column 'text' \(columns: body\)"):
        read_all(path)
    texts, rejects = read_skipping(path)
    assert texts == [] and rejects.counts == {"missing_field": 3}
    assert len(rejects.examples) == 1


def test_text_invalid_utf8_in_every_mode(tmp_path):
    path = write(tmp_path / "t.txt", b"good one\n\nbad \xff here\nsame para\n\nlast\n")
    with pytest.raises(BadRecordError, match=r"t\.txt:3: invalid UTF-8 \(byte 0xff at column 5\)"):
        read_all(path)
    expected = {"paragraph": ["good one", "last"], "line": ["good one", "same para", "last"]}
    for mode, texts in expected.items():
        got, rejects = read_skipping(path, text_mode=mode)
        assert got == texts
        assert rejects.counts == {"invalid_utf8": 1}
        assert rejects.examples[0]["location"] == f"{path}:3"
    got, rejects = read_skipping(path, text_mode="file")
    assert got == [] and rejects.examples[0]["location"] == f"{path}:3"


def test_text_empty_file_in_file_mode(tmp_path):
    path = write(tmp_path / "empty.txt", b" \n\n")
    with pytest.raises(BadRecordError, match=r"empty\.txt:1: the file is empty or whitespace"):
        read_all(path, text_mode="file")
    assert read_all(path, text_mode="paragraph")[0] == []  # blank lines are not documents


def test_skip_needs_a_reject_log(tmp_path):
    (source,) = resolve_inputs([str(write(tmp_path / "a.jsonl", jsonl_bytes(["x"])))])
    with pytest.raises(ValueError, match="needs a RejectLog"):
        list(iter_text_batches(source, on_bad_record="skip"))


def test_reject_log_caps_examples_merges_and_records():
    first = RejectLog(max_examples=2)
    for line in range(3):
        first.add("empty_text", f"a.jsonl:{line}", "empty")
    second = RejectLog(max_examples=2)
    second.add("malformed_json", "b.jsonl:9", "x" * 1000)
    first.merge(second)
    assert first.total == 4 and first.counts == {"empty_text": 3, "malformed_json": 1}
    assert [e["location"] for e in first.examples] == ["a.jsonl:0", "a.jsonl:1"]
    record = first.to_record()
    assert record.total == 4 and record.counts == {"malformed_json": 1, "empty_text": 3}
    assert len(second.examples[0]["detail"]) < 300
    with pytest.raises(ValueError, match="unknown reject reason"):
        first.add("bad_vibes", "x", "y")


# ---------------------------------------------------------------- s3


def test_s3_jsonl_and_parquet_round_trip(s3_endpoint, s3_bucket):
    import s3fs

    fs = s3fs.S3FileSystem(**s3_endpoint)
    texts = docs(300)
    fs.pipe(f"{s3_bucket}/corpus/a.jsonl.gz", gzip.compress(jsonl_bytes(texts[:100])))
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts[100:]}), buffer, row_group_size=50)
    fs.pipe(f"{s3_bucket}/corpus/b.parquet", buffer.getvalue().to_pybytes())

    sources = resolve_inputs([f"{s3_bucket}/corpus/"], storage_options=s3_endpoint)
    assert [s.url for s in sources] == [
        f"{s3_bucket}/corpus/a.jsonl.gz",
        f"{s3_bucket}/corpus/b.parquet",
    ]
    assert [s.format for s in sources] == ["jsonl", "parquet"]
    got = [
        t
        for s in sources
        for b in iter_text_batches(s, batch_size=64, storage_options=s3_endpoint)
        for t in b.texts
    ]
    assert got == texts
    globbed = resolve_inputs([f"{s3_bucket}/corpus/*.parquet"], storage_options=s3_endpoint)
    assert [s.url for s in globbed] == [f"{s3_bucket}/corpus/b.parquet"]
    # The fixture's AWS_ENDPOINT_URL lets code that passes no storage options reach it too.
    assert resolve_inputs([f"{s3_bucket}/corpus/a.jsonl.gz"]) == sources[:1]


def test_s3_missing_bucket_and_key_fail_in_resolve(s3_endpoint, s3_bucket):
    for url in ("s3://megalith-no-such-bucket/a.jsonl", f"{s3_bucket}/missing.jsonl"):
        with pytest.raises(InputError, match=url):
            resolve_inputs([url], storage_options=s3_endpoint)


# ---------------------------------------------------------------- unbounded inputs


def test_a_device_behind_a_corpus_name_is_refused_before_reading(tmp_path):
    link = tmp_path / "zero.jsonl"
    os.symlink("/dev/zero", link)
    with pytest.raises(InputError, match=r"zero.jsonl: not a regular file \(a device"):
        resolve_inputs([str(link)])


def test_a_gzip_bomb_without_newlines_is_refused_at_the_record_limit(tmp_path, monkeypatch):
    # 64 MiB of one line would be refused the same way; a smaller limit keeps the test fast
    monkeypatch.setattr(readers, "MAX_RECORD_BYTES", 1 << 20)
    path = write(tmp_path / "bomb.jsonl.gz", b'{"text": "' + b"a" * (8 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=r"bomb.jsonl.gz: line 1 runs past 1 MiB without"):
            read_all(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # never held the whole decompressed line


@pytest.mark.parametrize(
    ("mode", "message"),
    [("file", r"larger than 1 MiB, too large to be one document"),
     ("paragraph", r"paragraph ending at line \d+ runs past 1 MiB without a blank line")],
)  # fmt: skip
def test_text_documents_past_the_limit_are_refused(tmp_path, monkeypatch, mode, message):
    monkeypatch.setattr(readers, "MAX_FILE_DOCUMENT_BYTES", 1 << 20)
    path = write(tmp_path / "book.txt", b"a line of a book without paragraphs\n" * 40_000)
    with pytest.raises(InputError, match=message):
        read_all(path, text_mode=mode)
    assert len(read_all(path, text_mode="line")[0]) == 40_000  # line mode reads it
