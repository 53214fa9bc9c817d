"""``manifest.json``: the contract between preprocessing and every later stage.

A shard set is a directory (or object-store prefix) holding ``shard-XXXXX.bin/.idx``
in Megatron's indexed-dataset format and this manifest. Training reads the manifest
first: tokenizer id, dtype and the sha256 of every file.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megalith import safe_read
from megalith.errors import MegalithError
from megalith.storage import atomic_write_json, is_local, join

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "megalith-shards"
MANIFEST_VERSION = 1
# A chat shard set (data_format "chat") holds, beside each shard, its loss mask as a uint8
# indexed dataset of the same documents: ``shard-XXXXX.mask.bin/.idx``, listed in the
# shard's ``files`` (so hashed, checked and downloaded like the tokens).
MASK_SUFFIX = ".mask"
# Token dtypes a shard may hold (indexed-dataset integer codes).
TokenDtype = Literal["uint8", "int8", "int16", "uint16", "int32", "int64"]
Count = Field(ge=0)


class ManifestError(MegalithError, ValueError):
    """A manifest.json that is not JSON, not a manifest, or names files outside its folder."""


class _Record(BaseModel):
    # strict: "bytes": "123" is an error, not 123 (a manifest is written by us, as numbers)
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizerInfo(_Record):
    id: str = Field(description="sha256 of the tokenizer file (.model, tokenizer.json)")
    kind: Literal["sentencepiece", "hf"] = Field(
        default="sentencepiece", description="SentencePiece, or Hugging Face tokenizers"
    )
    path: str
    vocab_size: int = Field(ge=1)
    padded_vocab_size: int = Field(ge=1)
    eod_id: int = Field(ge=0)
    pad_id: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _ids_inside(self) -> TokenizerInfo:
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size is below vocab_size {self.vocab_size}")
        for key in ("eod_id", "pad_id"):
            value = getattr(self, key)
            if value is not None and value >= self.vocab_size:
                raise ValueError(f"{key} {value} is outside the vocabulary of {self.vocab_size}")
        return self


class FileInfo(_Record):
    sha256: str
    bytes: int = Count


class ShardInfo(_Record):
    name: str
    documents: int = Count
    tokens: int = Count
    files: dict[str, FileInfo]


class InputInfo(_Record):
    url: str
    bytes: int = Count
    documents: int = Field(default=0, ge=0)
    rejected: int = Field(default=0, ge=0)


class RejectedRecords(_Record):
    total: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    examples: list[dict[str, str]] = Field(default_factory=list)


class RuleCounts(_Record):
    """Documents a curation rule removed, changed or flagged: counts by rule and the first
    few examples (``location``, ``rule``, ``detail``, ``text``: the start of the document)."""

    total: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    examples: list[dict[str, str]] = Field(default_factory=list)


class CurationRecord(_Record):
    """What ``megalith data curate`` did to the raw corpus before it was tokenized:
    ``documents_in`` valid documents were read from ``inputs`` (``rejected``: bad records),
    ``removed.total`` were dropped, by rule, and ``documents_out`` written to ``outputs``
    (``changed``: redacted; ``flagged``: reported, kept)."""

    fingerprint: str
    documents_in: int = Count
    documents_out: int = Count
    inputs: list[InputInfo]
    rejected: RejectedRecords
    removed: RuleCounts
    changed: RuleCounts
    flagged: RuleCounts
    redactions: dict[str, int] = Field(default_factory=dict)
    outputs: dict[str, FileInfo]
    config: dict[str, Any]

    def buckets(self) -> list[tuple[str, RuleCounts]]:
        """``removed``, ``changed`` and ``flagged``, those that counted any document."""
        named = [("removed", self.removed), ("changed", self.changed), ("flagged", self.flagged)]
        return [(name, counts) for name, counts in named if counts.total]


class Manifest(_Record):
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION
    created_at: str
    megalith_version: str
    tokenizer: TokenizerInfo
    dtype: TokenDtype
    append_eod: bool
    data_format: Literal["pretrain", "chat"] = "pretrain"
    documents: int = Count
    tokens: int = Count
    shards: list[ShardInfo]
    inputs: list[InputInfo]
    rejected: RejectedRecords
    config: dict[str, Any]
    curation: CurationRecord | None = None  # when the inputs are a curated corpus

    def shard_prefixes(self, root: str) -> list[str]:
        return [join(root, shard.name) for shard in self.shards]

    def file_names(self) -> list[str]:
        return [name for shard in self.shards for name in shard.files]


def manifest_url(root: str) -> str:
    return join(root, MANIFEST_NAME)


def read_manifest(root: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """The manifest of the shard set at ``root``, checked whole: JSON within the shared
    limits, every field typed, every file name a plain name inside ``root`` (and, for a
    local folder, no symlink leading out of it). Errors are :class:`ManifestError`."""
    url = manifest_url(root)
    local = root.removeprefix("file://") if is_local(root) else None
    if local is not None:
        check_files_in_folder(local, [MANIFEST_NAME])
    try:
        raw = safe_read.read_json(url, storage_options=storage_options, expect=dict)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{url} not found: {root} is not a prepared shard set (run `megalith data prepare`)"
        ) from None
    except safe_read.UnsafeFileError as exc:
        raise ManifestError(str(exc)) from None
    if raw.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{url}: not a Megalith shard manifest (format != {MANIFEST_FORMAT!r})")
    if raw.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"{url}: manifest version {raw.get('version')!r:.40} is not supported "
            f"(this Megalith reads version {MANIFEST_VERSION})"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "manifest"
        raise ManifestError(f"{url}: {key}: {first['msg']}") from None
    check_file_names(manifest, url)
    if local is not None:
        check_files_in_folder(local, manifest.file_names())
    return manifest


def check_file_names(manifest: Manifest, source: str) -> None:
    """Shard names are plain, distinct names, and each shard lists exactly its own files:
    ``NAME.bin`` and ``NAME.idx`` (and the mask pair for a chat shard set)."""
    seen: set[str] = set()
    for index, shard in enumerate(manifest.shards):
        try:
            name = safe_read.confined_name(shard.name, source, f"shards.{index}.name")
        except safe_read.UnsafeFileError as exc:
            raise ManifestError(str(exc)) from None
        if name in seen:
            raise ManifestError(f"{source}: shard {name!r} is listed twice")
        seen.add(name)
        expected = shard_file_names(name, manifest.data_format == "chat")
        if set(shard.files) != expected:
            raise ManifestError(
                f"{source}: shards.{index}.files lists {sorted(shard.files)}; "
                f"expected {sorted(expected)}"
            )


def shard_file_names(name: str, chat: bool) -> set[str]:
    prefixes = [name, name + MASK_SUFFIX] if chat else [name]
    return {f"{prefix}{suffix}" for prefix in prefixes for suffix in (".bin", ".idx")}


def check_files_in_folder(folder: str, names: list[str]) -> None:
    """Each of ``names`` in the local ``folder`` that exists is a regular file inside it: a
    symlink may point elsewhere in the folder, never out of it, and no name is a device,
    pipe or folder (hashing a pipe would wait forever)."""
    top = os.path.realpath(folder)
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path) and os.path.dirname(os.path.realpath(path)) != top:
            raise ManifestError(
                f"{path}: a symbolic link to {os.path.realpath(path)}, outside the shard "
                f"folder {folder}; copy the file in instead"
            )
        if os.path.exists(path) and not os.path.isfile(path):
            raise ManifestError(f"{path}: not a regular file (a device, pipe or folder)")


def write_manifest(
    root: str, manifest: Manifest, storage_options: dict[str, Any] | None = None
) -> None:
    atomic_write_json(manifest_url(root), manifest.model_dump(mode="json"), storage_options)
