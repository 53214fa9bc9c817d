"""Corpus readers: jsonl (plain, .gz, .zst), parquet and plain text from any fsspec URL.

``resolve_inputs`` turns the user's paths, globs, directories and URLs into a sorted
list of files and checks that each one can be opened and read before any work starts.
``iter_text_batches`` streams one file as batches of document texts, so memory stays
flat whatever the corpus size. Bad records are rejected with a reason from
``REJECT_REASONS`` and either stop the run ("fail") or are counted ("skip"), never
dropped silently.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import os
import posixpath
import stat
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard
from fsspec.implementations.local import LocalFileSystem

from megalith.errors import MegalithError
from megalith.storage import filesystem
from preprocessing.chat import ChatRecordError, canonical_text, conversation_from_record
from preprocessing.manifest import RejectedRecords

REJECT_REASONS: tuple[str, ...] = (
    "malformed_json",
    "missing_field",
    "not_a_string",
    "invalid_utf8",
    "empty_text",
)
# Chat records (data.format=chat, see preprocessing.chat): a role, turn or content problem.
CHAT_REJECT_REASONS: tuple[str, ...] = ("invalid_chat",)
_KNOWN_REASONS = REJECT_REASONS + CHAT_REJECT_REASONS
INPUT_FORMATS = ("auto", "jsonl", "parquet", "text")
TEXT_MODES = ("paragraph", "line", "file")
BAD_RECORD_POLICIES = ("fail", "skip")

FORMAT_EXTENSIONS = {
    "jsonl": (".jsonl", ".json", ".ndjson"),
    "parquet": (".parquet",),
    "text": (".txt", ".text", ".md"),
}
COMPRESSION_EXTENSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}

READ_CHUNK = 1 << 20
# A batch is also cut when its texts reach this size, so a few huge documents
# cannot make one batch (and the worker holding it) arbitrarily large.
MAX_BATCH_BYTES = 32 << 20
# One record (a jsonl line, a text line or paragraph) or one whole-file document may be at
# most this large: a file without newlines (or /dev/zero behind a .jsonl name) is refused
# instead of being read into memory without end.
MAX_RECORD_BYTES = 64 << 20
MAX_FILE_DOCUMENT_BYTES = 256 << 20
CHECK_THREADS = 16
SNIPPET_CHARS = 80
DETAIL_CHARS = 240
SKIP_HINT = "use --on-bad-record skip to skip bad records"


class InputError(MegalithError):
    """An input that is missing, unreadable or of an unknown format."""


class BadRecordError(MegalithError):
    """A bad record met under the "fail" policy; the message names file:line."""


@dataclass(frozen=True)
class InputFile:
    url: str  # local path or full fsspec URL (keeps "s3://")
    size: int  # bytes on storage
    format: str  # "jsonl" | "parquet" | "text"
    compression: str | None  # "gzip" | "zstd" | None


@dataclass
class RejectLog:
    """Counts of rejected records by reason, plus the first few examples."""

    max_examples: int = 20
    counts: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, str]] = field(default_factory=list)

    def add(self, reason: str, location: str, detail: str, count: int = 1) -> None:
        if reason not in _KNOWN_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}; expected one of {_KNOWN_REASONS}")
        self.counts[reason] = self.counts.get(reason, 0) + count
        if len(self.examples) < self.max_examples:
            self.examples.append(
                {"location": location, "reason": reason, "detail": _shorten(detail, DETAIL_CHARS)}
            )

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def merge(self, other: RejectLog) -> None:
        """Add ``other``'s counts and examples (examples up to ``max_examples``)."""
        for reason, count in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + count
        room = max(0, self.max_examples - len(self.examples))
        self.examples.extend(dict(example) for example in other.examples[:room])

    @classmethod
    def from_record(cls, record: RejectedRecords, max_examples: int = 20) -> RejectLog:
        log = cls(max_examples=max_examples)
        log.merge(
            cls(max_examples=max_examples, counts=dict(record.counts), examples=record.examples)
        )
        return log

    def to_record(self) -> RejectedRecords:
        counts = {r: self.counts[r] for r in _KNOWN_REASONS if self.counts.get(r)}
        return RejectedRecords(total=self.total, counts=counts, examples=list(self.examples))


@dataclass
class TextBatch:
    texts: list[str]
    nbytes: int  # input bytes (uncompressed) this batch consumed, for MB/s progress


# --------------------------------------------------------------------------- inputs


def detect_format(url: str, input_format: str = "auto") -> tuple[str, str | None]:
    """Return ``(format, compression)`` for ``url``; raise InputError when unknown."""
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    name = posixpath.basename(url.rstrip("/")).lower()
    stem, ext = posixpath.splitext(name)
    compression = COMPRESSION_EXTENSIONS.get(ext)
    if compression:
        name = stem
    fmt = input_format if input_format != "auto" else _format_of(name)
    if fmt is None:
        known = ", ".join(e for exts in FORMAT_EXTENSIONS.values() for e in exts)
        raise InputError(
            f"{url}: unknown file extension; expected one of {known} "
            "(optionally .gz or .zst), or set input_format"
        )
    if fmt == "parquet" and compression:
        raise InputError(
            f"{url}: compressed parquet files are not supported (parquet compresses internally)"
        )
    return fmt, compression


def _format_of(name: str) -> str | None:
    for fmt, extensions in FORMAT_EXTENSIONS.items():
        if name.endswith(extensions):
            return fmt
    return None


def _is_hidden(url: str) -> bool:
    # Like a shell glob, "*" does not match dot files unless the pattern asks for them.
    return posixpath.basename(url).startswith(".")


def _is_supported(url: str, input_format: str) -> bool:
    """Whether a file found while walking a directory should be read."""
    if posixpath.basename(url).startswith((".", "_")):  # .DS_Store, _SUCCESS, .crc files...
        return False
    try:
        fmt, _ = detect_format(url, "auto")
    except InputError:
        return False
    return input_format in ("auto", fmt)


def resolve_inputs(
    urls: Sequence[str],
    input_format: str = "auto",
    storage_options: dict[str, Any] | None = None,
) -> list[InputFile]:
    """Expand paths, globs and directories into checked input files.

    Each argument expands to a sorted list (directories recursively, keeping only
    supported extensions); arguments keep their order and duplicates are dropped.
    Every file is opened and its first byte read, so a missing or unreadable input
    raises InputError before any work starts.
    """
    if not urls:
        raise InputError("no inputs given (set data.inputs)")
    found: dict[str, int] = {}
    for url in urls:
        for file_url, size in _expand(url, input_format, storage_options):
            found.setdefault(file_url, size)
    files = [InputFile(u, size, *detect_format(u, input_format)) for u, size in found.items()]
    with ThreadPoolExecutor(max_workers=min(CHECK_THREADS, len(files))) as pool:
        # list() re-raises the first failure, in input order.
        list(pool.map(lambda f: _check_readable(f, storage_options), files))
    return files


def _expand(
    url: str, input_format: str, storage_options: dict[str, Any] | None
) -> list[tuple[str, int]]:
    """List ``(url, size)`` for the files one input argument names."""
    try:
        fs, path = filesystem(url, storage_options)
        if any(ch in path for ch in "*?["):
            matches = fs.glob(path, detail=True)
            if not matches:
                raise InputError(f"{url}: the pattern matches no files")
            entries = []
            for name, info in sorted(matches.items()):
                if info.get("type") == "directory":
                    entries += _walk(fs, name, url, input_format)
                elif not _is_hidden(name) or _is_hidden(path):
                    entries.append((name, info))
        elif fs.isdir(path):
            entries = _walk(fs, path, url, input_format)
        elif fs.exists(path):
            entries = [(path, fs.info(path))]
        else:
            raise InputError(f"{url}: no such file or directory")
    except InputError:
        raise
    except Exception as exc:  # s3 errors come in many types; all mean "cannot list"
        raise InputError(f"{url}: cannot access input ({_describe(exc)})") from exc
    return [(_full_url(fs, name), int(info.get("size") or 0)) for name, info in entries]


def _walk(fs, path: str, url: str, input_format: str) -> list[tuple[str, dict]]:
    entries = [
        (name, info)
        for name, info in sorted(fs.find(path, detail=True).items())
        if _is_supported(name, input_format)
    ]
    if not entries:
        wanted = "supported" if input_format == "auto" else input_format
        raise InputError(f"{url}: the directory holds no {wanted} files")
    return entries


def _full_url(fs, path: str) -> str:
    # Local files stay plain absolute paths; remote ones keep their protocol (s3://...).
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _check_readable(source: InputFile, storage_options: dict[str, Any] | None) -> None:
    try:
        with _open_stream(source, storage_options) as stream:
            if source.format == "parquet":
                pq.ParquetFile(stream).metadata  # noqa: B018 - reads and checks the footer
            else:
                stream.read(1)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{source.url}: cannot read input ({_describe(exc)})") from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "not found"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, IsADirectoryError):
        return "is a directory"
    text = str(exc).strip() or type(exc).__name__
    return _shorten(text, DETAIL_CHARS)


@contextlib.contextmanager
def _open_stream(source: InputFile, storage_options: dict[str, Any] | None) -> Iterator[IO[bytes]]:
    """Open ``source`` for binary reading, decompressing on the fly."""
    fs, path = filesystem(source.url, storage_options)
    if isinstance(fs, LocalFileSystem) and not stat.S_ISREG(os.stat(path).st_mode):
        # devices and pipes never end (/dev/zero, /dev/urandom behind a .jsonl name)
        raise InputError(f"{source.url}: not a regular file (a device, pipe or socket)")
    with fs.open(path, "rb") as raw:
        if source.compression == "gzip":
            with gzip.GzipFile(fileobj=raw) as stream:
                yield stream
        elif source.compression == "zstd":
            # read_across_frames: files made by pzstd or by concatenation hold several frames.
            decompressor = zstandard.ZstdDecompressor(max_window_size=1 << 31)
            with decompressor.stream_reader(raw, read_across_frames=True) as stream:
                yield stream
        else:
            yield raw


# --------------------------------------------------------------------------- records


class _Reject(Exception):
    """One bad record; carries the reason and a short explanation."""

    def __init__(self, reason: str, explanation: str, snippet: str = ""):
        super().__init__(explanation)
        self.reason = reason
        self.explanation = explanation
        self.snippet = snippet


class _Batcher:
    """Collects texts into batches and applies the bad-record policy."""

    def __init__(self, batch_size: int, on_bad_record: str, rejects: RejectLog | None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(
                f"on_bad_record must be one of {BAD_RECORD_POLICIES}, got {on_bad_record!r}"
            )
        if on_bad_record == "skip" and rejects is None:
            raise ValueError('on_bad_record="skip" needs a RejectLog to count the skipped records')
        self.batch_size = batch_size
        self.fail = on_bad_record == "fail"
        self.rejects = rejects
        self.texts: list[str] = []
        self.text_bytes = 0
        self.nbytes = 0

    def add(self, text: str) -> None:
        self.texts.append(text)
        self.text_bytes += len(text)

    def reject(self, location: str, bad: _Reject, count: int = 1) -> None:
        if self.fail:
            raise BadRecordError(f"{location}: {bad.explanation}; {SKIP_HINT}")
        detail = f"{bad.explanation}: {bad.snippet}" if bad.snippet else bad.explanation
        self.rejects.add(bad.reason, location, detail, count)

    def full(self) -> bool:
        return len(self.texts) >= self.batch_size or self.text_bytes >= MAX_BATCH_BYTES

    def take(self) -> TextBatch:
        batch = TextBatch(self.texts, self.nbytes)
        self.texts, self.text_bytes, self.nbytes = [], 0, 0
        return batch


def iter_text_batches(
    source: InputFile,
    *,
    json_key: str = "text",
    text_mode: str = "paragraph",
    on_bad_record: str = "fail",
    rejects: RejectLog | None = None,
    batch_size: int = 512,
    storage_options: dict[str, Any] | None = None,
    chat: bool = False,
) -> Iterator[TextBatch]:
    """Yield batches of valid document texts from ``source``, in file order.

    Bad records raise BadRecordError under "fail" and are counted in ``rejects``
    under "skip". A batch holds at most ``batch_size`` texts (fewer once they reach
    MAX_BATCH_BYTES); its ``texts`` may be empty when only rejected records or blank
    lines were consumed since the last one. Memory stays bounded by one batch, one
    parquet row group, or, in text_mode "file", one whole file.
    """
    if text_mode not in TEXT_MODES:
        raise ValueError(f"text_mode must be one of {TEXT_MODES}, got {text_mode!r}")
    batcher = _Batcher(batch_size, on_bad_record, rejects)
    with _open_stream(source, storage_options) as stream:
        if source.format == "parquet":
            yield from _parquet_batches(stream, source, json_key, batcher)
        elif source.format == "jsonl":
            parse = _chat_text if chat else functools.partial(_json_text, key=json_key)
            yield from _jsonl_batches(stream, source.url, parse, batcher)
        elif text_mode == "file":
            yield from _whole_file_batches(stream, source.url, batcher)
        elif text_mode == "line":
            yield from _line_batches(stream, source.url, batcher)
        else:
            yield from _paragraph_batches(stream, source.url, batcher)
    if batcher.texts or batcher.nbytes:
        yield batcher.take()


def _read_lines(stream: IO[bytes], url: str) -> Iterator[tuple[int, bytes, int]]:
    """Yield ``(line_number, line, size)``: the line without its ending, numbered from 1,
    and the bytes it took in the input."""
    lineno = 0
    tail = b""
    while True:
        try:
            chunk = stream.read(READ_CHUNK)
        except Exception as exc:
            raise InputError(f"{url}: read failed after line {lineno} ({_describe(exc)})") from exc
        if not chunk:
            break
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        if len(tail) > MAX_RECORD_BYTES:
            raise InputError(
                f"{url}: line {lineno + len(lines) + 1} runs past {MAX_RECORD_BYTES >> 20} MiB "
                "without a newline; expected one record per line"
            )
        for line in lines:
            lineno += 1
            yield lineno, line.removesuffix(b"\r"), len(line) + 1
    if tail:
        yield lineno + 1, tail.removesuffix(b"\r"), len(tail)


def _decode(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = line[exc.start : exc.start + 1].hex()
        raise _Reject(
            "invalid_utf8",
            f"invalid UTF-8 (byte 0x{bad} at column {exc.start + 1})",
            _snippet(line.decode("utf-8", "replace")),
        ) from None


def _strip_bom(lineno: int, line: bytes) -> bytes:
    return line[3:] if lineno == 1 and line.startswith(b"\xef\xbb\xbf") else line


def _jsonl_batches(
    stream: IO[bytes], url: str, parse: Callable[[bytes], str], batcher: _Batcher
) -> Iterator[TextBatch]:
    for lineno, line, size in _read_lines(stream, url):
        batcher.nbytes += size
        line = _strip_bom(lineno, line)
        if not line or line.isspace():  # blank lines are not records
            continue
        try:
            batcher.add(parse(line))
        except _Reject as bad:
            batcher.reject(f"{url}:{lineno}", bad)
        if batcher.full():
            yield batcher.take()


_JSON = json.JSONDecoder()


def _json_text(line: bytes, key: str) -> str:
    text = _decode(line)
    record = _parse_json(text)
    if not isinstance(record, dict):
        kind = _json_type(record)
        raise _Reject("missing_field", f"not a JSON object (got {kind})", _snippet(text))
    value = record.get(key)
    if value is None:
        what = "is null" if key in record else "is missing"
        raise _Reject("missing_field", f"field {key!r} {what}", _snippet(text))
    if not isinstance(value, str):
        kind = _json_type(value)
        raise _Reject("not_a_string", f"field {key!r} is {kind}, not a string", _snippet(text))
    # A JSON escape such as "\ud800" gives a lone surrogate, which is not valid text.
    # isascii() is O(1) for Python strings, so plain ASCII text costs nothing here.
    if not value.isascii() and not _encodable(value):
        raise _Reject("invalid_utf8", f"field {key!r} holds a lone surrogate", _snippet(text))
    if not value or value.isspace():
        raise _Reject("empty_text", f"field {key!r} is empty or whitespace")
    return value


def _chat_text(line: bytes) -> str:
    """A chat record's canonical text; its problems become rejects naming the key."""
    text = _decode(line)
    try:
        return canonical_text(conversation_from_record(_parse_json(text)))
    except ChatRecordError as bad:
        raise _Reject(bad.reason, str(bad), _snippet(text)) from None


def _parse_json(text: str) -> Any:
    # raw_decode skips json.loads' whitespace regexes, about 40% faster on typical lines;
    # anything unusual goes through json.loads for the exact behaviour and error message.
    try:
        record, end = _JSON.raw_decode(text)
        if end == len(text):
            return record
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Reject("malformed_json", f"malformed JSON ({exc})", _snippet(text)) from None


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    return names.get(type(value), "null" if value is None else "a number")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parquet_batches(
    stream: IO[bytes], source: InputFile, key: str, batcher: _Batcher
) -> Iterator[TextBatch]:
    parquet = pq.ParquetFile(stream)
    names = parquet.schema_arrow.names
    if key not in names:
        rows = parquet.metadata.num_rows
        if rows:
            columns = ", ".join(names)
            bad = _Reject("missing_field", f"no column {key!r} (columns: {columns})")
            batcher.reject(f"{source.url}:row 0", bad, count=rows)
            batcher.nbytes += source.size
        return
    row = 0
    for record_batch in parquet.iter_batches(batch_size=batcher.batch_size, columns=[key]):
        column = record_batch.column(0)
        batcher.nbytes += _column_bytes(column)
        for value in _column_values(column):
            try:
                batcher.add(_parquet_text(value, key))
            except _Reject as bad:
                batcher.reject(f"{source.url}:row {row}", bad)
            row += 1
            if batcher.full():
                yield batcher.take()


def _column_bytes(column: pa.Array) -> int:
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
        return int(pc.sum(pc.binary_length(column)).as_py() or 0)
    return column.nbytes


def _column_values(column: pa.Array) -> list[Any]:
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column.to_pylist()


def _parquet_text(value: Any, key: str) -> str:
    if value is None:
        raise _Reject("missing_field", f"column {key!r} is null")
    if isinstance(value, bytes):
        value = _decode(value)
    if not isinstance(value, str):
        kind = type(value).__name__
        raise _Reject("not_a_string", f"column {key!r} holds {kind}, not a string", _snippet(value))
    if not value or value.isspace():
        raise _Reject("empty_text", f"column {key!r} is empty or whitespace")
    return value


def _whole_file_batches(stream: IO[bytes], url: str, batcher: _Batcher) -> Iterator[TextBatch]:
    try:
        data = stream.read(MAX_FILE_DOCUMENT_BYTES + 1)
    except Exception as exc:
        raise InputError(f"{url}: read failed ({_describe(exc)})") from exc
    if len(data) > MAX_FILE_DOCUMENT_BYTES:
        raise InputError(
            f"{url}: larger than {MAX_FILE_DOCUMENT_BYTES >> 20} MiB, too large to be one "
            "document (text_mode 'file'); use text_mode 'line' or 'paragraph'"
        )
    batcher.nbytes += len(data)
    data = _strip_bom(1, data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1)
        bad = data[exc.start : exc.start + 1].hex()
        reject = _Reject("invalid_utf8", f"invalid UTF-8 (byte 0x{bad} at column {column + 1})")
        batcher.reject(f"{url}:{lineno}", reject)
        return
    if not text or text.isspace():
        batcher.reject(f"{url}:1", _Reject("empty_text", "the file is empty or whitespace"))
    else:
        batcher.add(text)
    yield from ()


def _line_batches(stream: IO[bytes], url: str, batcher: _Batcher) -> Iterator[TextBatch]:
    for lineno, line, size in _read_lines(stream, url):
        batcher.nbytes += size
        line = _strip_bom(lineno, line)
        if not line or line.isspace():  # blank lines are not documents
            continue
        try:
            text = _decode(line)
        except _Reject as bad:
            batcher.reject(f"{url}:{lineno}", bad)
        else:
            if not text.isspace():  # whitespace beyond ASCII, e.g. U+00A0 alone on a line
                batcher.add(text)
        if batcher.full():
            yield batcher.take()


def _paragraph_batches(stream: IO[bytes], url: str, batcher: _Batcher) -> Iterator[TextBatch]:
    """Documents separated by one or more blank (whitespace-only) lines."""
    lines: list[str] = []
    paragraph_bytes = 0
    bad: tuple[int, _Reject] | None = None  # the first bad line of the current paragraph
    for lineno, line, size in _read_lines(stream, url):
        batcher.nbytes += size
        line = _strip_bom(lineno, line)
        if line and not line.isspace():
            paragraph_bytes += size
            if paragraph_bytes > MAX_FILE_DOCUMENT_BYTES:
                raise InputError(
                    f"{url}: the paragraph ending at line {lineno} runs past "
                    f"{MAX_FILE_DOCUMENT_BYTES >> 20} MiB without a blank line; use text_mode "
                    "'line' for text without paragraphs"
                )
            try:
                lines.append(_decode(line))
            except _Reject as reject:
                bad = bad or (lineno, reject)
            continue
        if lines or bad:
            _end_paragraph(url, lines, bad, batcher)
            lines, bad, paragraph_bytes = [], None, 0
            if batcher.full():
                yield batcher.take()
    if lines or bad:
        _end_paragraph(url, lines, bad, batcher)


def _end_paragraph(
    url: str, lines: list[str], bad: tuple[int, _Reject] | None, batcher: _Batcher
) -> None:
    if bad is not None:
        batcher.reject(f"{url}:{bad[0]}", bad[1])
        return
    text = "\n".join(lines)
    if not text.isspace():  # whitespace beyond ASCII, e.g. only U+00A0 lines
        batcher.add(text)


def _snippet(value: object) -> str:
    return _shorten(value if isinstance(value, str) else repr(value), SNIPPET_CHARS)


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
