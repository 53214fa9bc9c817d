"""Writing a sharded checkpoint (the format: :mod:`training.checkpoint.sharded_files`).

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
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megalith.storage import atomic_write_bytes, filesystem, is_local
from training.checkpoint.format import CheckpointError, _is_persistent, step_dir_name
from training.checkpoint.sharded_files import (
    FORMAT,
    INDEX,
    LATEST,
    STATE,
    VERSION,
    child_url,
    dtype_name,
    json_bytes,
    path_exists,
    rank_file,
    read_small_file,
    remove_tree,
    rng_record,
    step_entries,
    step_number,
    write_json,
    write_safetensors,
)
from training.checkpoint.sharded_index import check_cover, signing_ready
from training.checkpoint.signing import SIGNATURE_FILE, signature_record
from training.parallel.dtensor import local_tensor
from training.parallel.groups import ParallelState
from training.parallel.shard_specs import (
    OPTIMIZER_PREFIX,
    ShardSpec,
    model_specs,
    optimizer_specs,
    reshard_fsdp,
)


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
        spec.name, {"shape": list(spec.shape), "dtype": dtype_name(local.dtype), "shards": []}
    )
    for number, piece in enumerate(spec.pieces):
        key = f"{spec.name}#{number}" if many else spec.name
        files.setdefault(file, {})[key] = buffers.copy(f"{file}/{key}", local[piece.local])
        entry["shards"].append({"file": file, "key": key, "box": [list(b) for b in piece.box]})


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
        sign=signing_ready(request.sign),
    )


def staging_url(root: str, step: int) -> str:
    """Where a save writes: ``step-X.tmp`` on local disk (renamed after), else ``step-X``."""
    name = step_dir_name(step)
    return child_url(root, f"{name}.tmp" if is_local(root) else name)


def write_rank_files(snapshot: Snapshot, staging: str, storage_options=None) -> None:
    """This rank's tensor files and its manifest ``rank-XXXXX.json`` (state.json on rank 0)."""
    with ThreadPoolExecutor(max(1, len(snapshot.files))) as pool:  # model and optimizer at once
        written = {
            name: pool.submit(write_safetensors, child_url(staging, name), content, storage_options)
            for name, content in snapshot.files.items()
        }
        files = {name: future.result() for name, future in written.items()}
    if snapshot.state is not None:
        files[STATE] = write_json(child_url(staging, STATE), snapshot.state, storage_options)
    manifest = {"rank": snapshot.rank, "files": files, "tensors": snapshot.tensors}
    write_json(child_url(staging, f"rank-{snapshot.rank:05d}.json"), manifest, storage_options)


def commit(snapshot: Snapshot, staging: str, storage_options=None) -> str:
    """Rank 0, after every rank wrote: merge the manifests, write index.json last, move
    into place (local), point latest.json at it, prune. Returns the checkpoint's URL."""
    files: dict[str, dict] = {}
    tensors: dict[str, dict] = {}
    for rank in range(snapshot.world):
        url = child_url(staging, f"rank-{rank:05d}.json")
        manifest = json.loads(read_small_file(url, storage_options))
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
        fs, path = filesystem(child_url(staging, f"rank-{rank:05d}.json"), storage_options)
        fs.rm(path)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "step": snapshot.step,
        "layout": snapshot.layout,
        "files": dict(sorted(files.items())),
        "tensors": dict(sorted(tensors.items())),
    }
    data = json_bytes(index)
    if snapshot.sign:  # before the index: a committed index is never unsigned
        write_json(
            child_url(staging, SIGNATURE_FILE), signature_record(INDEX, data), storage_options
        )
    atomic_write_bytes(child_url(staging, INDEX), data, storage_options)
    root, name = snapshot.root, step_dir_name(snapshot.step)
    final = child_url(root, name)
    if is_local(root):
        remove_tree(final)
        os.replace(staging.removeprefix("file://"), final.removeprefix("file://"))
    write_json(child_url(root, LATEST), {"step": snapshot.step, "path": name}, storage_options)
    prune(root, snapshot.step, snapshot.keep_last, storage_options)
    return final


def prune(root: str, step: int, keep_last: int, storage_options=None) -> None:
    """Keep the newest ``keep_last`` complete checkpoints up to ``step``; remove every
    incomplete one (a save that was killed). Later complete ones are left alone, as v1."""
    complete = {}
    for name in step_entries(root, storage_options):
        url = child_url(root, name)
        number = step_number(name)
        if number is None or not path_exists(child_url(url, INDEX), storage_options):
            remove_tree(url, storage_options)  # a .tmp or an uncommitted directory
        elif number <= step:
            complete[number] = url
    for old in sorted(complete)[:-keep_last]:
        remove_tree(complete[old], storage_options)
