"""A shard set made by Megatron-LM's ``tools/preprocess_data.py``: ``PREFIX.bin/.idx``, no
manifest. Once the user names the tokenizer and the EOD it appended, a manifest is built
in memory from the files themselves, so ``data verify``, ``data inspect`` and training check
and read the pair like a prepared shard set (nothing is written beside the user's files).
A ``PREFIX`` on object storage (``s3://...``) is downloaded once into the cache
(``data.cache_dir``, else ~/.cache/megalith/megatron/), again only when the remote files'
size or ETag change, and read from there."""

from __future__ import annotations

import json
import os
import posixpath
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from megalith import __version__
from megalith.errors import MegalithError
from megalith.storage import (
    cache_root,
    filesystem,
    is_local,
    sha256_of_bytes,
    sha256_of_file,
)
from preprocessing.indexed_dataset import IndexedDatasetReader, token_dtype
from preprocessing.manifest import (
    MANIFEST_NAME,
    FileInfo,
    Manifest,
    RejectedRecords,
    ShardInfo,
    TokenizerInfo,
    read_manifest,
)
from preprocessing.tokenizer import Tokenizer, load_tokenizer, with_eod

HOW = "name its tokenizer and EOD (data verify: --tokenizer MODEL --eod eos; training: "
HOW += "data.blend: [{path: PREFIX, tokenizer: MODEL, eod: eos}])"


def read_shard_set_manifest(
    path: str,
    storage_options: dict[str, Any] | None = None,
    tokenizer: str | None = None,
    eod: str | None = None,
    cache_dir: str | None = None,
) -> tuple[str, Manifest]:
    """``(folder, manifest)`` of a prepared shard set, or of a Megatron-LM prefix once its
    tokenizer and EOD are named (a remote prefix: its local copy's folder). Errors of
    ``read_manifest`` pass through."""
    if tokenizer is None and eod is None:
        if is_local(path) and is_megatron_prefix(path):
            raise MegalithError(f"{path}.idx: a Megatron-LM shard with no manifest.json: {HOW}")
        try:
            return path, read_manifest(path, storage_options)
        except (FileNotFoundError, MegalithError):
            if not is_local(path) and is_megatron_prefix(path, storage_options):
                raise MegalithError(
                    f"{path}.idx: a Megatron-LM shard with no manifest.json: {HOW}"
                ) from None
            raise
    if tokenizer is None or eod is None:
        raise MegalithError(f"{path}: a Megatron-LM prefix needs both a tokenizer and an eod")
    if not is_megatron_prefix(path, storage_options):
        raise MegalithError(
            f"{path}: not a Megatron-LM PREFIX.bin/.idx pair (a tokenizer and eod are named "
            "only for those; a prepared shard set has them in its manifest)"
        )
    local = path if is_local(path) else fetch_prefix(path, storage_options, cache_dir)
    loaded = load_tokenizer(tokenizer, storage_options=storage_options)
    return megatron_manifest(local, loaded, eod, source=path)


def is_megatron_prefix(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    """A ``PATH.bin``/``PATH.idx`` pair (local or remote), and no prepared shard set at ``PATH``."""
    fs, base = filesystem(path, storage_options)
    has_pair = fs.exists(f"{base}.idx") or fs.exists(f"{base}.bin")
    return has_pair and not fs.exists(f"{base}/{MANIFEST_NAME}")


def fetch_prefix(
    url: str, storage_options: dict[str, Any] | None = None, cache_dir: str | None = None
) -> str:
    """The local copy of the remote pair ``url``.bin/.idx (a local ``PREFIX``): downloaded
    beside a record of each file's size and ETag, and downloaded again when they change."""
    fs, base = filesystem(url, storage_options)
    name = posixpath.basename(base)
    folder = Path(cache_dir or cache_root()) / "megatron" / sha256_of_bytes(url.encode())[:20]
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".idx", ".bin"):
        try:
            info = fs.info(f"{base}{suffix}")
        except FileNotFoundError:
            raise MegalithError(
                f"{url}{suffix}: missing (a Megatron shard is a .bin/.idx pair)"
            ) from None
        stamp = {"url": f"{url}{suffix}", "size": info.get("size"), "etag": info.get("ETag")}
        target, record = folder / f"{name}{suffix}", folder / f"{name}{suffix}.source.json"
        if target.is_file() and record.is_file() and json.loads(record.read_text()) == stamp:
            continue
        tmp = folder / f".{name}{suffix}.{os.getpid()}.tmp"
        try:
            fs.get(f"{base}{suffix}", str(tmp))
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
        record.write_text(json.dumps(stamp))
    return str(folder / name)


def megatron_manifest(
    prefix: str, tokenizer: Tokenizer, eod: str, source: str | None = None
) -> tuple[str, Manifest]:
    """``(folder, manifest)`` for the local pair at ``prefix`` (a copy of ``source``),
    checked against ``tokenizer``: the index whole, the dtype Megatron's tool picks for its
    vocabulary. Token ids are checked where they are read (``data verify``: every one;
    training: each sample's)."""
    prefix = prefix.removeprefix("file://")
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(f"{prefix}{suffix}"):
            raise MegalithError(f"{prefix}{suffix}: missing (a Megatron shard is a .bin/.idx pair)")
    reader = IndexedDatasetReader(prefix)  # a bad index raises, naming the .idx
    expected = token_dtype(tokenizer.vocab_size)
    if reader.dtype != expected:
        raise MegalithError(
            f"{prefix}.idx: holds {reader.dtype} tokens, but preprocess_data.py writes "
            f"{expected} for the {tokenizer.vocab_size} ids of {tokenizer.model_path}: "
            "made with another tokenizer?"
        )
    eod_id = with_eod(tokenizer, eod).eod_id
    name = os.path.basename(prefix)
    files = {
        f"{name}{suffix}": FileInfo(
            sha256=sha256_of_file(f"{prefix}{suffix}"), bytes=os.path.getsize(f"{prefix}{suffix}")
        )
        for suffix in (".bin", ".idx")
    }
    shard = ShardInfo(
        name=name, documents=reader.num_documents, tokens=reader.num_tokens, files=files
    )
    manifest = Manifest(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        megalith_version=__version__,
        tokenizer=TokenizerInfo(
            id=tokenizer.id,
            kind=tokenizer.kind,
            path=tokenizer.model_path
            if not is_local(tokenizer.model_path)
            else os.path.abspath(tokenizer.model_path),
            vocab_size=tokenizer.vocab_size,
            padded_vocab_size=tokenizer.padded_vocab_size,
            eod_id=eod_id,
            pad_id=tokenizer.pad_id,
        ),
        dtype=np.dtype(reader.dtype).name,
        append_eod=True,
        documents=shard.documents,
        tokens=shard.tokens,
        shards=[shard],
        inputs=[],
        rejected=RejectedRecords(),
        config={"megatron_prefix": source or prefix, "eod": eod},
    )
    return os.path.dirname(os.path.abspath(prefix)), manifest
