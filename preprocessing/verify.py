"""Checking and describing a prepared shard set (``megalith data verify|inspect``)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from megalith.errors import MegalithError
from megalith.storage import filesystem, is_local, join, sha256_of_file
from preprocessing.indexed_dataset import IndexedDatasetError, IndexedDatasetReader
from preprocessing.manifest import MASK_SUFFIX, Manifest, ShardInfo
from preprocessing.megatron_shards import read_shard_set_manifest
from preprocessing.tokenizer import Tokenizer


def verify_shard_set(
    root: str,
    storage_options: dict[str, Any] | None = None,
    tokenizer: str | None = None,
    eod: str | None = None,
) -> list[str]:
    """Re-hash every file the manifest names; return a list of problems (empty when sound).
    With ``tokenizer`` and ``eod``, ``root`` is a Megatron-LM ``PREFIX`` (no manifest)."""
    try:
        root, manifest = read_shard_set_manifest(root, storage_options, tokenizer, eod)
    except (FileNotFoundError, ValueError, MegalithError) as exc:
        return [str(exc)]
    problems = []
    for shard in manifest.shards:
        file_problems = _verify_files(root, shard.files, storage_options)
        problems += file_problems
        if not file_problems and is_local(root):
            vocab = manifest.tokenizer.vocab_size
            problems += _verify_index(root, shard, shard.name, manifest.dtype, vocab)
            if manifest.data_format == "chat":  # the loss mask covers the same tokens, 0 or 1
                problems += _verify_index(root, shard, shard.name + MASK_SUFFIX, "uint8", 2)
    totals = (sum(s.documents for s in manifest.shards), sum(s.tokens for s in manifest.shards))
    if totals != (manifest.documents, manifest.tokens):
        problems.append(
            f"manifest totals ({manifest.documents} documents, {manifest.tokens} tokens) "
            f"differ from the sum over shards {totals}"
        )
    return problems + _curation_problems(manifest)


def _curation_problems(manifest: Manifest) -> list[str]:
    """A curated corpus's accounting adds up: every document read was kept or removed
    once, and the shards hold the kept ones."""
    curation = manifest.curation
    if curation is None:
        return []
    problems = []
    if curation.documents_out + curation.removed.total != curation.documents_in:
        problems.append(
            f"curation: {curation.documents_out} kept + {curation.removed.total} removed "
            f"!= {curation.documents_in} documents read"
        )
    if curation.documents_out != manifest.documents:
        problems.append(
            f"curation kept {curation.documents_out} documents; the shards hold {manifest.documents}"
        )
    return problems


def _verify_files(root: str, files: dict, storage_options) -> list[str]:
    problems = []
    for name, expected in files.items():
        url = join(root, name)
        fs, path = filesystem(url, storage_options)
        if not fs.exists(path):
            problems.append(f"{url}: missing")
            continue
        size = fs.size(path)
        if size != expected.bytes:
            problems.append(f"{url}: {size} bytes, manifest says {expected.bytes}")
            continue
        digest = sha256_of_file(url, storage_options)
        if digest != expected.sha256:
            problems.append(
                f"{url}: sha256 {digest[:16]}… does not match manifest {expected.sha256[:16]}…"
            )
    return problems


def _verify_index(root: str, shard: ShardInfo, name: str, dtype: str, limit: int) -> list[str]:
    """The .idx checked whole against its .bin, the counts and dtype against the manifest,
    and every value (token id, or mask value) below ``limit``."""
    prefix = join(root, name).removeprefix("file://")
    try:
        reader = IndexedDatasetReader(prefix)
    except IndexedDatasetError as exc:
        return [str(exc)]
    if reader.dtype != np.dtype(dtype):
        return [f"{prefix}.idx: holds {reader.dtype}, manifest says {dtype}"]
    found = (reader.num_documents, reader.num_tokens)
    if found != (shard.documents, shard.tokens):
        return [
            f"{prefix}: holds {found[0]} documents / {found[1]} tokens, "
            f"manifest says {shard.documents} / {shard.tokens}"
        ]
    outside = reader.first_token_outside(limit)
    if outside is not None:
        document, value = outside
        what = "token id" if name == shard.name else "loss-mask value"
        return [
            f"{prefix}.bin: document {document} holds {what} {value}; expected below {limit}"
            + (" (the vocabulary size in the manifest)" if name == shard.name else "")
        ]
    return []


def describe_shard_set(manifest: Manifest, root: str) -> str:
    """A human summary of a manifest: what it was made from and what it holds."""
    lines = [
        f"shard set     {root}",
        f"created       {manifest.created_at} by megalith {manifest.megalith_version}",
        f"tokenizer     {manifest.tokenizer.id[:16]}…  vocab {manifest.tokenizer.vocab_size} "
        f"(padded {manifest.tokenizer.padded_vocab_size}), eod id {manifest.tokenizer.eod_id}",
        f"              {manifest.tokenizer.kind}: {manifest.tokenizer.path}",
        f"tokens        {manifest.tokens:,} as {manifest.dtype}, EOD appended: {manifest.append_eod}",
        f"documents     {manifest.documents:,} "
        f"({manifest.tokens / max(1, manifest.documents):.1f} tokens each on average)",
        f"inputs        {len(manifest.inputs)} file(s), {sum(i.bytes for i in manifest.inputs):,} bytes",
        f"rejected      {manifest.rejected.total:,}"
        + (f"  {dict(manifest.rejected.counts)}" if manifest.rejected.total else ""),
        *_curation_lines(manifest),
        "",
        f"{'shard':<14}{'documents':>12}{'tokens':>14}  sha256 (.bin)",
    ]
    for shard in manifest.shards:
        digest = shard.files.get(f"{shard.name}.bin")
        lines.append(
            f"{shard.name:<14}{shard.documents:>12,}{shard.tokens:>14,}  "
            f"{digest.sha256[:16] if digest else '-'}"
        )
    for example in manifest.rejected.examples:
        lines.append(
            f"  rejected {example.get('location')}: {example.get('reason')} {example.get('detail', '')}"
        )
    return "\n".join(lines)


def _curation_lines(manifest: Manifest) -> list[str]:
    curation = manifest.curation
    if curation is None:
        return []
    lines = [
        f"curated       kept {curation.documents_out:,} of {curation.documents_in:,} documents "
        f"from {len(curation.inputs)} raw file(s)"
    ]
    for title, counts in curation.buckets():
        lines.append(f"  {title:<12}{counts.total:,}  {dict(counts.counts)}")
    return lines


def decode_samples(
    manifest: Manifest,
    root: str,
    tokenizer: Tokenizer,
    count: int,
    max_chars: int = 400,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Decode the first ``count`` documents of the first shard back to text."""
    if tokenizer.id != manifest.tokenizer.id:
        raise ValueError(
            f"tokenizer {tokenizer.model_path} (id {tokenizer.id[:16]}…) is not the one these "
            f"shards were made with (id {manifest.tokenizer.id[:16]}…)"
        )
    if not manifest.shards:
        return []
    texts = []
    with tempfile.TemporaryDirectory(prefix="megalith-inspect-") as tmp:
        reader = _open_first_documents(root, manifest.shards[0], count, tmp, storage_options)
        for index in range(min(count, len(reader))):
            ids = reader[index]
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise IndexedDatasetError(
                    f"{join(root, manifest.shards[0].name)}.bin: document {index} holds a token "
                    f"id outside the tokenizer's {tokenizer.vocab_size} ids "
                    "(run `megalith data verify`)"
                )
            text = tokenizer.decode(ids.tolist())
            texts.append(text if len(text) <= max_chars else text[:max_chars] + " …")
    return texts


def _open_first_documents(
    root: str, shard: ShardInfo, count: int, tmp: str, storage_options: dict[str, Any] | None
) -> IndexedDatasetReader:
    """A reader whose first ``count`` documents can be read. For a remote shard set only the
    .idx and the bytes of those documents are fetched; the rest of the local .bin is a hole."""
    if is_local(root):
        return IndexedDatasetReader(join(root, shard.name).removeprefix("file://"))
    prefix = os.path.join(tmp, shard.name)
    fs, idx_path = filesystem(join(root, f"{shard.name}.idx"), storage_options)
    size, listed = fs.size(idx_path), shard.files[f"{shard.name}.idx"].bytes
    if size != listed:  # fetch no more than the manifest promised
        raise IndexedDatasetError(
            f"{join(root, shard.name)}.idx: {size} bytes, manifest says {listed}"
        )
    fs.get_file(idx_path, f"{prefix}.idx")
    with open(f"{prefix}.bin", "wb") as handle:
        handle.truncate(shard.files[f"{shard.name}.bin"].bytes)
    reader = IndexedDatasetReader(prefix)
    last = min(count, len(reader)) - 1
    if last >= 0:
        itemsize = reader.dtype.itemsize
        end = int(reader.sequence_pointers[last]) + int(reader.sequence_lengths[last]) * itemsize
        _, bin_path = filesystem(join(root, f"{shard.name}.bin"), storage_options)
        with open(f"{prefix}.bin", "r+b") as handle:
            handle.write(fs.cat_file(bin_path, start=0, end=end))
    return IndexedDatasetReader(prefix)
