"""A sharded checkpoint's ``index.json`` (:mod:`training.checkpoint.sharded_files`):
finding the latest committed one, reading it bounded, checking its signature, and
checking that its shards lie inside their tensors, do not overlap and cover them."""

from __future__ import annotations

import bisect
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from megalith import safe_read
from megalith.safe_read import brief
from megalith.storage import is_local
from training.checkpoint.format import (
    MAX_TENSOR_NAME,
    CheckpointError,
    _safe_name,
    check_file_entry,
    check_step,
    read_latest_pointer,
)
from training.checkpoint.sharded_files import (
    FORMAT,
    INDEX,
    LATEST,
    STATE,
    VERSION,
    child_url,
    parse_dtype,
    path_exists,
    read_small_file,
    step_entries,
    step_number,
)
from training.checkpoint.signing import (
    SIGNATURE_FILE,
    SignatureError,
    check_signature_bytes,
    parse_signature,
    should_sign,
    signature_record,
)

MAX_SHARDS = 1 << 16  # boxes of one tensor: far above any layout (TP · EP · FSDP · chunks)
MAX_DIMS = 16
MAX_CELLS = 1 << 22  # grid cells the boxes of one tensor make (about their number in practice)


def check_cover(name: str, entry: dict[str, Any], where: Any) -> None:
    """The shards of a global tensor lie inside it, do not overlap and cover all of it."""
    if len(name) > MAX_TENSOR_NAME:
        raise CheckpointError(
            f"{where}: tensor name {brief(name)} is longer than {MAX_TENSOR_NAME} characters"
        )
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: tensor {name} is not an object in index.json")
    shape = entry.get("shape")
    shards = entry.get("shards")
    if not isinstance(shape, list) or not isinstance(shards, list) or not shards:
        raise CheckpointError(f"{where}: tensor {name} has no shape or no shards in index.json")
    if (
        not all(_is_int(n) and n >= 0 for n in shape)
        or len(shape) > MAX_DIMS
        or len(shards) > MAX_SHARDS
    ):
        raise CheckpointError(
            f"{where}: tensor {name}: shape {brief(shape)} is not a list of at most {MAX_DIMS} sizes, "
            f"or it has more than {MAX_SHARDS} shards"
        )
    boxes = []
    for shard in shards:
        box = shard.get("box") if isinstance(shard, dict) else None
        if (
            not isinstance(box, list)
            or len(box) != len(shape)
            or any(not (isinstance(b, list) and len(b) == 2) for b in box)
            or any(not (_is_int(a) and _is_int(b)) for a, b in box)
            or any(not (0 <= a < b <= n) for (a, b), n in zip(box, shape, strict=True))
        ):
            raise CheckpointError(
                f"{where}: tensor {name}: shard box {brief(box)} is not inside its shape {shape}"
            )
        boxes.append(box)
    _check_disjoint(name, shape, boxes, where)
    volume = sum(math.prod(b - a for a, b in box) for box in boxes)
    if volume != math.prod(shape):
        raise CheckpointError(
            f"{where}: tensor {name}: the shards cover {volume} of its {math.prod(shape)} elements"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_disjoint(name: str, shape: list[int], boxes: list[list[list[int]]], where: Any) -> None:
    """No two boxes overlap, in time linear in the boxes' cells: the boxes' edges cut the
    tensor into a grid of cells, each box marks its cells, and a cell marked twice is an
    overlap. (Comparing every pair would be 2^31 comparisons for MAX_SHARDS boxes.)"""
    cuts = [
        sorted({0, size, *(box[d][0] for box in boxes), *(box[d][1] for box in boxes)})
        for d, size in enumerate(shape)
    ]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_CELLS:
        raise CheckpointError(
            f"{where}: tensor {name}: its shard boxes cut it into {cells} cells, more than "
            f"the {MAX_CELLS} any layout writes"
        )
    marked = np.zeros([len(c) - 1 for c in cuts], dtype=np.bool_)
    for box in boxes:
        region = tuple(
            slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
            for c, (a, b) in zip(cuts, box, strict=True)
        )
        if marked[region].any():
            raise CheckpointError(f"{where}: tensor {name}: shard {box} overlaps another shard")
        marked[region] = True


def latest_sharded_checkpoint(root: str | Path, storage_options=None) -> str | None:
    """The checkpoint latest.json names, if committed (index.json present); else the
    newest committed one (a kill between the commit and latest.json). v1 ones count too.
    A pointer whose step and folder disagree, or a step folder that is a symbolic link,
    is refused."""
    root = str(root)
    pointer = child_url(root, LATEST)
    if path_exists(pointer, storage_options):
        _, name = read_latest_pointer(pointer, read_small_file(pointer, storage_options, 64 << 10))
        url = child_url(root, name)
        _refuse_linked_step(url)
        if path_exists(child_url(url, INDEX), storage_options):
            return url
    complete = [
        (number, name)
        for name in step_entries(root, storage_options)
        if (number := step_number(name)) is not None
        and path_exists(child_url(root, name, INDEX), storage_options)
    ]
    if not complete:
        return None
    url = child_url(root, max(complete)[1])
    _refuse_linked_step(url)
    return url


def _refuse_linked_step(url: str) -> None:
    if is_local(url) and os.path.islink(url.removeprefix("file://")):
        raise CheckpointError(
            f"{url}: a symbolic link; checkpoint step folders must be real folders"
        )


def read_index(
    path: str | Path, storage_options=None, require_signature: bool | None = None
) -> dict[str, Any]:
    """index.json of a checkpoint (v1 or v2), parsed; a clear error when absent.

    ``require_signature`` (not None): the signature over these very bytes is checked
    first (True: it must exist and match; False: checked when present and a key is set).
    None only peeks at the format: loaders go through :func:`open_index`."""
    url = child_url(str(path), INDEX)
    try:
        data = read_small_file(url, storage_options)
    except FileNotFoundError:
        raise CheckpointError(f"{url} is missing: {path} is not a complete checkpoint") from None
    if require_signature is not None:
        _check_signature(str(path), data, require_signature, storage_options)
    try:
        index = safe_read.loads_json(data, url)
    except safe_read.UnsafeFileError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{url}: not a checkpoint index")
    return index


def open_index(
    path: str | Path, storage_options=None, require_signature: bool = False
) -> dict[str, Any]:
    """The v2 index every loader trusts: signature checked over the bytes parsed, every
    table of the shape the loaders index into, the step that of the folder's name."""
    index = read_index(path, storage_options, require_signature)
    check_index(index, child_url(str(path), INDEX))
    check_step(path, index["step"])
    return index


def signing_ready(sign: bool | None) -> bool:
    """Whether to sign; a key that is asked for but missing or unusable is an error now,
    on the training thread, not after the files are written."""
    if not should_sign(sign):
        return False
    signature_record(INDEX, b"")  # reads and checks the key
    return True


def _check_signature(path: str, index: bytes, required: bool, storage_options=None) -> None:
    url = child_url(path, SIGNATURE_FILE)
    try:
        raw = read_small_file(url, storage_options) if path_exists(url, storage_options) else None
        record = None if raw is None else parse_signature(raw, url)
        check_signature_bytes(record, INDEX, index, required, url)
    except SignatureError as exc:
        raise CheckpointError(str(exc)) from None


def is_sharded(index: dict[str, Any]) -> bool:
    return index.get("format") == FORMAT


def check_index(index: dict[str, Any], where: str) -> None:
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(
            f"{where}: not a Megalith sharded checkpoint index (version {VERSION})"
        )
    if not isinstance(index.get("files"), dict) or not isinstance(index.get("tensors"), dict):
        raise CheckpointError(f"{where}: has no 'files' and 'tensors' tables")
    step = index.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: 'step' is {brief(step)}; expected a non-negative integer")
    for name, expected in index["files"].items():
        _safe_name(name, Path(where))
        check_file_entry(expected, f"{where}: files[{name!r}]")
    if STATE not in index["files"]:
        raise CheckpointError(f"{where}: does not list {STATE}")
    for name, meta in index["tensors"].items():
        check_cover(name, meta, where)
        parse_dtype(meta.get("dtype"), name)
        for shard in meta["shards"]:
            if _safe_name(shard.get("file"), Path(where)) not in index["files"]:
                raise CheckpointError(f"{where}: {name} names {shard['file']}, not listed")
            key = shard.get("key")
            if not isinstance(key, str) or len(key) > MAX_TENSOR_NAME + 16:
                raise CheckpointError(
                    f"{where}: a shard of {name} has no 'key' string (a tensor name)"
                )
