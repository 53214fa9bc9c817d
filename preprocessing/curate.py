"""Curation before tokenization: ``megalith data curate`` and the pipelines' curate task.

One streaming pass over the corpus, in input order. Each valid document meets the rules
in this order, and the first that removes it is the one it is counted under:

1. ``exact_duplicate``: the normalized text was seen before;
2. a quality rule (``preprocessing.quality``: ``word_count``, ``stop_words``, ...);
3. ``decontamination``: it shares an n-gram with an evaluation item (removed, or with
   ``action: report`` kept and counted under ``flagged``);
4. ``near_duplicate``: an earlier kept document collides with it in the MinHash LSH index;
5. PII redaction (``pii_email``, ``pii_ip``, ``pii_phone``): kept, text changed, counted
   under ``changed``.

Kept documents go, in input order, to ``OUTPUT/part-XXXXX.jsonl`` (one per input file
that keeps any, ``{"text": ...}`` per line), and ``OUTPUT/_curation.json`` (the
``CurationRecord``) is written last: a folder without it is not finished. Memory holds the
LSH index and one 16-byte key per distinct text, never the corpus. The same inputs,
config and task files give the same kept documents; a rerun with them reuses the output
when its files still match their sha256. ``megalith data prepare`` on the folder copies
the record into the shard manifest (``preprocessing.curation_record``).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import posixpath
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from megalith import safe_read
from megalith.config import ConfigError, CurateConfig, DataConfig
from megalith.storage import (
    atomic_write_json,
    default_file_mode,
    filesystem,
    is_local,
    join,
    sha256_of_bytes,
    sha256_of_file,
)
from preprocessing.corpus import Corpus
from preprocessing.curation_record import RECORD_NAME, read_record
from preprocessing.decontaminate import MAX_TASK_FILE_BYTES, Contamination, TaskFileError
from preprocessing.dedup import ExactDuplicates, NearDuplicates
from preprocessing.manifest import CurationRecord, FileInfo, InputInfo, RuleCounts
from preprocessing.pii import redact
from preprocessing.prepare import input_fingerprint, json_digest, progress_bar
from preprocessing.quality import QUALITY_RULES, quality_failure
from preprocessing.readers import RejectLog

CURATE_VERSION = 1
EXAMPLE_CHARS = 300
RULE_ORDER = (
    "exact_duplicate",
    *QUALITY_RULES,
    "decontamination",
    "near_duplicate",
    "pii_email",
    "pii_ip",
    "pii_phone",
)


def part_name(index: int) -> str:
    return f"part-{index:05d}.jsonl"


def curation_output(data: DataConfig) -> str:
    """Where the curated corpus goes: ``data.curate.output``, else ``DATA_OUTPUT/curated``."""
    if data.curate.output:
        return data.curate.output.rstrip("/")
    if not data.output:
        raise ConfigError(
            "data.curate.output and data.output are not set: say where the curated corpus "
            "goes (--output DIR_OR_URL)"
        )
    return join(data.output, "curated")


def curated_data(data: DataConfig, output: str) -> DataConfig:
    """The data config that tokenizes the curated corpus at ``output`` instead of the inputs."""
    return data.model_copy(update={"inputs": [output], "input_format": "jsonl", "json_key": "text"})


# --------------------------------------------------------------------------- accounting


@dataclass
class Tally:
    """Counts by rule and the first ``max_examples`` documents of each rule."""

    max_examples: int
    counts: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, str]] = field(default_factory=list)

    def add(self, rule: str, location: str, detail: str, text: str) -> None:
        self.counts[rule] = self.counts.get(rule, 0) + 1
        if self.counts[rule] <= self.max_examples:
            snippet = text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "…"
            self.examples.append(
                {"location": location, "rule": rule, "detail": detail, "text": snippet}
            )

    def record(self) -> RuleCounts:
        counts = {rule: self.counts[rule] for rule in RULE_ORDER if rule in self.counts}
        return RuleCounts(total=sum(counts.values()), counts=counts, examples=self.examples)


class Locator:
    """``file#N`` (N: the document's number among the file's valid records, from 1) for a
    document's ordinal in the whole stream."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.urls: list[str] = []

    def begin_file(self, ordinal: int, url: str) -> None:
        self.starts.append(ordinal)
        self.urls.append(url)

    def __call__(self, ordinal: int) -> str:
        index = bisect.bisect_right(self.starts, ordinal) - 1
        return f"{self.urls[index]}#{ordinal - self.starts[index] + 1}"


# --------------------------------------------------------------------------- rules


class Curator:
    """Applies the rules to one document at a time and keeps the tallies."""

    def __init__(self, config: CurateConfig, contamination: Contamination | None):
        self.config = config
        self.exact = ExactDuplicates() if config.exact_dedup.enabled else None
        self.near = NearDuplicates(config.near_dedup) if config.near_dedup.enabled else None
        self.contamination = contamination
        self.locate = Locator()
        self.removed = Tally(config.max_examples)
        self.changed = Tally(config.max_examples)
        self.flagged = Tally(config.max_examples)
        self.redactions: dict[str, int] = {}

    def review(self, text: str, ordinal: int) -> str | None:
        """The text to keep (redacted), or None when a rule removes the document."""
        removal = self._removal(text, ordinal)
        if removal is not None:
            rule, detail = removal
            self.removed.add(rule, self.locate(ordinal), detail, text)
            return None
        if self.config.pii.enabled:
            redacted, found = redact(text, self.config.pii)
            for kind, count in found.items():
                self.redactions[kind] = self.redactions.get(kind, 0) + count
                self.changed.add(f"pii_{kind}", self.locate(ordinal), f"{count} redacted", text)
            text = redacted
        return text

    def _removal(self, text: str, ordinal: int) -> tuple[str, str] | None:
        if self.exact is not None and (first := self.exact.check(text, ordinal)) is not None:
            return "exact_duplicate", f"same text as {self.locate(first)}"
        if self.config.quality.enabled and (failed := quality_failure(text, self.config.quality)):
            return failed
        if self.contamination is not None and (found := self.contamination.match(text)):
            if self.config.decontamination.action == "remove":
                return "decontamination", found
            self.flagged.add("decontamination", self.locate(ordinal), found, text)
        if self.near is not None and (first := self.near.check(text, ordinal)) is not None:
            return "near_duplicate", f"near duplicate of {self.locate(first)}"
        return None


# --------------------------------------------------------------------------- output


class PartWriter:
    """One curated jsonl file, hashed as it is written. Local files are written under a
    temporary name and renamed on success; object stores publish an upload when it ends."""

    def __init__(self, url: str, storage_options: dict[str, Any]):
        self.url = url
        self.digest = hashlib.sha256()
        self.bytes = 0
        self.documents = 0
        self.tmp: str | None = None
        self.storage_options = storage_options
        if is_local(url):
            folder = Path(url.removeprefix("file://")).parent
            fd, self.tmp = tempfile.mkstemp(prefix=".part.", suffix=".tmp", dir=folder)
            self.handle: IO[bytes] = os.fdopen(fd, "wb")
        else:
            fs, path = filesystem(url, storage_options)
            self.handle = fs.open(path, "wb")

    def write(self, text: str) -> None:
        line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8")
        self.handle.write(line)
        self.digest.update(line)
        self.bytes += len(line)
        self.documents += 1

    def commit(self) -> FileInfo | None:
        """Publish the file; None (and nothing left behind) when it holds no document."""
        self.handle.close()
        if self.tmp is not None:
            if self.documents:
                os.chmod(self.tmp, default_file_mode())
                os.replace(self.tmp, self.url.removeprefix("file://"))
            else:
                os.unlink(self.tmp)
        elif not self.documents:
            fs, path = filesystem(self.url, self.storage_options)
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)
        if not self.documents:
            return None
        return FileInfo(sha256=self.digest.hexdigest(), bytes=self.bytes)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.handle.close()
        if self.tmp is not None:
            Path(self.tmp).unlink(missing_ok=True)


# --------------------------------------------------------------------------- stage


@dataclass
class CurateReport:
    record: CurationRecord
    output: str
    reused: bool = False
    seconds: float = 0.0
    text_bytes: int = 0
    lsh_bands: int = 0
    lsh_rows: int = 0
    contamination_items: int = 0
    contamination_short_items: int = 0

    def rates(self) -> dict[str, float]:
        seconds = max(self.seconds, 1e-9)
        return {
            "documents_per_s": self.record.documents_in / seconds,
            "mb_per_s": self.text_bytes / seconds / 1e6,
        }


def task_file_list(data: DataConfig, extra: Sequence[str] = ()) -> list[str]:
    """The configured decontamination files and ``extra`` (what a pipeline evaluates on)."""
    return list(dict.fromkeys([*data.curate.decontamination.task_files, *map(str, extra)]))


def curate_fingerprint(corpus: Corpus, data: DataConfig, task_files: Sequence[str]) -> str:
    tasks = [[url, _task_file_digest(url, data.storage_options)] for url in task_files]
    return json_digest(
        {
            "version": CURATE_VERSION,
            "inputs": input_fingerprint(corpus),
            "curate": data.curate.model_dump(mode="json", exclude={"output"}),
            "task_files": tasks,
        }
    )


def _task_file_digest(url: str, storage_options: dict[str, Any]) -> str:
    try:
        data = safe_read.read_bytes_bounded(url, MAX_TASK_FILE_BYTES, storage_options)
    except OSError as exc:
        raise TaskFileError(f"{url}: cannot read the task file ({exc.strerror or exc})") from None
    except safe_read.UnsafeFileError as exc:
        raise TaskFileError(str(exc)) from None
    return sha256_of_bytes(data)


def curate_corpus(
    data: DataConfig,
    extra_task_files: Sequence[str] = (),
    show_progress: bool = True,
) -> CurateReport:
    """Curate ``data.inputs`` into ``curation_output(data)``; reuse a finished identical run."""
    if data.format != "pretrain":
        raise ConfigError(
            f"data.format is {data.format!r}: curation reads documents of text (pretrain); "
            "chat conversations are not curated"
        )
    output = curation_output(data)
    corpus = Corpus.open(data)
    task_files = (
        task_file_list(data, extra_task_files) if data.curate.decontamination.enabled else []
    )
    fingerprint = curate_fingerprint(corpus, data, task_files)
    previous = _finished_record(output, fingerprint, data.storage_options)
    if previous is not None:
        return CurateReport(record=previous, output=output, reused=True)
    contamination = None
    if task_files:
        contamination = Contamination.build(
            task_files, data.curate.decontamination.ngram, data.storage_options
        )
    curator = Curator(data.curate, contamination)
    _clear_output(output, data.storage_options)
    started = time.perf_counter()
    record, text_bytes = _curate(corpus, curator, output, fingerprint, data, show_progress)
    atomic_write_json(
        join(output, RECORD_NAME), record.model_dump(mode="json"), data.storage_options
    )
    return CurateReport(
        record=record,
        output=output,
        seconds=time.perf_counter() - started,
        text_bytes=text_bytes,
        lsh_bands=curator.near.bands if curator.near else 0,
        lsh_rows=curator.near.rows if curator.near else 0,
        contamination_items=contamination.items if contamination else 0,
        contamination_short_items=contamination.short_items if contamination else 0,
    )


def _curate(corpus, curator, output, fingerprint, data, show_progress):
    rejects = RejectLog(max_examples=data.max_bad_examples)
    inputs: list[InputInfo] = []
    outputs: dict[str, FileInfo] = {}
    ordinal = kept = text_bytes = 0
    with progress_bar(corpus.text_bytes_hint(), "curating", show_progress) as bar:
        for index, source in enumerate(corpus.files):
            curator.locate.begin_file(ordinal, source.url)
            rejected_before, first = rejects.total, ordinal
            writer = PartWriter(join(output, part_name(index)), data.storage_options)
            try:
                for batch in corpus.file_batches(index, rejects):
                    for text in batch.texts:
                        curated = curator.review(text, ordinal)
                        ordinal += 1
                        if curated is not None:
                            writer.write(curated)
                    text_bytes += batch.nbytes
                    bar.update(batch.nbytes)
            except BaseException:
                writer.abort()
                raise
            kept += writer.documents
            info = writer.commit()
            if info is not None:
                outputs[part_name(index)] = info
            inputs.append(
                InputInfo(
                    url=source.url,
                    bytes=source.size,
                    documents=ordinal - first,
                    rejected=rejects.total - rejected_before,
                )
            )
    record = CurationRecord(
        fingerprint=fingerprint,
        documents_in=ordinal,
        documents_out=kept,
        inputs=inputs,
        rejected=rejects.to_record(),
        removed=curator.removed.record(),
        changed=curator.changed.record(),
        flagged=curator.flagged.record(),
        redactions=dict(sorted(curator.redactions.items())),
        outputs=outputs,
        config=data.curate.model_dump(mode="json"),
    )
    return record, text_bytes


def _finished_record(
    output: str, fingerprint: str, storage_options: dict[str, Any]
) -> CurationRecord | None:
    """The record of a finished run with the same fingerprint whose files still verify."""
    record = read_record(output, storage_options)
    if record is None or record.fingerprint != fingerprint:
        return None
    for name, info in record.outputs.items():
        try:
            if sha256_of_file(join(output, name), storage_options) != info.sha256:
                return None
        except FileNotFoundError:
            return None
    return record


def _clear_output(output: str, storage_options: dict[str, Any]) -> None:
    """Remove the record and the parts of an earlier run, so no stale part is read later."""
    fs, path = filesystem(output, storage_options)
    fs.makedirs(path, exist_ok=True)
    for name in [RECORD_NAME, *(n for n in _names(fs, path) if _is_part(n))]:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(posixpath.join(path, name))


def _names(fs, path: str) -> Iterator[str]:
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:  # an object store prefix with nothing under it yet
        return
    for entry in entries:
        yield posixpath.basename(entry.rstrip("/"))


def _is_part(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".jsonl")


def describe(report: CurateReport) -> str:
    """What a curation did, for the command line."""
    record = report.record
    lines = [
        f"{'reused' if report.reused else 'wrote'} {report.output}: kept "
        f"{record.documents_out:,} of {record.documents_in:,} documents "
        f"in {len(record.outputs)} file(s)"
    ]
    for title, counts in record.buckets():
        lines.append(f"  {title} {counts.total:,}: {dict(counts.counts)}")
    if record.rejected.total:
        lines.append(f"  bad records {record.rejected.total}: {dict(record.rejected.counts)}")
    if report.contamination_items:
        lines.append(
            f"  decontaminated against {report.contamination_items} evaluation item(s) "
            f"({report.contamination_short_items} shorter than "
            f"{record.config['decontamination']['ngram']} words, not checkable)"
        )
    if not report.reused and record.documents_in:
        rates = report.rates()
        lines.append(
            f"  {rates['documents_per_s']:,.0f} docs/s, {rates['mb_per_s']:.2f} MB/s "
            f"on one core; LSH {report.lsh_bands} bands x {report.lsh_rows} rows"
        )
    return "\n".join(lines)
