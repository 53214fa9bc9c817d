"""``manifest.json``: the contract between preprocessing and every later stage.

A shard set is a directory (or object-store prefix) holding ``shard-XXXXX.bin/.idx``
in Megatron's indexed-dataset format and this manifest. Training reads the manifest
first: tokenizer id, dtype and the sha256 of every file.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from preprocessing.storage import atomic_write_json, join, read_json

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "megalith-shards"
MANIFEST_VERSION = 1
# A chat shard set (data_format "chat") holds, beside each shard, its loss mask as a uint8
# indexed dataset of the same documents: ``shard-XXXXX.mask.bin/.idx``, listed in the
# shard's ``files`` (so hashed, checked and downloaded like the tokens).
MASK_SUFFIX = ".mask"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizerInfo(_Record):
    id: str = Field(description="sha256 of the SentencePiece .model file")
    path: str
    vocab_size: int
    padded_vocab_size: int
    eod_id: int
    pad_id: int | None = None


class FileInfo(_Record):
    sha256: str
    bytes: int


class ShardInfo(_Record):
    name: str
    documents: int
    tokens: int
    files: dict[str, FileInfo]


class InputInfo(_Record):
    url: str
    bytes: int
    documents: int = 0
    rejected: int = 0


class RejectedRecords(_Record):
    total: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    examples: list[dict[str, str]] = Field(default_factory=list)


class Manifest(_Record):
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION
    created_at: str
    megalith_version: str
    tokenizer: TokenizerInfo
    dtype: str
    append_eod: bool
    data_format: Literal["pretrain", "chat"] = "pretrain"
    documents: int
    tokens: int
    shards: list[ShardInfo]
    inputs: list[InputInfo]
    rejected: RejectedRecords
    config: dict[str, Any]

    def shard_prefixes(self, root: str) -> list[str]:
        return [join(root, shard.name) for shard in self.shards]


def manifest_url(root: str) -> str:
    return join(root, MANIFEST_NAME)


def read_manifest(root: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    url = manifest_url(root)
    try:
        raw = read_json(url, storage_options)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{url} not found: {root} is not a prepared shard set (run `megalith data prepare`)"
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{url}: not a Megalith shard manifest (format != {MANIFEST_FORMAT!r})")
    if raw.get("version") != MANIFEST_VERSION:
        raise ValueError(
            f"{url}: manifest version {raw.get('version')} is not supported "
            f"(this Megalith reads version {MANIFEST_VERSION})"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{url}: {key}: {first['msg']}") from None


def write_manifest(
    root: str, manifest: Manifest, storage_options: dict[str, Any] | None = None
) -> None:
    atomic_write_json(manifest_url(root), manifest.model_dump(mode="json"), storage_options)
