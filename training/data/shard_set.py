"""A prepared shard set opened for training: every shard of its manifest, as one document list.

Documents are numbered across shards in manifest order. Local shard sets are checked
cheaply (files exist, byte sizes match the manifest); remote ones (``s3://``...) are
downloaded into a local cache, each file's sha256 checked against the manifest, and
then memory-mapped like local ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megalith.config import DataConfig, DatasetSource
from megalith.errors import MegalithError
from megalith.storage import cache_root, filesystem, is_local, join
from preprocessing.indexed_dataset import IndexedDatasetError, IndexedDatasetReader
from preprocessing.manifest import MASK_SUFFIX, Manifest
from preprocessing.megatron_shards import read_shard_set_manifest

logger = logging.getLogger(__name__)

HASH_CHUNK = 8 << 20


class ShardSetError(MegalithError):
    """A shard set whose files do not match its manifest.

    Raised in DataLoader workers too, whose error torch re-raises in the training process
    as ``ShardSetError("Caught ShardSetError in DataLoader worker process 0. Original
    Traceback ...")``: the message keeps only the worker's own last line, so the user sees
    one line, not a traceback.
    """

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit(marker, 1)[-1]
        super().__init__(message)


def default_cache_root() -> Path:
    return cache_root()


@dataclass(eq=False)
class ShardSet:
    """The documents of one shard set: lengths for index building, tokens for samples."""

    root: str
    manifest: Manifest
    readers: list[IndexedDatasetReader]
    # Chat shard sets (manifest data_format "chat"): each shard's uint8 loss mask.
    mask_readers: list[IndexedDatasetReader] | None = None
    document_lengths: np.ndarray = field(init=False)  # int64 [documents]
    _first_document: np.ndarray = field(init=False)  # int64 [shards + 1]
    _document_starts: list[np.ndarray] = field(
        init=False
    )  # per shard: token offset of each document

    def __post_init__(self) -> None:
        spans = [_document_spans(reader) for reader in self.readers]
        self.document_lengths = np.concatenate([np.zeros(0, np.int64)] + [s[0] for s in spans])
        self._document_starts = [s[1] for s in spans]
        counts = [r.num_documents for r in self.readers]
        self._first_document = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    @property
    def num_documents(self) -> int:
        return self.document_lengths.size

    @property
    def tokenizer_id(self) -> str:
        return self.manifest.tokenizer.id

    @property
    def fingerprint(self) -> str:
        """Identifies the data: tokenizer and every file's sha256 (not where it lives)."""
        return shard_set_fingerprint(self.manifest)

    def document_tokens(self, document: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of a document (numbered across the whole set).

        Every id is checked against the vocabulary here, on the tokens a sample takes (a
        min and a max over at most a sample: nothing beside a training step), so an id
        that would index past the embedding fails naming the shard and the document.
        Checking whole shards at open would read every shard on every rank before the
        first step; ``megalith data verify`` does that once, offline.
        """
        shard, local, base = self._locate(document)
        tokens = self.readers[shard].tokens[base + start : base + stop]
        vocab = self.manifest.tokenizer.vocab_size
        if tokens.size and (tokens.max() >= vocab or tokens.min() < 0):
            bad = tokens[(tokens >= vocab) | (tokens < 0)][0]
            raise ShardSetError(
                f"{join(self.root, self.manifest.shards[shard].name)}: document {local} holds "
                f"token id {bad}, outside the vocabulary of {vocab} ids in the manifest "
                "(run `megalith data verify` on the shard set)"
            )
        return tokens

    def _locate(self, document: int) -> tuple[int, int, int]:
        """``(shard, document within it, its first token)`` of a document of the set."""
        shard = int(np.searchsorted(self._first_document, document, side="right")) - 1
        local = document - int(self._first_document[shard])
        return shard, local, int(self._document_starts[shard][local])

    def require_loss_masks(self) -> None:
        """Raise unless this is a chat shard set (``data.format=chat`` trains on its masks)."""
        if self.mask_readers is None:
            raise ShardSetError(
                f"{self.root}: data.format=chat needs a chat shard set with loss masks "
                "(megalith data prepare --format chat)"
            )

    def document_loss_mask(self, document: int, start: int, stop: int) -> np.ndarray:
        """Loss mask ``[start, stop)`` of a chat document (1 on assistant tokens)."""
        if self.mask_readers is None:
            raise ShardSetError(f"{self.root}: not a chat shard set (it has no loss masks)")
        shard, local, base = self._locate(document)
        mask = self.mask_readers[shard].tokens[base + start : base + stop]
        if mask.size and mask.max() > 1:  # a loss weight of 255 would swamp the batch
            raise ShardSetError(
                f"{join(self.root, self.manifest.shards[shard].name + MASK_SUFFIX)}: document "
                f"{local} holds loss-mask value {mask.max()}; expected 0 or 1"
            )
        return mask


def _document_spans(reader: IndexedDatasetReader) -> tuple[np.ndarray, np.ndarray]:
    """Length and first-token offset of each document (a document may hold several sequences)."""
    sequence_ends = np.zeros(len(reader) + 1, dtype=np.int64)
    np.cumsum(reader.sequence_lengths, dtype=np.int64, out=sequence_ends[1:])
    bounds = sequence_ends[reader.document_indices]
    return np.diff(bounds), bounds[:-1]


def shard_set_fingerprint(manifest: Manifest) -> str:
    identity = {
        "tokenizer": manifest.tokenizer.id,
        "dtype": manifest.dtype,
        "shards": [
            [shard.name, sorted((name, f.sha256) for name, f in shard.files.items())]
            for shard in manifest.shards
        ],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def open_shard_set(
    root: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    tokenizer: str | None = None,
    eod: str | None = None,
) -> ShardSet:
    """Read the manifest, make the shards available locally, check them and open them.
    With ``tokenizer`` and ``eod``, ``root`` is a Megatron-LM ``PREFIX`` (no manifest)."""
    root = root.rstrip("/")
    try:
        root, manifest = read_shard_set_manifest(root, storage_options, tokenizer, eod, cache_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise ShardSetError(str(exc)) from None
    if is_local(root):
        local_root = root.removeprefix("file://")
        _check_local_files(local_root, manifest)
    else:
        base = Path(cache_dir) if cache_dir else default_cache_root()
        local = base / "shards" / shard_set_fingerprint(manifest)[:20]
        _download_verified(root, manifest, local, storage_options)
        local_root = str(local)
    readers = [_open_shard(local_root, root, manifest, shard.name) for shard in manifest.shards]
    _check_counts(root, manifest, readers)
    masks = None
    if manifest.data_format == "chat":
        masks = [_open_mask(local_root, root, shard.name) for shard in manifest.shards]
        _check_counts(root, manifest, masks)
    return ShardSet(root=root, manifest=manifest, readers=readers, mask_readers=masks)


def open_source(source: DatasetSource, data: DataConfig) -> ShardSet:
    """The shard set of one ``data.blend`` entry (or ``data.output``)."""
    return open_shard_set(
        source.path, data.storage_options, data.cache_dir, source.tokenizer, source.eod
    )


def _open_shard(local_root: str, root: str, manifest: Manifest, name: str) -> IndexedDatasetReader:
    try:
        reader = IndexedDatasetReader(os.path.join(local_root, name))
    except IndexedDatasetError as exc:
        raise ShardSetError(f"shard set {root}: {exc}") from None
    if reader.dtype != np.dtype(manifest.dtype):
        raise ShardSetError(
            f"{join(root, name)}.idx: tokens are {reader.dtype}, manifest says {manifest.dtype}"
        )
    return reader


def _open_mask(local_root: str, root: str, name: str) -> IndexedDatasetReader:
    try:
        reader = IndexedDatasetReader(os.path.join(local_root, name + MASK_SUFFIX))
    except IndexedDatasetError as exc:
        raise ShardSetError(f"shard set {root}: {exc}") from None
    if reader.dtype != np.uint8:
        raise ShardSetError(
            f"{join(root, name + MASK_SUFFIX)}.idx: mask is {reader.dtype}, not uint8"
        )
    return reader


def _check_local_files(root: str, manifest: Manifest) -> None:
    for shard in manifest.shards:
        for name, info in shard.files.items():
            path = os.path.join(root, name)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise ShardSetError(f"{path}: missing (listed in {root}/manifest.json)") from None
            if size != info.bytes:
                raise ShardSetError(
                    f"{path}: {size} bytes, but {root}/manifest.json says {info.bytes}: "
                    "the shard set changed after it was prepared"
                )


def _check_counts(root: str, manifest: Manifest, readers: list[IndexedDatasetReader]) -> None:
    for shard, reader in zip(manifest.shards, readers, strict=True):
        found = (reader.num_documents, reader.num_tokens)
        if found != (shard.documents, shard.tokens):
            raise ShardSetError(
                f"{join(root, shard.name)}: holds {found[0]} documents / {found[1]} tokens, "
                f"manifest says {shard.documents} / {shard.tokens}"
            )


def _download_verified(
    root: str, manifest: Manifest, local: Path, storage_options: dict[str, Any] | None
) -> None:
    """Copy every file to ``local``; a file is renamed into place only once its sha256 matched,
    so a file already there with the manifest's size was verified before."""
    local.mkdir(parents=True, exist_ok=True)
    for shard in manifest.shards:
        for name, info in shard.files.items():
            target = local / name
            if target.exists() and target.stat().st_size == info.bytes:
                continue
            url = join(root, name)
            logger.info("downloading %s (%d bytes) to %s", url, info.bytes, target)
            _download_one(url, target, info.sha256, storage_options)


def _download_one(
    url: str, target: Path, sha256: str, storage_options: dict[str, Any] | None
) -> None:
    fs, path = filesystem(url, storage_options)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        try:
            fs.get_file(path, str(tmp))
        except FileNotFoundError:
            raise ShardSetError(f"{url}: missing (listed in the manifest)") from None
        digest = _sha256_of_path(tmp)
        if digest != sha256:
            raise ShardSetError(
                f"{url}: sha256 {digest} does not match the manifest's {sha256}: "
                "the shard set changed after it was prepared, or the download is corrupt"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256_of_path(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
