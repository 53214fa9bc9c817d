"""Sharded checkpoints (format v2): every rank writes its own boxes, any layout reads them.

One checkpoint (``CHECKPOINTS/step-00000100/``, a local directory or an fsspec URL such
as ``s3://bucket/run/checkpoints``)::

    model-r00003.safetensors      rank 3's boxes of the parameters it saves
    optimizer-r00003.safetensors  rank 3's boxes of the AdamW state it saves
    state.json                    step, consumed samples, config, layout, optimizer
                                  hyper-parameters, loss scaler, rank 0's RNG
    index.json                    written LAST (the commit): every file's size and
                                  sha256, every global tensor's shape, dtype and shards

``index.json``::

    {"format": "megalith-sharded-checkpoint", "version": 2, "step": N,
     "layout": {tp, pp, vpp, dp, cp, ep, data_parallel_mode, world},
     "files": {name: {"bytes": int, "sha256": hex}},
     "tensors": {global_name: {"shape": [...], "dtype": "float32",
                 "shards": [{"file": ..., "key": ..., "box": [[start, stop], ...]}]}}}

Global names are the single-process ``named_parameters`` names
(``layers.3.attention.qkv.linear.weight``) and
``optimizer/<param name>/exp_avg|exp_avg_sq|step``. Which boxes a rank holds comes from
:mod:`training.parallel.shard_specs`; a local tensor that is several boxes (SwiGLU's
fc1 under TP) is saved as ``key#0``, ``key#1``. Replicated boxes are written once.

Writing: :mod:`training.checkpoint.sharded_writer`; reading:
:mod:`training.checkpoint.sharded_reader`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megalith import safe_read
from megalith.errors import naming_path
from megalith.safe_read import brief
from megalith.storage import atomic_write_bytes, filesystem, is_local, join
from training.checkpoint.format import CheckpointError, restore_rng_state, step_dir_name

FORMAT = "megalith-sharded-checkpoint"
VERSION = 2
INDEX = "index.json"
STATE = "state.json"
LATEST = "latest.json"

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def rank_file(kind: str, rank: int) -> str:
    return f"{kind}-r{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def child_url(root: str | Path, *names: str) -> str:
    return join(str(root), *names)


def path_exists(url: str, storage_options: dict | None = None) -> bool:
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache()
    return fs.exists(path)


MAX_JSON_BYTES = 256 << 20  # index.json of a very large sharded checkpoint stays far below


def read_small_file(
    url: str, storage_options: dict | None = None, limit: int = MAX_JSON_BYTES
) -> bytes:
    """A small file's bytes: at most LIMIT, never through a symbolic link nor from a
    device or pipe (a ``state.json`` linked to /dev/zero is refused, not read)."""
    try:
        return safe_read.read_bytes_bounded(url, limit, storage_options, allow_symlink=False)
    except safe_read.UnsafeFileError as exc:
        raise CheckpointError(str(exc)) from None


def remove_tree(url: str, storage_options: dict | None = None) -> None:
    """Remove a checkpoint directory, its index first: a removal cut short leaves an
    incomplete directory (ignored, cleaned up later), never an index over missing files."""
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache()
    if not fs.exists(path):
        return
    index = child_url(url, INDEX)
    if path_exists(index, storage_options):
        filesystem(index, storage_options)[0].rm(filesystem(index, storage_options)[1])
    if is_local(url):
        shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
    else:
        fs.rm(path, recursive=True)


def discard_staging(staging: str, storage_options: dict | None = None) -> None:
    """Remove what a failed save wrote, so a full disk gets its space back at once.

    Best effort: it must never replace the save's own error. A staging folder that holds
    index.json on an object store is the committed checkpoint itself (no rename there),
    and stays."""
    try:
        if is_local(staging) or not path_exists(child_url(staging, INDEX), storage_options):
            remove_tree(staging, storage_options)
    except Exception as exc:  # the next save or resume removes it
        logger.warning("could not remove %s after a failed save: %s", staging, exc)


def step_entries(root: str, storage_options: dict | None = None) -> list[str]:
    """Names of the ``step-*`` entries directly under ROOT."""
    fs, path = filesystem(root, storage_options)
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    return [n for n in names if n.startswith("step-")]


def step_number(name: str) -> int | None:
    number = name.removeprefix("step-")
    return int(number) if number.isdigit() else None


def checkpoint_url(root: str | Path, step: int) -> str:
    """Where the checkpoint of STEP lives once committed."""
    return child_url(root, step_dir_name(step))


def as_location(url: str) -> Path | str:
    """A local checkpoint as a Path (what the trainer reports), a remote one as its URL."""
    return Path(url.removeprefix("file://")) if is_local(url) else url


_CHUNK = 64 << 20


class _HashingWriter:
    """Writes through to HANDLE, counting bytes and hashing them. Large writes go in
    64 MiB chunks, each hashed on a helper thread while it is written (both release the
    GIL), so hashing adds little to the write time."""

    def __init__(self, handle: Any, hasher: ThreadPoolExecutor):
        self.handle, self.bytes, self.digest = handle, 0, hashlib.sha256()
        self.hasher = hasher

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            chunk = view[start : start + _CHUNK]
            hashed = self.hasher.submit(self.digest.update, chunk)
            self.handle.write(chunk)
            hashed.result()  # in order: the next chunk is hashed after this one
        self.bytes += len(view)


def write_safetensors(url: str, tensors: dict[str, torch.Tensor], storage_options=None) -> dict:
    """Stream TENSORS (CPU) to URL in the safetensors format; returns {bytes, sha256}.

    Written here rather than with ``safetensors.torch.save`` so that the file is hashed
    as it is written and never held twice in memory."""
    header, offset = {}, 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    fs, path = filesystem(url, storage_options)
    with naming_path(path), ThreadPoolExecutor(1) as hasher, fs.open(path, "wb") as handle:
        out = _HashingWriter(handle, hasher)
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for tensor in tensors.values():
            if tensor.numel():
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                out.write(memoryview(data))
        if is_local(url):  # on disk before the index that commits it (power loss too)
            handle.flush()
            os.fsync(handle.fileno())
    return {"bytes": out.bytes, "sha256": out.digest.hexdigest()}


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def write_json(url: str, obj: Any, storage_options=None) -> dict:
    data = json_bytes(obj)
    atomic_write_bytes(url, data, storage_options)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rng_record() -> dict[str, Any]:
    """This process's Python, numpy and torch generator states as JSON; on CUDA the
    generator of this rank's own device. Every rank is seeded alike and draws alike, so
    rank 0's record is every rank's (its view of other devices' generators is not: they
    never advance in its process)."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    record = {
        "python": [version, list(internal), gauss],
        "numpy": {"pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "numpy_keys": [int(k) for k in keys],
        "torch_cpu": torch.get_rng_state().numpy().tobytes().hex(),
    }
    if torch.cuda.is_available():
        record["torch_cuda"] = torch.cuda.get_rng_state().numpy().tobytes().hex()
    return record


def restore_rng(record: dict[str, Any]) -> None:
    """Inverse of :func:`rng_record`: the CUDA state goes to this rank's current device."""
    try:
        tensors = {
            "torch_cpu": _bytes_tensor(record["torch_cpu"]),
            "numpy_keys": torch.tensor(record["numpy_keys"], dtype=torch.int64),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"state.json: 'rng' is not an RNG state this version writes: {brief(str(exc), 120)}"
        ) from None
    restore_rng_state(tensors, record)
    if torch.cuda.is_available() and isinstance(record.get("torch_cuda"), str):
        torch.cuda.set_rng_state(_bytes_tensor(record["torch_cuda"]))


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(text)), dtype=torch.uint8).clone()


def parse_dtype(name: str, key: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"index.json: tensor {key} has an unsupported dtype {brief(name)}")
    return dtype
