"""Reading a sharded checkpoint in any layout (the format:
:mod:`training.checkpoint.sharded_files`).

Loading (:func:`load_sharded_checkpoint`): each rank computes its specs in the current
layout and reads only the overlapping parts of the saved boxes
(``safe_open(...).get_slice(key)[...]``), from only the files it needs, each checked
against its size and sha256 first; names, shapes, dtypes and the boxes' exact cover of
every needed tensor are checked before anything is copied.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from megalith import safe_read
from megalith.safe_read import brief
from megalith.storage import filesystem, is_local
from training.checkpoint.format import (
    CheckpointError,
    _safe_name,
    check_state,
    optimizer_group_indices,
    read_checkpoint_tensors,
    saved_param_groups,
    verify_checkpoint_state,
)
from training.checkpoint.safe_tensors import UnsafeTensorFileError, check_safetensors
from training.checkpoint.sharded_files import (
    INDEX,
    MAX_JSON_BYTES,
    SAFETENSORS_DTYPES,
    STATE,
    child_url,
    parse_dtype,
    restore_rng,
)
from training.checkpoint.sharded_index import check_cover, is_sharded, open_index, read_index
from training.parallel.dtensor import local_tensor
from training.parallel.groups import ParallelState
from training.parallel.shard_specs import (
    MOMENTS,
    OPTIMIZER_PREFIX,
    Piece,
    ShardSpec,
    holds_state,
    model_specs,
    optimizer_key,
    optimizer_specs,
    reshard_fsdp,
)


def _overlap(first: Any, second: Any) -> list[tuple[int, int]] | None:
    """The intersection of two boxes, None when empty."""
    both = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(first, second, strict=True)]
    return None if any(lo >= hi for lo, hi in both) else both


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
        where = child_url(self.root, INDEX)
        expected = self.index["files"].get(_safe_name(name, Path(where)))
        if expected is None:
            raise CheckpointError(f"{where}: a shard names {name}, which the index does not list")
        url = child_url(self.root, name)
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
        where = child_url(self.root, name)
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
                raise CheckpointError(str(exc).replace(local, child_url(self.root, name))) from None
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
            raise CheckpointError(f"{child_url(self.root, shard['file'])}: has no tensor {key}")
        part = handle.get_slice(key)
        shape = [b - a for a, b in shard["box"]]
        if list(part.get_shape()) != shape or part.get_dtype() != SAFETENSORS_DTYPES.get(
            parse_dtype(meta["dtype"], key)
        ):
            raise CheckpointError(
                f"{child_url(self.root, shard['file'])}: tensor {key} is {part.get_shape()} "
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
        parse_dtype(meta.get("dtype"), spec.name)
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
    where = child_url(path, INDEX)
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
            saved_groups = saved_param_groups(state, optimizer, child_url(path, STATE))
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
    check_state(state, child_url(reader.root, STATE))
    if state.get("step") != reader.index["step"]:
        raise CheckpointError(
            f"{child_url(reader.root, STATE)}: step {brief(state.get('step'))}, index.json says "
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
    reader, state = open_model_weights(path, require_signature)
    if isinstance(reader, dict):
        return reader, state
    try:
        return {name: read_whole(reader, name) for name in model_weight_names(reader)}, state
    finally:
        reader.close()


def open_model_weights(
    path: str | Path, require_signature: bool = False
) -> tuple[ShardReader | dict[str, torch.Tensor], dict[str, Any]]:
    """A v2 checkpoint's open :class:`ShardReader` and state.json, every file holding
    model weights verified up front (signature, size, sha256 streamed, safetensors
    header, each shard's key, shape and dtype, each tensor's cover) but no tensor read,
    so :func:`read_box` reads any box later; a v1 checkpoint (one file) gives its model
    tensors whole instead."""
    if is_sharded(read_index(path)):
        index = open_index(path, require_signature=require_signature)
        reader = ShardReader(path, index)
        try:
            state = read_state(reader)
            where = child_url(reader.root, INDEX)
            for name in model_weight_names(reader):
                meta = index["tensors"][name]
                check_cover(name, meta, where)
                for shard in meta["shards"]:
                    reader.check_shard(shard, meta)
            return reader, state
        except BaseException:
            reader.close()
            raise
    index, state = verify_checkpoint_state(path, require_signature)
    tensors = read_checkpoint_tensors(Path(path) / "model.safetensors", index)
    return {n: t for n, t in tensors.items() if not n.startswith("buffer/")}, state


def model_weight_names(reader: ShardReader) -> list[str]:
    """The model tensors' names in a v2 checkpoint (not its optimizer state)."""
    return [n for n in reader.index["tensors"] if not n.startswith(OPTIMIZER_PREFIX)]


def read_whole(reader: ShardReader, name: str) -> torch.Tensor:
    """Verify the files holding NAME, bound its size by theirs, then allocate and fill it."""
    return read_box(reader, name)


def read_box(
    reader: ShardReader, name: str, box: tuple[tuple[int, int], ...] | None = None
) -> torch.Tensor:
    """Box ``[start, stop)`` per dim of global tensor NAME (the whole tensor when None),
    read from only the shards it overlaps: the files holding NAME verified and its size
    bounded by theirs first, then only the box allocated and filled."""
    where = child_url(reader.root, INDEX)
    meta = reader.index["tensors"].get(name)
    if meta is None:
        raise CheckpointError(f"{where}: has no tensor {name}")
    check_cover(name, meta, where)
    dtype = parse_dtype(meta["dtype"], name)
    files = {shard["file"] for shard in meta["shards"]}
    available = sum(os.path.getsize(reader.verified(file)) for file in files)
    needed = math.prod(meta["shape"]) * dtype.itemsize
    if needed > available:
        raise CheckpointError(
            f"{where}: tensor {name} claims {needed} bytes, its files hold {available}"
        )
    box = tuple((0, n) for n in meta["shape"]) if box is None else tuple(box)
    if len(box) != len(meta["shape"]) or any(
        not 0 <= a <= b <= n for (a, b), n in zip(box, meta["shape"], strict=False)
    ):
        raise CheckpointError(f"{where}: box {box} lies outside {name} {meta['shape']}")
    shape = [b - a for a, b in box]
    part = torch.empty(shape, dtype=dtype)
    piece = Piece(box, tuple(slice(0, n) for n in shape))
    _fill(reader, ShardSpec(name, tuple(meta["shape"]), (piece,), False), part, meta)
    return part
