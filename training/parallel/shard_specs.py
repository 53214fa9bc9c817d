"""Which boxes of which global tensors this rank holds, in any layout the trainer runs.

A sharded checkpoint (:mod:`training.checkpoint.sharded_files`) names every tensor by its
single-process name and stores, per rank, rectangular *boxes* of it (``[start, stop)``
per dimension). This module turns a rank's local tensors into those boxes, so that a
writer knows what to save and a reader, in another layout, what to fetch:

- TP (and SP): split parameters hold an equal share of their split dim
  (``tensor_parallel_partition``). With ``output_chunks`` (SwiGLU's fused ``[gate; up]``
  fc1) a rank's shard is one block per chunk, so it is several boxes.
- EP: expert weights are stacked on dim 0; EP rank ``e`` of ``ep`` holds a contiguous
  ``1/ep`` of them.
- FSDP2: a DTensor's local ``Shard(0)`` rows, at the offset the DTensor reports. Under
  TP (2-D) FSDP splits each rank's TP shard: a rank holds the FSDP rows of its TP
  pieces (a piece cut where the rows end, so an ``output_chunks`` shard may give one
  box of each chunk or only one).
- PP (with virtual stages): stage models keep the global names; a rank holds the layers
  of its stages. The tied embedding copy on the last stage is saved by the first only.
- DP, CP and the replicated (non-split) tensors: every replica holds the whole box;
  the lowest rank holding it writes it. The distributed optimizer (ZeRO-1) keeps each
  parameter's AdamW state on one data-parallel rank, which writes it.

The boxes of a rank assembled from the whole tensor give exactly what the older
``shard_loaded`` functions cut out of it (tested on real torchrun).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from training.models.moe import is_expert_param
from training.parallel.data_parallel import DistributedOptimizer
from training.parallel.dtensor import is_dtensor, is_fsdp_module, local_tensor
from training.parallel.groups import ParallelState
from training.parallel.tensor_parallel.layers import tensor_parallel_partition

Box = tuple[tuple[int, int], ...]
OPTIMIZER_PREFIX = "optimizer/"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Piece:
    """One box of a global tensor and where its elements sit in the local tensor."""

    box: Box
    local: tuple[slice, ...]


@dataclass(frozen=True)
class ShardSpec:
    """What one local tensor is of its global tensor."""

    name: str  # the global (single-process) name
    shape: tuple[int, ...]  # the global shape
    pieces: tuple[Piece, ...]
    writes: bool  # whether this rank is the one that saves these pieces


def reshard_fsdp(model: nn.Module) -> None:
    """FSDP2 leaves the root's parameters unsharded after a forward (validation runs one
    before a save): reshard them, so that ``named_parameters`` gives the DTensors the
    optimizer steps. Nothing to do without FSDP."""
    for module in model.modules():
        if is_fsdp_module(module):
            module.reshard()


def assemble(spec: ShardSpec, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The local tensor ``spec`` describes, cut out of the whole tensor (tests, tools)."""
    out = torch.empty_like(local_tensor(like), device="cpu")
    for piece in spec.pieces:
        out[piece.local] = whole[tuple(slice(a, b) for a, b in piece.box)]
    return out


def optimizer_key(name: str, state_key: str) -> str:
    return f"{OPTIMIZER_PREFIX}{name}/{state_key}"


# --------------------------------------------------------------------------- model


def model_specs(
    model: nn.Module, state: ParallelState, owner_stage: Callable[[str], int] | None = None
) -> dict[str, ShardSpec]:
    """``{parameter name: spec}`` for every parameter of this rank's model.

    ``owner_stage(name)`` is the pipeline rank that saves a parameter (None without PP).
    """
    split = tensor_parallel_partition(model) if state.sizes.tp > 1 else {}
    specs = {}
    for name, param in model.named_parameters():
        shape, pieces = _parameter_pieces(name, param, split.get(name), state)
        writes = _saves(name, param, split, state, owner_stage, replicated=True)
        specs[name] = ShardSpec(name, shape, pieces, writes)
    return specs


def _parameter_pieces(
    name: str, param: torch.Tensor, tp_split: tuple[int, int] | None, state: ParallelState
) -> tuple[tuple[int, ...], tuple[Piece, ...]]:
    """The global shape of ``name`` and this rank's pieces of it: the TP/EP pieces of the
    rank's model-parallel shard, cut to its FSDP rows when FSDP shards that shard."""
    shape = list(param.shape)  # a DTensor's shape: the whole TP/EP shard FSDP splits
    pieces = [whole_piece(shape)]
    sizes = state.sizes
    if tp_split is not None and sizes.tp > 1 and param.dim() > 0:
        dim, chunks = tp_split
        pieces = _tensor_parallel_pieces(shape, dim, chunks, state.tp_rank, sizes.tp)
        shape[dim] *= sizes.tp
    if sizes.ep > 1 and is_expert_param(name) and param.dim() > 0:
        offset = state.ep_rank * shape[0]
        pieces = [_shift(piece, 0, offset) for piece in pieces]
        shape[0] *= sizes.ep
    if is_dtensor(param):
        pieces = _fsdp_rows(pieces, param)
    return tuple(shape), tuple(pieces)


def _fsdp_rows(pieces: list[Piece], param: torch.Tensor) -> list[Piece]:
    """The parts of ``pieces`` (boxes of the shard FSDP splits, by their place in it) that
    lie in this rank's FSDP2 ``Shard(0)`` rows, placed in the rows' local tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if math.prod(local_shape) == 0:
        return []
    if param.dim() == 0:
        return pieces
    first, last = offset[0], offset[0] + local_shape[0]
    rows = []
    for piece in pieces:
        start, stop = piece.local[0].start, piece.local[0].stop
        low, high = max(start, first), min(stop, last)
        if low >= high:
            continue
        box = ((piece.box[0][0] + low - start, piece.box[0][0] + high - start), *piece.box[1:])
        local = (slice(low - first, high - first), *piece.local[1:])
        rows.append(Piece(box, local))
    return rows


def whole_piece(shape: list[int] | tuple[int, ...]) -> Piece:
    return Piece(tuple((0, n) for n in shape), tuple(slice(0, n) for n in shape))


def _tensor_parallel_pieces(
    local_shape: list[int], dim: int, chunks: int, rank: int, size: int
) -> list[Piece]:
    """One box per output chunk: chunk ``c``'s rows of this rank, in the global tensor."""
    local_rows = local_shape[dim] // chunks
    global_chunk = local_rows * size
    pieces = []
    for chunk in range(chunks):
        start = chunk * global_chunk + rank * local_rows
        box = [(0, n) for n in local_shape]
        box[dim] = (start, start + local_rows)
        local = [slice(0, n) for n in local_shape]
        local[dim] = slice(chunk * local_rows, (chunk + 1) * local_rows)
        pieces.append(Piece(tuple(box), tuple(local)))
    return pieces


def _shift(piece: Piece, dim: int, offset: int) -> Piece:
    box = list(piece.box)
    box[dim] = (box[dim][0] + offset, box[dim][1] + offset)
    return Piece(tuple(box), piece.local)


def _saves(
    name: str,
    param: torch.Tensor,
    split: dict[str, tuple[int, int]],
    state: ParallelState,
    owner_stage: Callable[[str], int] | None,
    replicated: bool,
) -> bool:
    """Whether this rank is the lowest one holding its boxes of ``name``.

    ``replicated``: every data-parallel rank holds the tensor (parameters; plain AdamW
    state); False when this rank alone holds it among them (ZeRO-1 state)."""
    coords = state.coords
    if owner_stage is not None and owner_stage(name) != coords.pp:
        return False  # the tied embedding copy on the last stage
    if name not in split and coords.tp:
        return False  # replicated over TP
    if is_dtensor(param) or not replicated:
        return True  # FSDP rows or ZeRO-1 state: this rank's own
    if state.sizes.ep > 1 and is_expert_param(name):
        return coords.edp == 0
    return coords.dp == 0 and coords.cp == 0


# --------------------------------------------------------------------------- optimizer


def holds_state(optimizer: object, position: int) -> bool:
    """Whether this rank keeps the AdamW state of parameter number ``position``."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.owns(position)
    return True


def optimizer_specs(
    optimizer: object,
    model: nn.Module,
    param_names: list[str],
    params: dict[str, ShardSpec],
    state: ParallelState,
    owner_stage: Callable[[str], int] | None = None,
) -> dict[str, ShardSpec]:
    """``{optimizer/<name>/<key>: spec}`` for the AdamW state this rank keeps: the
    moments have their parameter's boxes; the step count is a scalar written once."""
    split = tensor_parallel_partition(model) if state.sizes.tp > 1 else {}
    named = dict(model.named_parameters())
    replicated = not isinstance(optimizer, DistributedOptimizer)
    specs = {}
    for position, name in enumerate(param_names):
        if not holds_state(optimizer, position):
            continue
        param_spec = params[name]
        writes = (
            param_spec.writes
            if replicated
            else _saves(name, named[name], split, state, owner_stage, replicated=False)
        )
        for key in MOMENTS:
            specs[optimizer_key(name, key)] = ShardSpec(
                optimizer_key(name, key), param_spec.shape, param_spec.pieces, writes
            )
        at_origin = any(all(a == 0 for a, _ in p.box) for p in param_spec.pieces)
        specs[optimizer_key(name, "step")] = ShardSpec(
            optimizer_key(name, "step"), (), (Piece((), ()),), writes and at_origin
        )
    return specs
