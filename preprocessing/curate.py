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
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

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
from preprocessing.dedup import ExactDuplicates, NearDuplicates, text_key
from preprocessing.engines import open_engine, where
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


class Findings(NamedTuple):
    """What the rules that look at one document alone found in it."""

    key: bytes | None  # the exact-duplicate key (text_key)
    failure: tuple[str, str] | None  # the first quality rule it fails, and why
    contamination: str | None  # the n-gram it shares with an evaluation item
    bands: list[int] | None  # its LSH band keys
    redacted: str | None  # its text with PII replaced; None when nothing was
    pii: dict[str, int]  # matches by kind


class DocumentRules:
    """The per-document step: normalization, quality rules, decontamination, MinHash band
    keys, PII redaction. Pure (the result depends on the text alone), so it runs in any
    process on any node (``preprocessing.engines``); the decisions that depend on earlier
    documents are the ``Curator``'s. Work that cannot change the outcome is skipped."""

    def __init__(self, config: CurateConfig, contamination: Contamination | None):
        self.config = config
        self.contamination = contamination
        self.near = NearDuplicates(config.near_dedup) if config.near_dedup.enabled else None

    def findings(self, text: str) -> Findings:
        key = text_key(text) if self.config.exact_dedup.enabled else None
        failure = None
        if self.config.quality.enabled:
            failure = quality_failure(text, self.config.quality)
        if failure is not None:
            return Findings(key, failure, None, None, None, {})
        found = self.contamination.match(text) if self.contamination is not None else None
        if found is not None and self.config.decontamination.action == "remove":
            return Findings(key, None, found, None, None, {})
        bands = None if self.near is None else self.near.band_keys(self.near.signature(text))
        redacted, pii = None, {}
        if self.config.pii.enabled:
            redacted, pii = redact(text, self.config.pii)
            redacted = redacted if pii else None
        return Findings(key, None, found, bands, redacted, pii)


CurateJob = tuple[int, int, list[str]]  # (input file index, first ordinal, texts)


def review_job(rules: DocumentRules, job: CurateJob) -> list[Findings]:
    """The engines' task: the findings of each document of a batch."""
    return [rules.findings(text) for text in job[2]]


class Curator:
    """Decides, in input order, from each document's findings and the documents before it;
    keeps the duplicate indexes and the tallies."""

    def __init__(self, config: CurateConfig):
        self.config = config
        self.exact = ExactDuplicates() if config.exact_dedup.enabled else None
        self.near = NearDuplicates(config.near_dedup) if config.near_dedup.enabled else None
        self.locate = Locator()
        self.removed = Tally(config.max_examples)
        self.changed = Tally(config.max_examples)
        self.flagged = Tally(config.max_examples)
        self.redactions: dict[str, int] = {}

    def decide(self, text: str, ordinal: int, found: Findings) -> str | None:
        """The text to keep (redacted), or None when a rule removes the document."""
        removal = self._removal(text, ordinal, found)
        if removal is not None:
            rule, detail = removal
            self.removed.add(rule, self.locate(ordinal), detail, text)
            return None
        for kind, count in found.pii.items():
            self.redactions[kind] = self.redactions.get(kind, 0) + count
            self.changed.add(f"pii_{kind}", self.locate(ordinal), f"{count} redacted", text)
        return text if found.redacted is None else found.redacted

    def _removal(self, text: str, ordinal: int, found: Findings) -> tuple[str, str] | None:
        first = self.exact.check_key(found.key, ordinal) if found.key is not None else None
        if first is not None:
            return "exact_duplicate", f"same text as {self.locate(first)}"
        if found.failure is not None:
            return found.failure
        if found.contamination is not None:
            if self.config.decontamination.action == "remove":
                return "decontamination", found.contamination
            self.flagged.add("decontamination", self.locate(ordinal), found.contamination, text)
        first = self.near.check_keys(found.bands, ordinal) if found.bands is not None else None
        if first is not None:
            return "near_duplicate", f"near duplicate of {self.locate(first)}"
        return None

    def describe(self, jobs: list[CurateJob]) -> str:
        """The documents a window of jobs holds, for an error."""
        last = jobs[-1][1] + len(jobs[-1][2]) - 1
        return f"documents {self.locate(jobs[0][1])} to {self.locate(last)}"


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
    nodes: list[str] = field(default_factory=list)  # Ray node ids that did the work (ray)
    where: str = ""  # where the per-document work ran (preprocessing.engines.where)

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
    curator = Curator(data.curate)
    rules = DocumentRules(data.curate, contamination)
    _clear_output(output, data.storage_options)
    started = time.perf_counter()
    with open_engine(
        data, review_job, rules, curator.describe, "curation", in_process_when_one=True
    ) as engine:
        record, text_bytes = _curate(
            corpus, curator, engine, output, fingerprint, data, show_progress
        )
    atomic_write_json(
        join(output, RECORD_NAME), record.model_dump(mode="json"), data.storage_options
    )
    return CurateReport(
        record=record,
        output=output,
        seconds=time.perf_counter() - started,
        text_bytes=text_bytes,
        lsh_bands=0 if curator.near is None else curator.near.bands,
        lsh_rows=0 if curator.near is None else curator.near.rows,
        contamination_items=contamination.items if contamination else 0,
        contamination_short_items=contamination.short_items if contamination else 0,
        nodes=sorted(engine.nodes),
        where=where(data, sorted(engine.nodes)),
    )


class Parts:
    """The kept documents, in input order, to one part per input file that keeps any."""

    def __init__(self, output: str, storage_options: dict[str, Any]):
        self.output = output
        self.options = storage_options
        self.index: int | None = None
        self.writer: PartWriter | None = None
        self.files: dict[str, FileInfo] = {}
        self.kept = 0

    def write(self, index: int, text: str) -> None:
        if index != self.index:
            self.finish()
            self.index = index
            self.writer = PartWriter(join(self.output, part_name(index)), self.options)
        self.writer.write(text)

    def finish(self) -> None:
        if self.writer is None:
            return
        self.kept += self.writer.documents
        info = self.writer.commit()
        if info is not None:
            self.files[part_name(self.index)] = info
        self.writer = None

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def _curate(corpus, curator, engine, output, fingerprint, data, show_progress):
    """Read and send batches ahead; decide and write their results as they come, in order."""
    rejects = RejectLog(max_examples=data.max_bad_examples)
    inputs: list[InputInfo] = []
    parts = Parts(output, data.storage_options)
    sent: deque[CurateJob] = deque()  # the texts of the jobs whose findings are due

    def decide(results: Iterator[list[Findings]]) -> None:
        for findings in results:
            index, first, texts = sent.popleft()
            for ordinal, (text, found) in enumerate(zip(texts, findings, strict=True), first):
                curated = curator.decide(text, ordinal, found)
                if curated is not None:
                    parts.write(index, curated)

    ordinal = text_bytes = 0
    try:
        with progress_bar(corpus.text_bytes_hint(), "curating", show_progress) as bar:
            for index, source in enumerate(corpus.files):
                curator.locate.begin_file(ordinal, source.url)
                rejected_before, first = rejects.total, ordinal
                for batch in corpus.file_batches(index, rejects):
                    sent.append((index, ordinal, batch.texts))
                    ordinal += len(batch.texts)
                    decide(engine.submit(sent[-1]))
                    text_bytes += batch.nbytes
                    bar.update(batch.nbytes)
                inputs.append(
                    InputInfo(
                        url=source.url,
                        bytes=source.size,
                        documents=ordinal - first,
                        rejected=rejects.total - rejected_before,
                    )
                )
            decide(engine.drain())
        parts.finish()
    except BaseException:
        parts.abort()
        raise
    record = CurationRecord(
        fingerprint=fingerprint,
        documents_in=ordinal,
        documents_out=parts.kept,
        inputs=inputs,
        rejected=rejects.to_record(),
        removed=curator.removed.record(),
        changed=curator.changed.record(),
        flagged=curator.flagged.record(),
        redactions=dict(sorted(curator.redactions.items())),
        outputs=parts.files,
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
            f"with {report.where}; LSH {report.lsh_bands} bands x {report.lsh_rows} rows"
        )
    return "\n".join(lines)
