"""A shard set made by Megatron-LM's ``tools/preprocess_data.py``: ``PREFIX.bin/.idx``, no
manifest. Once the user names the tokenizer and the EOD it appended, a manifest is built
in memory from the files themselves, so ``data verify`` and training check and read the
pair like a prepared shard set (nothing is written beside the user's files)."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import numpy as np

from megalith import __version__
from megalith.errors import MegalithError
from megalith.storage import is_local, sha256_of_file
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
    path: str, storage_options=None, tokenizer: str | None = None, eod: str | None = None
) -> tuple[str, Manifest]:
    """``(folder, manifest)`` of a prepared shard set, or of a Megatron-LM prefix once its
    tokenizer and EOD are named. Errors of ``read_manifest`` pass through."""
    if tokenizer is None and eod is None:
        if is_megatron_prefix(path):
            raise MegalithError(f"{path}.idx: a Megatron-LM shard with no manifest.json: {HOW}")
        return path, read_manifest(path, storage_options)
    if tokenizer is None or eod is None:
        raise MegalithError(f"{path}: a Megatron-LM prefix needs both a tokenizer and an eod")
    if not is_megatron_prefix(path):
        raise MegalithError(
            f"{path}: not a Megatron-LM PREFIX.bin/.idx pair on local disk (a tokenizer and "
            "eod are named only for those; a prepared shard set has them in its manifest)"
        )
    return megatron_manifest(path, load_tokenizer(tokenizer), eod)


def is_megatron_prefix(path: str) -> bool:
    """A local ``PATH.bin``/``PATH.idx`` pair, and no prepared shard set at ``PATH``."""
    if not is_local(path):
        return False
    path = path.removeprefix("file://")
    has_pair = os.path.exists(f"{path}.idx") or os.path.exists(f"{path}.bin")
    return has_pair and not os.path.exists(os.path.join(path, MANIFEST_NAME))


def megatron_manifest(prefix: str, tokenizer: Tokenizer, eod: str) -> tuple[str, Manifest]:
    """``(folder, manifest)`` for the pair at ``prefix``, checked against ``tokenizer``:
    the index whole, the dtype Megatron's tool picks for its vocabulary. Token ids are
    checked where they are read (``data verify``: every one; training: each sample's)."""
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
            path=os.path.abspath(tokenizer.model_path),
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
        config={"megatron_prefix": prefix, "eod": eod},
    )
    return os.path.dirname(os.path.abspath(prefix)), manifest
