"""The curation record beside a curated corpus, and finding it from the files that
``megalith data prepare`` reads (so the shard manifest carries it)."""

from __future__ import annotations

import posixpath
from typing import Any

from megalith import safe_read
from megalith.storage import join
from preprocessing.corpus import Corpus
from preprocessing.manifest import CurationRecord

RECORD_NAME = "_curation.json"  # "_": a directory walk over the folder does not read it


def read_record(
    folder: str, storage_options: dict[str, Any] | None = None
) -> CurationRecord | None:
    """The curation record in ``folder``; None when there is none or it is damaged."""
    try:
        raw = safe_read.read_json(
            join(folder, RECORD_NAME), storage_options=storage_options, expect=dict
        )
        return CurationRecord.model_validate(raw)
    except (FileNotFoundError, ValueError):
        return None


def find_curation(corpus: Corpus) -> CurationRecord | None:
    """The record of the curation whose output is exactly ``corpus``'s files (all in one
    folder, the same names and sizes), or None."""
    folders = {posixpath.dirname(source.url) for source in corpus.files}
    if len(folders) != 1:
        return None
    record = read_record(folders.pop(), corpus.config.storage_options)
    if record is None:
        return None
    sizes = {posixpath.basename(source.url): source.size for source in corpus.files}
    return record if sizes == {n: i.bytes for n, i in record.outputs.items()} else None
