"""Autograd-aware collectives between the replicated, tensor-parallel and
sequence-parallel regions of a model (Megatron-core's ``mappings``).

Each mapping is a pair of conjugate operations: what the forward pass does to the
activations, the backward pass does in reverse to their gradients. All take the
tensor-parallel ``ProcessGroup`` explicitly. With a group of one rank every mapping
is the identity.

===================================  ==========================  =========================
mapping                              forward                     backward
===================================  ==========================  =========================
copy_to_tensor_parallel_region       identity                    all-reduce
reduce_from_tensor_parallel_region   all-reduce                  identity
scatter_to_tensor_parallel_region    keep this rank's slice      all-gather (last dim)
gather_from_tensor_parallel_region   all-gather (last dim)       keep this rank's slice
scatter_to_sequence_parallel_region  keep this rank's slice      all-gather (sequence)
gather_from_sequence_parallel_region all-gather (sequence)       reduce-scatter (sequence)
reduce_scatter_to_sequence_parallel  reduce-scatter (sequence)   all-gather (sequence)
===================================  ==========================  =========================

Activations are ``[batch, sequence, hidden]``, so the sequence dimension is 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed import ProcessGroup

SEQUENCE_DIM = 1

# torch 2.13 renamed the tensor-in/tensor-out collectives; older versions have only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}
_FUNCOL_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_FUNCOL_REDUCE_SCATTER = (
    getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
)


# Under torch.compile every collective is the functional (out-of-place) one. Dynamo
# rewrites an in-place c10d collective into functional op + copy back, and with torch 2.11
# on NCCL that rewrite gave silently wrong results (pytorch/pytorch#174280, #159350; vLLM
# switched to functional collectives for the same reason): compiled TP trained on a
# different loss than one GPU (benchmarks/RESULTS.md, issue 20). Eager keeps c10d's own
# collectives, the path the GPU parity runs verified.


def all_reduce(x: Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """The sum (or max) of every rank's ``x``, as a new tensor (no autograd; see the
    mappings). ``x`` itself is never modified: autograd may have saved it."""
    if dist.get_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_reduce(x, _OP_NAMES[op], group))
    out = x.clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def all_gather(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (no autograd; see the mappings)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if torch.compiler.is_compiling():
        # The dimension goes to the functional collective itself (it gathers along 0 and
        # reassembles with chunk + cat): the all-gather -> matmul pattern that Inductor's
        # async TP fuses (parallel.async_tensor_parallel).
        # No wait_tensor around it: traced, the collective already ends in one, and a
        # second between the gather and the matmul hides the pattern.
        return _FUNCOL_ALL_GATHER(x.contiguous(), dim, group)
    x = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = x.new_empty((world * x.size(0), *x.shape[1:]))
    _ALL_GATHER(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    """Sum ``x`` over ranks and keep this rank's slice of ``dim`` (no autograd)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    if torch.compiler.is_compiling():  # matmul -> reduce-scatter, as all_gather's
        return _FUNCOL_REDUCE_SCATTER(x.contiguous(), "sum", dim, group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.size(0) // world, *x.shape[1:]))
    _REDUCE_SCATTER(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    """This rank's equal slice of ``dim``."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world)
    return x.chunk(world, dim)[dist.get_rank(group)].contiguous()


def _check_divisible(x: Tensor, dim: int, world: int) -> None:
    if x.size(dim) % world:
        raise ValueError(
            f"dimension {dim} of a tensor shaped {tuple(x.shape)} cannot be split over "
            f"{world} tensor-parallel ranks"
        )


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """All-gather; backward keeps this rank's slice (the gradient is already complete)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherReduceScatter(torch.autograd.Function):
    """All-gather; backward reduce-scatters (each rank's gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Enter a region where each rank computes part of a sum: gradients are all-reduced.

    Also used on replicated parameters whose local gradient covers only this rank's
    sequence shard (norms and row-parallel biases under sequence parallelism).
    """
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Sum the ranks' partial results (the end of a row-parallel linear)."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Keep this rank's slice of the last dimension."""
    return _Scatter.apply(x, -1, group)


def gather_from_tensor_parallel_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Concatenate the ranks' slices of the last dimension."""
    return _Gather.apply(x, -1, group)


def scatter_to_sequence_parallel_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Keep this rank's slice of the sequence (``x`` is replicated on every rank)."""
    return _Scatter.apply(x, SEQUENCE_DIM, group)


def gather_from_sequence_parallel_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """All-gather the sequence before a column-parallel linear; backward reduce-scatters."""
    return _GatherReduceScatter.apply(x, SEQUENCE_DIM, group)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: ProcessGroup) -> Tensor:
    """Sum the ranks' partial results and keep this rank's slice of the sequence."""
    return _ReduceScatter.apply(x, SEQUENCE_DIM, group)


__all__ = [
    "SEQUENCE_DIM",
    "all_gather",
    "all_reduce",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
]
