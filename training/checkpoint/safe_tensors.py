"""Checking a safetensors file's header ourselves, before the library reads it.

A safetensors file is ``u64 header length | JSON header | data``; the header names
every tensor's dtype, shape and ``[begin, end)`` byte range in the data. A crafted
header can claim a gigabyte-long header or tensors far larger than the file. Before
anything is allocated, :func:`check_safetensors` reads at most ``MAX_HEADER_BYTES``
of header and checks that:

- the header length fits the file and is at most ``MAX_HEADER_BYTES`` (100 MB, the
  limit of the safetensors library itself);
- every dtype is known and every shape a list of non-negative ints;
- every tensor's byte range lies inside the file's data and is exactly
  ``prod(shape) * itemsize`` long, and the ranges tile the data without overlap or gap.

So no tensor read afterwards can be larger than the file on disk, whose size the
loaders have already compared with the manifest. The result (names, shapes, dtypes)
lets loaders compare with the index/model before reading any tensor.
"""

from __future__ import annotations

import math
import stat
import struct
from pathlib import Path

from megalith.errors import MegalithError
from megalith.safe_read import UnsafeFileError, brief, loads_json

MAX_HEADER_BYTES = 100_000_000
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
# safetensors dtype -> torch dtype name as our indexes write it (str(dtype) minus "torch.").
TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "U16": "uint16", "I16": "int16", "F16": "float16",
    "BF16": "bfloat16", "U32": "uint32", "I32": "int32", "F32": "float32",
    "U64": "uint64", "I64": "int64", "F64": "float64",
}  # fmt: skip


class UnsafeTensorFileError(MegalithError):
    """A safetensors file whose header is malformed or claims more than the file holds."""


def check_safetensors(path: str | Path) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, torch dtype name)}`` of a safetensors file whose header is sound."""
    path = Path(path)
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read below forever
        raise UnsafeTensorFileError(f"{path}: not a regular file (a device, pipe or folder)")
    size = info.st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise UnsafeTensorFileError(f"{path}: {size} bytes, too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise UnsafeTensorFileError(
                f"{path}: header length field claims {length} bytes; the file has {size} and "
                f"headers are limited to {MAX_HEADER_BYTES}"
            )
        raw = handle.read(length)
    try:  # bounded nesting: a 100k-deep header is a RecursionError in json.loads
        header = loads_json(raw, f"{path}: header", allow_nan=False)  # as safetensors reads it
    except UnsafeFileError as exc:
        raise UnsafeTensorFileError(str(exc)) from None
    if not isinstance(header, dict):
        raise UnsafeTensorFileError(f"{path}: header is not a JSON object")
    _check_metadata(path, header.pop("__metadata__", None))
    return _check_entries(path, header, data_bytes=size - 8 - length)


def _check_metadata(path: Path, metadata: object) -> None:
    """``__metadata__`` maps strings to strings, as the safetensors loader insists: a file
    ``ckpt verify`` passes must also load."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(
        isinstance(value, str) for value in metadata.values()
    ):
        raise UnsafeTensorFileError(
            f"{path}: __metadata__ is {brief(metadata)}; expected an object of strings"
        )


def _check_entries(path: Path, header: dict, data_bytes: int) -> dict[str, tuple[list[int], str]]:
    found, ranges = {}, []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise UnsafeTensorFileError(f"{path}: tensor {brief(name)}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise UnsafeTensorFileError(
                f"{path}: tensor {brief(name)}: unknown dtype {brief(dtype)}"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise UnsafeTensorFileError(f"{path}: tensor {brief(name)}: bad shape {brief(shape)}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise UnsafeTensorFileError(
                f"{path}: tensor {brief(name)}: data_offsets {brief(offsets)} lie outside the file's "
                f"{data_bytes} data bytes"
            )
        claimed = math.prod(shape) * ITEMSIZE[dtype]
        if claimed != offsets[1] - offsets[0]:
            raise UnsafeTensorFileError(
                f"{path}: tensor {brief(name)}: shape {shape} {dtype} needs {claimed} bytes, its "
                f"data_offsets hold {offsets[1] - offsets[0]}"
            )
        found[name] = (shape, TORCH_NAMES[dtype])
        ranges.append(offsets)
    position = 0
    for begin, end in sorted(ranges):
        if begin != position:
            raise UnsafeTensorFileError(
                f"{path}: tensor data overlaps or leaves a gap at byte {position}"
            )
        position = end
    if position != data_bytes:
        raise UnsafeTensorFileError(
            f"{path}: tensors cover {position} of the file's {data_bytes} data bytes"
        )
    return found
