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

Saving (:class:`training.checkpoint.async_save.Checkpointer`): the caller's thread copies
this rank's boxes to host memory (pinned buffers reused across saves on CUDA), then a
background thread (or the caller, without ``checkpoint.async_save``) writes
the rank's files, hashing as it writes, and a small ``rank-00003.json`` manifest. After
a barrier (a dedicated gloo group, never the training one) rank 0 merges the manifests
and writes ``index.json`` last. Local disk: all of it goes to ``step-XXXXXXXX.tmp/``,
renamed into place after the index; object stores: no rename, a directory without
``index.json`` does not count. ``latest.json`` is replaced after the commit, then old
checkpoints are pruned and incomplete directories removed. A kill at any moment leaves
the previous checkpoint complete.

Loading (:func:`load_sharded_checkpoint`): each rank computes its specs in the current
layout and reads only the overlapping parts of the saved boxes
(``safe_open(...).get_slice(key)[...]``), from only the files it needs, each checked
against its size and sha256 first; names, shapes, dtypes and the boxes' exact cover of
every needed tensor are checked before anything is copied.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import random
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from megalith import safe_read
from megalith.errors import naming_path
from megalith.safe_read import brief
from megalith.storage import atomic_write_bytes, filesystem, is_local, join
from training.checkpoint.format import (
    MAX_TENSOR_NAME,
    CheckpointError,
    _is_persistent,
    _safe_name,
    check_file_entry,
    check_state,
    check_step,
    optimizer_group_indices,
    read_checkpoint_tensors,
    read_latest_pointer,
    restore_rng_state,
    saved_param_groups,
    step_dir_name,
    verify_checkpoint_state,
)
from training.checkpoint.safe_tensors import UnsafeTensorFileError, check_safetensors
from training.checkpoint.signing import (
    SIGNATURE_FILE,
    SignatureError,
    check_signature_bytes,
    parse_signature,
    should_sign,
    signature_record,
)
from training.parallel.dtensor import local_tensor
from training.parallel.groups import ParallelState
from training.parallel.shard_specs import (
    MOMENTS,
    OPTIMIZER_PREFIX,
    ShardSpec,
    holds_state,
    model_specs,
    optimizer_key,
    optimizer_specs,
    reshard_fsdp,
    whole_piece,
)

FORMAT = "megalith-sharded-checkpoint"
VERSION = 2
INDEX = "index.json"
STATE = "state.json"
LATEST = "latest.json"

logger = logging.getLogger(__name__)

_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def rank_file(kind: str, rank: int) -> str:
    return f"{kind}-r{rank:05d}.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- locations


def _url(root: str | Path, *names: str) -> str:
    return join(str(root), *names)


def _exists(url: str, storage_options: dict | None = None) -> bool:
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache()
    return fs.exists(path)


MAX_JSON_BYTES = 256 << 20  # index.json of a very large sharded checkpoint stays far below


def _read_bytes(
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
    index = _url(url, INDEX)
    if _exists(index, storage_options):
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
        if is_local(staging) or not _exists(_url(staging, INDEX), storage_options):
            remove_tree(staging, storage_options)
    except Exception as exc:  # the next save or resume removes it
        logger.warning("could not remove %s after a failed save: %s", staging, exc)


def _step_entries(root: str, storage_options: dict | None = None) -> list[str]:
    """Names of the ``step-*`` entries directly under ROOT."""
    fs, path = filesystem(root, storage_options)
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    return [n for n in names if n.startswith("step-")]


def _step_number(name: str) -> int | None:
    number = name.removeprefix("step-")
    return int(number) if number.isdigit() else None


def checkpoint_url(root: str | Path, step: int) -> str:
    """Where the checkpoint of STEP lives once committed."""
    return _url(root, step_dir_name(step))


def as_location(url: str) -> Path | str:
    """A local checkpoint as a Path (what the trainer reports), a remote one as its URL."""
    return Path(url.removeprefix("file://")) if is_local(url) else url


# --------------------------------------------------------------------------- writing files


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
            "dtype": _DTYPES[tensor.dtype],
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


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _write_json(url: str, obj: Any, storage_options=None) -> dict:
    data = _json_bytes(obj)
    atomic_write_bytes(url, data, storage_options)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# --------------------------------------------------------------------------- snapshot


@dataclass
class Snapshot:
    """This rank's part of one checkpoint, in host memory: what the writer thread writes."""

    root: str
    step: int
    rank: int
    world: int
    files: dict[str, dict[str, torch.Tensor]]  # file name -> {key: tensor}
    tensors: dict[str, dict[str, Any]]  # global name -> {shape, dtype, shards}
    state: dict[str, Any] | None  # state.json, rank 0 only
    layout: dict[str, Any]
    keep_last: int
    blocked_s: float = 0.0
    sign: bool = False  # write signature.json (resolved on the training thread)


class HostBuffers:
    """Host copies of the boxes, reused from one save to the next (pinned on CUDA)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._in_flight = False  # asynchronous device-to-host copies queued

    def copy(self, key: str, source: torch.Tensor) -> torch.Tensor:
        if source.device.type != "cuda":
            return source.detach().to("cpu", copy=True).contiguous()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            self._buffers[key] = buffer
        buffer.copy_(source.detach(), non_blocking=True)
        self._in_flight = True
        return buffer

    def synchronize(self) -> None:
        """Wait for the queued copies (one synchronisation per save)."""
        if self._in_flight:
            torch.cuda.synchronize()
            self._in_flight = False


def _add_boxes(
    files: dict[str, dict[str, torch.Tensor]],
    tensors: dict[str, dict[str, Any]],
    file: str,
    spec: ShardSpec,
    local: torch.Tensor,
    buffers: HostBuffers,
) -> None:
    if not spec.writes or not spec.pieces:
        return
    many = len(spec.pieces) > 1
    entry = tensors.setdefault(
        spec.name, {"shape": list(spec.shape), "dtype": _dtype_name(local.dtype), "shards": []}
    )
    for number, piece in enumerate(spec.pieces):
        key = f"{spec.name}#{number}" if many else spec.name
        files.setdefault(file, {})[key] = buffers.copy(f"{file}/{key}", local[piece.local])
        entry["shards"].append({"file": file, "key": key, "box": [list(b) for b in piece.box]})


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


def index_layout(state: ParallelState, data_parallel_mode: str) -> dict[str, Any]:
    s = state.sizes
    return {
        "tp": s.tp, "pp": s.pp, "vpp": s.vpp, "dp": s.dp, "cp": s.cp, "ep": s.ep,
        "data_parallel_mode": data_parallel_mode, "world": s.world,
    }  # fmt: skip


def _refuse_persistent_buffers(model: nn.Module) -> None:
    """The models have none (RoPE tables are rebuilt); one added later must be saved."""
    buffers = [n for n, _ in model.named_buffers() if _is_persistent(model, n)]
    if buffers:
        raise CheckpointError(
            f"persistent buffers {buffers[:3]} would not be saved: sharded checkpoints hold "
            "parameters and optimizer state only"
        )


@dataclass
class SaveRequest:
    """What one save of a training state needs: :meth:`Checkpointer.save
    <training.checkpoint.async_save.Checkpointer.save>` snapshots it with
    :func:`take_snapshot`, then writes and commits the snapshot."""

    root: str
    step: int
    model: nn.Module
    optimizer: Any
    param_names: list[str]
    state: dict[str, Any]  # consumed samples, config, layout: state.json beside step and RNG
    parallel: ParallelState
    data_parallel_mode: str
    scaler: torch.amp.GradScaler | None = None
    keep_last: int = 3
    owner_stage: Callable[[str], int] | None = None  # pipeline: the stage owning a parameter
    sign: bool | None = None


def take_snapshot(request: SaveRequest, buffers: HostBuffers) -> Snapshot:
    """Copy this rank's boxes to host memory (the only part a training loop waits for)."""
    started = time.perf_counter()
    root, step, model, optimizer = request.root, request.step, request.model, request.optimizer
    param_names, state, parallel = request.param_names, request.state, request.parallel
    scaler, owner_stage = request.scaler, request.owner_stage
    _refuse_persistent_buffers(model)
    reshard_fsdp(model)
    params = model_specs(model, parallel, owner_stage)
    rank = parallel.rank
    files: dict[str, dict[str, torch.Tensor]] = {}
    tensors: dict[str, dict[str, Any]] = {}
    named = dict(model.named_parameters())
    for name, spec in params.items():
        _add_boxes(
            files, tensors, rank_file("model", rank), spec, local_tensor(named[name]), buffers
        )
    by_name = {n: named[n] for n in param_names}
    for key, spec in optimizer_specs(
        optimizer, model, param_names, params, parallel, owner_stage
    ).items():
        name, _, state_key = key.removeprefix(OPTIMIZER_PREFIX).rpartition("/")
        values = optimizer.state.get(by_name[name])
        if not values:
            continue  # no step taken yet: nothing to save
        value = values[state_key]
        value = value.float() if torch.is_tensor(value) and value.dim() == 0 else value
        value = value if torch.is_tensor(value) else torch.tensor(float(value))
        _add_boxes(files, tensors, rank_file("optimizer", rank), spec, local_tensor(value), buffers)
    buffers.synchronize()
    record = None
    if rank == 0:
        record = {
            **state,
            "step": step,
            "optimizer": {
                "param_groups": [
                    {
                        k: (list(v) if isinstance(v, tuple) else v)
                        for k, v in g.items()
                        if k != "params"
                    }
                    for g in optimizer.param_groups
                ],
            },
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "rng": rng_record(),
        }
    return Snapshot(
        root=str(root),
        step=step,
        rank=rank,
        world=parallel.world_size,
        files=files,
        tensors=tensors,
        state=record,
        layout=index_layout(parallel, request.data_parallel_mode),
        keep_last=request.keep_last,
        blocked_s=time.perf_counter() - started,
        sign=_signing_ready(request.sign),
    )


# --------------------------------------------------------------------------- commit


def staging_url(root: str, step: int) -> str:
    """Where a save writes: ``step-X.tmp`` on local disk (renamed after), else ``step-X``."""
    name = step_dir_name(step)
    return _url(root, f"{name}.tmp" if is_local(root) else name)


def write_rank_files(snapshot: Snapshot, staging: str, storage_options=None) -> None:
    """This rank's tensor files and its manifest ``rank-XXXXX.json`` (state.json on rank 0)."""
    with ThreadPoolExecutor(max(1, len(snapshot.files))) as pool:  # model and optimizer at once
        written = {
            name: pool.submit(write_safetensors, _url(staging, name), content, storage_options)
            for name, content in snapshot.files.items()
        }
        files = {name: future.result() for name, future in written.items()}
    if snapshot.state is not None:
        files[STATE] = _write_json(_url(staging, STATE), snapshot.state, storage_options)
    manifest = {"rank": snapshot.rank, "files": files, "tensors": snapshot.tensors}
    _write_json(_url(staging, f"rank-{snapshot.rank:05d}.json"), manifest, storage_options)


def commit(snapshot: Snapshot, staging: str, storage_options=None) -> str:
    """Rank 0, after every rank wrote: merge the manifests, write index.json last, move
    into place (local), point latest.json at it, prune. Returns the checkpoint's URL."""
    files: dict[str, dict] = {}
    tensors: dict[str, dict] = {}
    for rank in range(snapshot.world):
        url = _url(staging, f"rank-{rank:05d}.json")
        manifest = json.loads(_read_bytes(url, storage_options))
        files.update(manifest["files"])
        for name, entry in manifest["tensors"].items():
            merged = tensors.setdefault(name, {**entry, "shards": []})
            if merged["shape"] != entry["shape"] or merged["dtype"] != entry["dtype"]:
                raise CheckpointError(
                    f"{staging}: ranks disagree on {name}: {merged['shape']} {merged['dtype']} "
                    f"vs {entry['shape']} {entry['dtype']} (rank {rank})"
                )
            merged["shards"] += entry["shards"]
    for name, entry in tensors.items():
        check_cover(name, entry, staging)
    for rank in range(snapshot.world):
        fs, path = filesystem(_url(staging, f"rank-{rank:05d}.json"), storage_options)
        fs.rm(path)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "step": snapshot.step,
        "layout": snapshot.layout,
        "files": dict(sorted(files.items())),
        "tensors": dict(sorted(tensors.items())),
    }
    data = _json_bytes(index)
    if snapshot.sign:  # before the index: a committed index is never unsigned
        _write_json(_url(staging, SIGNATURE_FILE), signature_record(INDEX, data), storage_options)
    atomic_write_bytes(_url(staging, INDEX), data, storage_options)
    root, name = snapshot.root, step_dir_name(snapshot.step)
    final = _url(root, name)
    if is_local(root):
        remove_tree(final)
        os.replace(staging.removeprefix("file://"), final.removeprefix("file://"))
    _write_json(_url(root, LATEST), {"step": snapshot.step, "path": name}, storage_options)
    prune(root, snapshot.step, snapshot.keep_last, storage_options)
    return final


def prune(root: str, step: int, keep_last: int, storage_options=None) -> None:
    """Keep the newest ``keep_last`` complete checkpoints up to ``step``; remove every
    incomplete one (a save that was killed). Later complete ones are left alone, as v1."""
    complete = {}
    for name in _step_entries(root, storage_options):
        url = _url(root, name)
        number = _step_number(name)
        if number is None or not _exists(_url(url, INDEX), storage_options):
            remove_tree(url, storage_options)  # a .tmp or an uncommitted directory
        elif number <= step:
            complete[number] = url
    for old in sorted(complete)[:-keep_last]:
        remove_tree(complete[old], storage_options)


def _overlap(first: Any, second: Any) -> list[tuple[int, int]] | None:
    """The intersection of two boxes, None when empty."""
    both = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(first, second, strict=True)]
    return None if any(lo >= hi for lo, hi in both) else both


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


# --------------------------------------------------------------------------- reading


def latest_sharded_checkpoint(root: str | Path, storage_options=None) -> str | None:
    """The checkpoint latest.json names, if committed (index.json present); else the
    newest committed one (a kill between the commit and latest.json). v1 ones count too.
    A pointer whose step and folder disagree, or a step folder that is a symbolic link,
    is refused."""
    root = str(root)
    pointer = _url(root, LATEST)
    if _exists(pointer, storage_options):
        _, name = read_latest_pointer(pointer, _read_bytes(pointer, storage_options, 64 << 10))
        url = _url(root, name)
        _refuse_linked_step(url)
        if _exists(_url(url, INDEX), storage_options):
            return url
    complete = [
        (number, name)
        for name in _step_entries(root, storage_options)
        if (number := _step_number(name)) is not None
        and _exists(_url(root, name, INDEX), storage_options)
    ]
    if not complete:
        return None
    url = _url(root, max(complete)[1])
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
    url = _url(str(path), INDEX)
    try:
        data = _read_bytes(url, storage_options)
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
    check_index(index, _url(str(path), INDEX))
    check_step(path, index["step"])
    return index


def _signing_ready(sign: bool | None) -> bool:
    """Whether to sign; a key that is asked for but missing or unusable is an error now,
    on the training thread, not after the files are written."""
    if not should_sign(sign):
        return False
    signature_record(INDEX, b"")  # reads and checks the key
    return True


def _check_signature(path: str, index: bytes, required: bool, storage_options=None) -> None:
    url = _url(path, SIGNATURE_FILE)
    try:
        raw = _read_bytes(url, storage_options) if _exists(url, storage_options) else None
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
        _dtype(meta.get("dtype"), name)
        for shard in meta["shards"]:
            if _safe_name(shard.get("file"), Path(where)) not in index["files"]:
                raise CheckpointError(f"{where}: {name} names {shard['file']}, not listed")
            key = shard.get("key")
            if not isinstance(key, str) or len(key) > MAX_TENSOR_NAME + 16:
                raise CheckpointError(
                    f"{where}: a shard of {name} has no 'key' string (a tensor name)"
                )


class ShardReader:
    """Opens the files of one v2 checkpoint, each verified against index.json first
    (remote files are fetched to a temporary directory while being hashed)."""

    def __init__(self, path: str | Path, index: dict[str, Any], storage_options=None):
        self.root, self.index, self.options = str(path), index, storage_options
        self._local: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._fds: list[int] = []  # descriptors the verified local files are read through
        self.stats: dict[str, Any] = {"files": [], "reads": [], "bytes": 0}

    def verified(self, name: str) -> str:
        """A local path to file NAME, checked against its size and sha256."""
        if name in self._local:
            return self._local[name]
        where = _url(self.root, INDEX)
        expected = self.index["files"].get(_safe_name(name, Path(where)))
        if expected is None:
            raise CheckpointError(f"{where}: a shard names {name}, which the index does not list")
        url = _url(self.root, name)
        if is_local(url):
            local = url.removeprefix("file://")
            if os.path.islink(local):
                raise CheckpointError(
                    f"{local}: a symbolic link; checkpoint files must be regular files"
                )
            if not os.path.exists(local):
                raise CheckpointError(f"{local}: missing (listed in index.json)")
            if not os.path.isfile(local):
                raise CheckpointError(f"{local}: not a regular file (a device, pipe or folder)")
            local, size, digest = self._open_pinned(local, expected["bytes"])
        else:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="megalith-ckpt-")
            local = os.path.join(self._tmp.name, name)
            fs, remote = filesystem(url, self.options)
            try:
                source = fs.open(remote, "rb")
            except FileNotFoundError:
                raise CheckpointError(f"{url}: missing (listed in index.json)") from None
            with open(local, "wb") as copy:
                digest = _sha256(source, expected["bytes"], copy)
            size = os.path.getsize(local)
        if size != expected["bytes"]:
            raise CheckpointError(f"{url}: {size} bytes, index.json says {expected['bytes']}")
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"{url}: sha256 does not match index.json (modified or corrupted)"
            )
        self._local[name] = local
        self.stats["files"].append(name)
        return local

    def json(self, name: str) -> dict[str, Any]:
        """A JSON object file of the checkpoint, parsed from its verified bytes."""
        where = _url(self.root, name)
        with open(self.verified(name), "rb") as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
        try:
            value = safe_read.loads_json(data, where)
        except safe_read.UnsafeFileError as exc:
            raise CheckpointError(str(exc)) from None
        if not isinstance(value, dict) or len(data) > MAX_JSON_BYTES:
            raise CheckpointError(
                f"{where}: expected a JSON object of at most {MAX_JSON_BYTES} bytes"
            )
        return value

    def handle(self, name: str) -> Any:
        if name not in self._handles:
            local = self.verified(name)
            try:
                check_safetensors(local)  # bounded header, data ranges inside the file
            except UnsafeTensorFileError as exc:  # named by the file, not the descriptor
                raise CheckpointError(str(exc).replace(local, _url(self.root, name))) from None
            self._handles[name] = safe_open(local, framework="pt")
        return self._handles[name]

    def read(self, shard: dict[str, Any], region: tuple[slice, ...], meta: dict) -> torch.Tensor:
        """Part REGION (relative to the shard's box) of one saved shard."""
        part = self.check_shard(shard, meta)
        handle, key = self.handle(shard["file"]), shard["key"]
        shape = [b - a for a, b in shard["box"]]
        tensor = handle.get_tensor(key) if not shape else part[region]
        self.stats["reads"].append({"file": shard["file"], "key": key, "box": shard["box"]})
        self.stats["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    def check_shard(self, shard: dict[str, Any], meta: dict) -> Any:
        """The lazy slice of one saved shard, whose shape and dtype match the index."""
        handle = self.handle(shard["file"])
        key = shard["key"]
        if key not in handle.keys():  # noqa: SIM118 - safe_open handles are not containers
            raise CheckpointError(f"{_url(self.root, shard['file'])}: has no tensor {key}")
        part = handle.get_slice(key)
        shape = [b - a for a, b in shard["box"]]
        if list(part.get_shape()) != shape or part.get_dtype() != _DTYPES.get(
            _dtype(meta["dtype"], key)
        ):
            raise CheckpointError(
                f"{_url(self.root, shard['file'])}: tensor {key} is {part.get_shape()} "
                f"{part.get_dtype()}, index.json says {shape} {meta['dtype']}"
            )
        return part

    def _open_pinned(self, path: str, limit: int) -> tuple[str, int, str]:
        """Open PATH once (no symlink), hash it through that descriptor and read it back
        through ``/proc/self/fd`` (Linux): a file swapped for another after hashing is
        never the one read. (Writes into the same file by its owner are outside this.)"""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        self._fds.append(fd)
        with os.fdopen(os.dup(fd), "rb") as handle:
            digest = _sha256(handle, limit)
        pinned = f"/proc/self/fd/{fd}"
        return (pinned if os.path.exists(pinned) else path), os.fstat(fd).st_size, digest

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _dtype(name: str, key: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        raise CheckpointError(f"index.json: tensor {key} has an unsupported dtype {brief(name)}")
    return dtype


def _sha256(source: Any, limit: int, copy: Any = None) -> str:
    """Hash SOURCE (closing it), reading at most LIMIT + 1 bytes: a bigger file fails the
    size check without being read to its end."""
    digest, read = hashlib.sha256(), 0
    with source:
        while read <= limit and (chunk := source.read(min(8 << 20, limit + 1 - read))):
            digest.update(chunk)
            read += len(chunk)
            if copy is not None:
                copy.write(chunk)
    return digest.hexdigest()


def _plan(
    specs: dict[str, ShardSpec], targets: dict[str, torch.Tensor], index: dict, where: str
) -> list[tuple[ShardSpec, torch.Tensor, dict]]:
    """Check every needed tensor against the index before anything is read."""
    plan, checked = [], set()
    for local_name, spec in specs.items():
        meta = index["tensors"].get(spec.name)
        if meta is None:
            raise CheckpointError(f"{where}: has no tensor {spec.name}, which the model needs")
        if list(meta.get("shape", [])) != list(spec.shape):
            raise CheckpointError(
                f"{where}: {spec.name} has shape {meta.get('shape')}, the model expects {list(spec.shape)}"
            )
        _dtype(meta.get("dtype"), spec.name)
        if spec.name not in checked:
            check_cover(spec.name, meta, where)
            checked.add(spec.name)
        for shard in meta["shards"]:
            _safe_name(shard.get("file"), Path(where))
        plan.append((spec, targets[local_name], meta))
    return plan


def _fill(reader: ShardReader, spec: ShardSpec, target: torch.Tensor, meta: dict) -> None:
    """Copy the overlap of every saved shard with every piece of SPEC into TARGET."""
    for piece in spec.pieces:
        covered = 0
        for shard in meta["shards"]:
            overlap = _overlap(piece.box, shard["box"])
            if overlap is None:
                continue
            source = _relative(overlap, shard["box"])
            dest = _relative(overlap, piece.box)
            target[piece.local][dest].copy_(reader.read(shard, source, meta))
            covered += math.prod(hi - lo for lo, hi in overlap)
        if covered != math.prod(b - a for a, b in piece.box):
            raise CheckpointError(
                f"{reader.root}: the shards of {spec.name} do not cover box {piece.box}"
            )


def _relative(region: list[tuple[int, int]], box: Any) -> tuple[slice, ...]:
    """REGION (global coordinates) as slices of a tensor holding BOX."""
    return tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(region, box, strict=True))


def _empty_optimizer_state(
    optimizer: Any, named: dict[str, torch.Tensor], param_names: list[str]
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """AdamW state to fill, for the parameters this rank keeps state of (in the
    parameter's layout: a DTensor under FSDP), and its local tensors by global name."""
    per_param, targets = {}, {}
    for position, name in enumerate(param_names):
        if not holds_state(optimizer, position):
            continue
        values = {key: torch.zeros_like(named[name]) for key in MOMENTS}
        values["step"] = torch.zeros((), dtype=torch.float32)
        per_param[position] = values
        for key, value in values.items():
            targets[optimizer_key(name, key)] = local_tensor(value)
    return per_param, targets


def load_sharded_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Any,
    param_names: list[str],
    parallel: ParallelState,
    scaler: torch.amp.GradScaler | None = None,
    owner_stage: Callable[[str], int] | None = None,
    restore_rng_state: bool = True,
    storage_options=None,
    stats: dict[str, Any] | None = None,
    require_signature: bool = False,
) -> dict[str, Any]:
    """Load this rank's part of a v2 checkpoint saved in any layout; returns state.json.

    ``stats`` (optional) receives the files this rank opened and the shards it read."""
    path = str(path)
    where = _url(path, INDEX)
    index = open_index(path, storage_options, require_signature)
    reader = ShardReader(path, index, storage_options)
    try:
        state = read_state(reader)
        reshard_fsdp(model)
        params = model_specs(model, parallel, owner_stage)
        named = dict(model.named_parameters())
        model_plan = _plan(params, {n: local_tensor(p) for n, p in named.items()}, index, where)
        opt_plan, per_param = [], {}
        has_optimizer = any(name.startswith(OPTIMIZER_PREFIX) for name in index["tensors"])
        if optimizer is not None and has_optimizer:
            specs = optimizer_specs(optimizer, model, param_names, params, parallel, owner_stage)
            per_param, targets = _empty_optimizer_state(optimizer, named, param_names)
            opt_plan = _plan(specs, targets, index, where)
        # Every check before the first copy, so a refused checkpoint leaves the model as
        # it was: each needed file's sha256 and header, each shard's key, shape and dtype.
        for spec, _, meta in model_plan + opt_plan:
            for shard in meta["shards"]:
                if any(_overlap(p.box, shard["box"]) is not None for p in spec.pieces):
                    reader.check_shard(shard, meta)
        saved_groups = None
        if optimizer is not None:
            saved_groups = saved_param_groups(state, optimizer, _url(path, STATE))
        with torch.no_grad():
            for spec, target, meta in model_plan + opt_plan:
                _fill(reader, spec, target, meta)
        if optimizer is not None:
            groups = [
                {**saved, "params": indices}
                for saved, indices in zip(
                    saved_groups, optimizer_group_indices(optimizer), strict=True
                )
            ]
            optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    finally:
        if stats is not None:
            stats.update(reader.stats)
        reader.close()
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if restore_rng_state:
        restore_rng(state["rng"])
    return state


# --------------------------------------------------------------------------- tools


def verify_sharded_checkpoint(
    path: str | Path, storage_options=None, require_signature: bool = False
) -> dict[str, Any]:
    """Check the signature (when present and a key is set, or required), every file of a
    v2 checkpoint against index.json (size, sha256, bounded safetensors header), every
    tensor's shards (inside the shape, no overlap, full cover) and the step; returns the
    index."""
    index = open_index(path, storage_options, require_signature)
    reader = ShardReader(path, index, storage_options)
    try:
        for name in index["files"]:
            reader.verified(name)
            if name.endswith(".safetensors"):
                reader.handle(name)  # header bounded and parsed
        read_state(reader)
        for meta in index["tensors"].values():
            for shard in meta["shards"]:
                reader.check_shard(shard, meta)
    finally:
        reader.close()
    return index


def read_state(reader: ShardReader) -> dict[str, Any]:
    """state.json from its verified bytes; its step must be the index's."""
    state = reader.json(STATE)
    check_state(state, _url(reader.root, STATE))
    if state.get("step") != reader.index["step"]:
        raise CheckpointError(
            f"{_url(reader.root, STATE)}: step {brief(state.get('step'))}, index.json says "
            f"{reader.index['step']}"
        )
    return state


def read_global_tensor(
    path: str | Path,
    name: str,
    index: dict[str, Any] | None = None,
    storage_options=None,
    require_signature: bool = False,
) -> torch.Tensor:
    """The whole global tensor NAME of a v2 checkpoint, assembled from its shards.
    ``index``: one :func:`open_index` already returned for PATH."""
    index = index or open_index(path, storage_options, require_signature)
    reader = ShardReader(path, index, storage_options)
    try:
        return read_whole(reader, name)
    finally:
        reader.close()


def read_global_tensors(
    path: str | Path, storage_options=None, require_signature: bool = False
) -> dict[str, torch.Tensor]:
    """Every global tensor of a v2 checkpoint (tools, tests; each file verified once)."""
    index = open_index(path, storage_options, require_signature)
    reader = ShardReader(path, index, storage_options)
    try:
        return {name: read_whole(reader, name) for name in index["tensors"]}
    finally:
        reader.close()


def read_model_weights(
    path: str | Path, require_signature: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model tensors (no optimizer state, no buffers) and state.json of a v1 or
    v2 checkpoint step folder, through the verified path of its format."""
    if is_sharded(read_index(path)):
        index = open_index(path, require_signature=require_signature)
        reader = ShardReader(path, index)
        try:
            state = read_state(reader)
            names = [n for n in index["tensors"] if not n.startswith(OPTIMIZER_PREFIX)]
            return {name: read_whole(reader, name) for name in names}, state
        finally:
            reader.close()
    index, state = verify_checkpoint_state(path, require_signature)
    tensors = read_checkpoint_tensors(Path(path) / "model.safetensors", index)
    return {n: t for n, t in tensors.items() if not n.startswith("buffer/")}, state


def read_whole(reader: ShardReader, name: str) -> torch.Tensor:
    """Verify the files holding NAME, bound its size by theirs, then allocate and fill it."""
    where = _url(reader.root, INDEX)
    meta = reader.index["tensors"].get(name)
    if meta is None:
        raise CheckpointError(f"{where}: has no tensor {name}")
    check_cover(name, meta, where)
    dtype = _dtype(meta["dtype"], name)
    files = {shard["file"] for shard in meta["shards"]}
    available = sum(os.path.getsize(reader.verified(file)) for file in files)
    needed = math.prod(meta["shape"]) * dtype.itemsize
    if needed > available:
        raise CheckpointError(
            f"{where}: tensor {name} claims {needed} bytes, its files hold {available}"
        )
    whole = torch.empty(meta["shape"], dtype=dtype)
    spec = ShardSpec(name, tuple(meta["shape"]), (whole_piece(meta["shape"]),), False)
    _fill(reader, spec, whole, meta)
    return whole
