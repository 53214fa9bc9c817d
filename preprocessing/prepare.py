"""Raw corpus → Megatron indexed-dataset shards + ``manifest.json``.

Two passes over the input:

1. **Scan** reads every document once (no tokenizing), applies the bad-record policy
   and counts characters. Its result is cached in ``OUTPUT/.prepare/scan.json``.
2. **Tokenize** reads the documents again, assigns each to a shard by the position of
   its midpoint in the character stream (so shards hold roughly equal tokens and the
   assignment depends only on the data), and sends batches to worker processes.
   Results come back in submission order, so the shards are byte-identical for any
   number of workers.

A shard is complete when its files were renamed into place and its marker
``.prepare/shard-XXXXX.json`` (sha256 per file) was written. A rerun verifies the
markers, skips the complete shards, and redoes the rest. ``manifest.json`` is
written last: a shard set without it is not finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megalith import __version__, safe_read
from megalith.config import ConfigError, DataConfig, TokenizerConfig
from megalith.errors import MegalithError, naming_path
from megalith.storage import (
    atomic_write_json,
    filesystem,
    is_local,
    join,
    sha256_of_file,
)
from preprocessing.chat import MASK_DTYPE, encode_conversations
from preprocessing.corpus import Corpus
from preprocessing.curation_record import find_curation
from preprocessing.engines import open_engine
from preprocessing.indexed_dataset import IndexedDatasetWriter, token_dtype
from preprocessing.manifest import (
    MANIFEST_NAME,
    MASK_SUFFIX,
    FileInfo,
    InputInfo,
    Manifest,
    RejectedRecords,
    ShardInfo,
    TokenizerInfo,
    write_manifest,
)
from preprocessing.readers import RejectLog
from preprocessing.tokenizer import Tokenizer, with_eod

STATE_DIR = ".prepare"
SCAN_VERSION = 1


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def mask_name(prefix: str) -> str:
    """The loss-mask shard beside a chat token shard: ``shard-XXXXX.mask.bin/.idx``."""
    return f"{prefix}{MASK_SUFFIX}"


@dataclass
class ScanResult:
    fingerprint: str
    documents: int
    characters: int
    text_bytes: int
    documents_per_input: list[int]
    rejected_per_input: list[int]
    rejects: dict[str, Any]


@dataclass
class PrepareReport:
    manifest: Manifest
    output: str
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)  # planned shards that got no documents
    scan_seconds: float = 0.0
    tokenize_seconds: float = 0.0
    tokenized_documents: int = 0
    tokenized_tokens: int = 0
    tokenized_bytes: int = 0
    nodes: list[str] = field(default_factory=list)  # Ray node ids that tokenized (engine ray)

    def rates(self) -> dict[str, float]:
        seconds = max(self.tokenize_seconds, 1e-9)
        return {
            "documents_per_s": self.tokenized_documents / seconds,
            "tokens_per_s": self.tokenized_tokens / seconds,
            "mb_per_s": self.tokenized_bytes / seconds / 1e6,
        }


# --------------------------------------------------------------------------- scan


def input_fingerprint(corpus: Corpus) -> str:
    """Identify the inputs and every setting that changes which documents they yield."""
    files = []
    for source in corpus.files:
        fs, path = filesystem(source.url, corpus.config.storage_options)
        files.append([source.url, source.size, fs.ukey(path)])
    settings = corpus.config.model_dump(
        include={"input_format", "json_key", "text_mode", "on_bad_record", "format"}
    )
    return json_digest({"version": SCAN_VERSION, "files": files, "settings": settings})


def scan_corpus(corpus: Corpus, fingerprint: str, show_progress: bool = True) -> ScanResult:
    rejects = RejectLog(max_examples=corpus.config.max_bad_examples)
    documents = [0] * len(corpus.files)
    rejected = [0] * len(corpus.files)
    characters = text_bytes = 0
    with progress_bar(corpus.text_bytes_hint(), "scanning", show_progress) as bar:
        for index in range(len(corpus.files)):
            rejected_before = rejects.total
            for batch in corpus.file_batches(index, rejects):
                documents[index] += len(batch.texts)
                characters += sum(map(len, batch.texts))
                text_bytes += batch.nbytes
                bar.update(batch.nbytes)
            rejected[index] = rejects.total - rejected_before
    return ScanResult(
        fingerprint=fingerprint,
        documents=sum(documents),
        characters=characters,
        text_bytes=text_bytes,
        documents_per_input=documents,
        rejected_per_input=rejected,
        rejects=rejects.to_record().model_dump(),
    )


def load_or_scan(corpus: Corpus, state_url: str, show_progress: bool) -> ScanResult:
    fingerprint = input_fingerprint(corpus)
    # The examples kept depend on max_bad_examples, which does not change the documents.
    examples = corpus.config.max_bad_examples
    cached = read_json_or_none(join(state_url, "scan.json"), corpus.config.storage_options)
    if (
        cached
        and cached.get("fingerprint") == fingerprint
        and cached.pop("max_bad_examples", None) == examples
    ):
        with contextlib.suppress(TypeError):  # a record of another shape: scan again
            return ScanResult(**cached)
    result = scan_corpus(corpus, fingerprint, show_progress)
    record = {**asdict(result), "max_bad_examples": examples}
    atomic_write_json(join(state_url, "scan.json"), record, corpus.config.storage_options)
    return result


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class ShardPlan:
    """Which shard each document goes to, from its place in the character stream."""

    shards: int
    characters: int
    key: str

    def shard_of(self, start: int, length: int) -> int:
        midpoint_twice = 2 * start + length
        return min(self.shards - 1, midpoint_twice * self.shards // max(1, 2 * self.characters))


def make_plan(
    scan: ScanResult, data: DataConfig, tokenizer: Tokenizer, dtype: np.dtype
) -> ShardPlan:
    key = json_digest(
        {
            "scan": scan.fingerprint,
            "tokenizer": tokenizer.id,
            "shards": data.shards,
            "append_eod": data.append_eod,
            "eod_id": tokenizer.eod_id,
            "dtype": dtype.name,
            "format": data.format,
        }
    )
    return ShardPlan(shards=data.shards, characters=scan.characters, key=key)


# --------------------------------------------------------------------------- workers


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], eod_id: int | None, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize a batch into one flat array plus per-document lengths (EOD included)."""
    # One thread: each worker process is one core; the libraries' defaults use them all.
    ids = tokenizer.encode_batch(texts, num_threads=1)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    if eod_id is not None:
        flat = np.insert(flat, np.cumsum(lengths), np.asarray(eod_id, dtype=dtype))
        lengths += 1
    return flat, lengths


EncodedBatch = tuple[int, np.ndarray, np.ndarray, np.ndarray | None]
TokenizeJob = tuple[int, list[str], int | None, str, bool]


def encode_job(tokenizer: Tokenizer, job: TokenizeJob) -> EncodedBatch:
    """``(shard, tokens, lengths, loss mask)``; the mask only for chat conversations."""
    shard, texts, eod_id, dtype, chat = job
    if chat:
        return shard, *encode_conversations(tokenizer, texts, np.dtype(dtype))
    tokens, lengths = encode_documents(tokenizer, texts, eod_id, np.dtype(dtype))
    return shard, tokens, lengths, None


def describe_jobs(jobs: list[TokenizeJob]) -> str:
    """The shards and documents a window of tokenize jobs holds, for an error."""
    shards = sorted({job[0] for job in jobs})
    documents = sum(len(job[1]) for job in jobs)
    names = shard_name(shards[0]) + (f"..{shard_name(shards[-1])}" if len(shards) > 1 else "")
    return f"{documents} document(s) of {names}"


# --------------------------------------------------------------------------- shards


class ShardStore:
    """Where shards are written: local directories, or a temp dir uploaded to a URL."""

    def __init__(self, output: str, storage_options: dict[str, Any]):
        self.output = output.rstrip("/")
        self.options = storage_options
        self.state = join(self.output, STATE_DIR)
        if is_local(output):
            self.staging = Path(self.state.removeprefix("file://"))
            self.staging.mkdir(parents=True, exist_ok=True)
        else:
            self.staging = Path(tempfile.mkdtemp(prefix="megalith-shards-"))
            filesystem(self.output, storage_options)[0].makedirs(
                filesystem(self.output, storage_options)[1], exist_ok=True
            )

    def staging_prefix(self, name: str) -> str:
        return str(self.staging / name)

    def publish(self, name: str, with_mask: bool = False) -> dict[str, FileInfo]:
        """Move a finished shard (and its loss-mask shard) into place; return the file hashes."""
        files = {}
        prefixes = [name, mask_name(name)] if with_mask else [name]
        for prefix, suffix in itertools.product(prefixes, (".bin", ".idx")):
            local = self.staging / f"{prefix}{suffix}"
            files[f"{prefix}{suffix}"] = FileInfo(
                sha256=sha256_of_file(str(local)), bytes=local.stat().st_size
            )
            target = join(self.output, f"{prefix}{suffix}")
            if is_local(self.output):
                os.replace(local, target.removeprefix("file://"))
            else:
                fs, path = filesystem(target, self.options)
                fs.put_file(str(local), path)
                local.unlink()
        return files

    def marker_url(self, name: str) -> str:
        return join(self.state, f"{name}.json")

    def is_complete(self, name: str, plan_key: str) -> ShardInfo | None:
        marker = read_json_or_none(self.marker_url(name), self.options)
        if not marker or marker.get("plan") != plan_key or not marker.get("shard"):
            return None
        try:
            shard = ShardInfo.model_validate(marker["shard"])
        except ValueError:  # a damaged record: tokenize the shard again
            return None
        for file_name, info in shard.files.items():
            try:
                digest = sha256_of_file(join(self.output, file_name), self.options)
            except FileNotFoundError:
                return None
            if digest != info.sha256:
                return None
        return shard

    def mark_complete(self, shard: ShardInfo, plan_key: str) -> None:
        record = {"plan": plan_key, "shard": shard.model_dump()}
        atomic_write_json(self.marker_url(shard.name), record, self.options)

    def is_empty(self, name: str, plan_key: str) -> bool:
        """Whether a finished run of this plan found no documents for this shard."""
        marker = read_json_or_none(self.marker_url(name), self.options)
        return bool(marker) and marker.get("plan") == plan_key and marker.get("shard") is None

    def mark_empty(self, name: str, plan_key: str) -> None:
        # No files: Megatron cannot memory-map an empty .bin, so an empty shard is not written.
        atomic_write_json(self.marker_url(name), {"plan": plan_key, "shard": None}, self.options)

    def remove_manifest(self) -> None:
        fs, path = filesystem(join(self.output, MANIFEST_NAME), self.options)
        if fs.exists(path):
            fs.rm_file(path)

    def cleanup(self) -> None:
        if not is_local(self.output):
            shutil.rmtree(self.staging, ignore_errors=True)


class ShardWriter:
    """Writes consecutive shards one at a time as their results arrive."""

    def __init__(self, store: ShardStore, plan_key: str, dtype: np.dtype, chat: bool = False):
        self.store = store
        self.plan_key = plan_key
        self.dtype = dtype
        self.chat = chat  # a uint8 loss-mask shard beside each token shard
        self.current: int | None = None
        self.writer: IndexedDatasetWriter | None = None
        self.mask_writer: IndexedDatasetWriter | None = None
        self.finished: dict[int, ShardInfo] = {}

    def add(
        self, shard: int, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None
    ) -> None:
        if shard != self.current:
            self.finish()
            self.current = shard
            prefix = self.store.staging_prefix(shard_name(shard))
            self.writer = IndexedDatasetWriter(prefix, self.dtype)
            if self.chat:
                self.mask_writer = IndexedDatasetWriter(mask_name(prefix), MASK_DTYPE)
        with self._aborting_on_error(".bin"):
            self.writer.add_documents(tokens, lengths)
            if self.chat:
                self.mask_writer.add_documents(mask, lengths)

    def finish(self) -> None:
        if self.writer is None:
            return
        with self._aborting_on_error(".idx"):
            self.writer.finalize()
            if self.chat:
                self.mask_writer.finalize()
        name = shard_name(self.current)
        info = ShardInfo(
            name=name,
            documents=self.writer.num_documents,
            tokens=self.writer.num_tokens,
            files=self.store.publish(name, with_mask=self.chat),
        )
        self.store.mark_complete(info, self.plan_key)
        self.finished[self.current] = info
        self.writer = None

    @contextlib.contextmanager
    def _aborting_on_error(self, suffix: str) -> Iterator[None]:
        """A failed write (a full disk) names the shard's file and deletes the unfinished
        shard's staging files, so the space comes back and nothing partial is left."""
        path = f"{self.store.staging_prefix(shard_name(self.current))}{suffix}"
        try:
            with naming_path(path):
                yield
        except OSError:
            for writer in (self.writer, self.mask_writer):
                if writer is not None:
                    with contextlib.suppress(OSError):
                        writer.abort()
            self.writer = self.mask_writer = None
            raise


# --------------------------------------------------------------------------- prepare


def prepare_dataset(
    data: DataConfig,
    tokenizer: Tokenizer,
    tokenizer_config: TokenizerConfig | None = None,
    show_progress: bool = True,
) -> PrepareReport:
    """Tokenize ``data.inputs`` into ``data.shards`` shards under ``data.output``."""
    if not data.output:
        raise ConfigError("data.output is not set: say where the shards go (--output DIR_OR_URL)")
    tokenizer = with_eod(tokenizer, data.eod)
    corpus = Corpus.open(data)
    store = ShardStore(data.output, data.storage_options)
    try:
        return _prepare(corpus, store, data, tokenizer, tokenizer_config, show_progress)
    finally:
        store.cleanup()  # the local staging directory of a remote output, even after a failure


def _prepare(corpus, store, data, tokenizer, tokenizer_config, show_progress) -> PrepareReport:
    dtype = token_dtype(tokenizer.padded_vocab_size)
    report = PrepareReport(manifest=None, output=store.output)  # type: ignore[arg-type]

    # Start the workers now: their spawn and imports overlap the scan.
    with open_engine(data, encode_job, tokenizer, describe_jobs, "tokenizer") as pool:
        return _scan_and_tokenize(
            corpus, store, data, tokenizer, tokenizer_config, show_progress, pool, dtype, report
        )


def _scan_and_tokenize(
    corpus, store, data, tokenizer, tokenizer_config, show_progress, pool, dtype, report
) -> PrepareReport:
    started = time.perf_counter()
    scan = load_or_scan(corpus, store.state, show_progress)
    report.scan_seconds = time.perf_counter() - started
    if scan.documents == 0:
        raise ConfigError(
            f"no usable documents in {data.inputs} (rejected: {scan.rejects['counts']})"
        )

    plan = make_plan(scan, data, tokenizer, dtype)
    complete, empty = {}, set()
    for index in range(plan.shards):
        shard = store.is_complete(shard_name(index), plan.key)
        if shard is not None:
            complete[index] = shard
        elif store.is_empty(shard_name(index), plan.key):
            empty.add(index)
    report.skipped = [shard.name for shard in complete.values()]
    store.remove_manifest()

    started = time.perf_counter()
    if len(complete) + len(empty) < plan.shards:
        written = _tokenize(
            corpus, scan, plan, tokenizer, data, store, dtype, complete, report, show_progress, pool
        )
        empty = set(range(plan.shards)) - set(complete) - set(written)
        for index in sorted(empty):
            store.mark_empty(shard_name(index), plan.key)
    else:
        written = {}
    report.tokenize_seconds = time.perf_counter() - started
    report.nodes = sorted(pool.nodes)
    report.written = [written[i].name for i in sorted(written)]
    report.empty = [shard_name(i) for i in sorted(empty)]

    shards = {**complete, **written}
    report.manifest = _build_manifest(
        corpus, scan, tokenizer, tokenizer_config, data, dtype, [shards[i] for i in sorted(shards)]
    )
    write_manifest(store.output, report.manifest, data.storage_options)
    return report


def _tokenize(
    corpus, scan, plan, tokenizer, data, store, dtype, complete, report, show_progress, pool
):
    chat = data.format == "chat"
    writer = ShardWriter(store, plan.key, dtype, chat)
    eod = tokenizer.eod_id if data.append_eod and not chat else None
    rejects = RejectLog(max_examples=0)
    position = 0
    with progress_bar(scan.text_bytes, "tokenizing", show_progress) as bar:

        def consume(results):
            for shard, tokens, lengths, mask in results:
                check_token_ids(tokens, tokenizer, shard_name(shard))
                writer.add(shard, tokens, lengths, mask)
                report.tokenized_documents += len(lengths)
                report.tokenized_tokens += len(tokens)
            if show_progress:
                bar.set_postfix(
                    docs=report.tokenized_documents,
                    tokens=report.tokenized_tokens,
                    refresh=False,
                )

        for _, batch in corpus.batches(rejects):
            pieces, position = split_by_shard(batch.texts, position, plan)
            for shard, texts in pieces:
                if shard not in complete:
                    consume(pool.submit((shard, texts, eod, dtype.name, chat)))
            report.tokenized_bytes += batch.nbytes
            bar.update(batch.nbytes)
        consume(pool.drain())
    writer.finish()
    return writer.finished


def check_token_ids(tokens: np.ndarray, tokenizer: Tokenizer, shard: str) -> None:
    """The ids a tokenizer produced lie in its vocabulary: one written past it would index
    past the embedding in training, far from its cause."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= tokenizer.vocab_size)][0]
        raise MegalithError(
            f"{tokenizer.model_path}: produced token id {bad} for {shard}, outside its "
            f"vocabulary of {tokenizer.vocab_size} ids"
        )


def split_by_shard(
    texts: list[str], position: int, plan: ShardPlan
) -> tuple[list[tuple[int, list[str]]], int]:
    """Cut a batch where the shard changes; returns the pieces and the position after it."""
    pieces: list[tuple[int, list[str]]] = []
    for text in texts:
        shard = plan.shard_of(position, len(text))
        position += len(text)
        if pieces and pieces[-1][0] == shard:
            pieces[-1][1].append(text)
        else:
            pieces.append((shard, [text]))
    return pieces, position


def _build_manifest(corpus, scan, tokenizer, tokenizer_config, data, dtype, shards) -> Manifest:
    inputs = [
        InputInfo(url=f.url, bytes=f.size, documents=docs, rejected=bad)
        for f, docs, bad in zip(
            corpus.files, scan.documents_per_input, scan.rejected_per_input, strict=True
        )
    ]
    # Where the work ran does not change the shards: the manifest is the same on any engine.
    config = {"data": data.model_dump(mode="json", exclude={"engine", "ray_address"})}
    curation = find_curation(corpus)
    rejected = RejectedRecords.model_validate(scan.rejects)
    if curation is not None:  # the raw corpus's bad records were met while curating it
        log = RejectLog.from_record(curation.rejected, data.max_bad_examples)
        log.merge(RejectLog.from_record(rejected, data.max_bad_examples))
        rejected = log.to_record()
    if tokenizer_config is not None:
        config["tokenizer"] = tokenizer_config.model_dump(mode="json")
    return Manifest(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        megalith_version=__version__,
        tokenizer=TokenizerInfo(
            id=tokenizer.id,
            kind=tokenizer.kind,
            # Absolute, so that `megalith data inspect --decode` finds it from any directory.
            path=tokenizer.model_path
            if "://" in tokenizer.model_path
            else os.path.abspath(tokenizer.model_path),
            vocab_size=tokenizer.vocab_size,
            padded_vocab_size=tokenizer.padded_vocab_size,
            eod_id=tokenizer.eod_id,
            pad_id=tokenizer.pad_id,
        ),
        dtype=dtype.name,
        append_eod=data.append_eod and data.format != "chat",
        data_format=data.format,
        documents=sum(s.documents for s in shards),
        tokens=sum(s.tokens for s in shards),
        shards=shards,
        inputs=inputs,
        rejected=rejected,
        config=config,
        curation=curation,
    )


# --------------------------------------------------------------------------- helpers


def json_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def read_json_or_none(url: str, storage_options: dict[str, Any]) -> dict[str, Any] | None:
    """A state record, or None when it is missing or damaged (the work is then redone)."""
    try:
        return safe_read.read_json(url, storage_options=storage_options, expect=dict)
    except (FileNotFoundError, ValueError):
        return None


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(
        total=total or None,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        disable=not enabled,
        dynamic_ncols=True,
    )
