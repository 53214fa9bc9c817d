"""Tensor-parallel layers: column/row-parallel linears, the vocab-parallel embedding and
output head, and norms whose gradients are reduced under sequence parallelism.

Every module takes the tensor-parallel ``ProcessGroup`` in its constructor and keeps
only its rank's part of the weights, with the parameter names of the plain layers
(``weight``, ``bias``) so a full state dict can be sharded key by key
(:mod:`training.parallel.tensor_parallel.sharding`).

Sequence parallelism (``sequence_parallel=True``): activations between the blocks
are sequence shards ``[B, T/tp, H]``. A column-parallel linear all-gathers the
sequence first; a row-parallel linear reduce-scatters its output instead of
all-reducing it. Parameters that act on a sequence shard while being replicated
(norm weights and biases, row-parallel biases) then see only their rank's tokens, so
their gradients are all-reduced over the TP group inside the backward pass (by
:func:`copy_to_tensor_parallel_region` on the parameter): after ``backward()`` every
rank holds the full gradient and the trainer has nothing to add.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from training.models.layers import NormSpec, RMSNorm, to_autocast_dtype, weight_like
from training.parallel.dtensor import local_tensor
from training.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.tensor_parallel.mappings import (
    SEQUENCE_DIM,
    all_gather,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

IGNORE_INDEX = -100

# ``matmul(x, weight) -> x @ weight.T`` in another number format: set on a linear by
# training.precision.fp8 (torchao's float8 casts and scaled matmuls); None is F.linear.
Matmul = Callable[[Tensor, Tensor], Tensor]


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


class _SequenceParallelLinear(torch.autograd.Function):
    """``linear(all_gather_sequence(x), W, b)`` that saves only the sequence shard ``x``
    and all-gathers it again in backward (Megatron's choice): the activation kept for
    the weight gradient is ``T/tp`` long instead of ``T``, at the cost of one more
    all-gather. The input gradient is reduce-scattered back to the shard."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, group: ProcessGroup):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather(x, SEQUENCE_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        total = all_gather(x, SEQUENCE_DIM, ctx.group)
        grad_input = reduce_scatter(grad.matmul(weight), SEQUENCE_DIM, ctx.group)
        grad_2d = grad.reshape(-1, grad.size(-1))
        grad_weight = grad_2d.t().matmul(total.reshape(-1, total.size(-1)))
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s rows (the output features) split across ranks.

    With ``output_chunks=k`` the output is ``k`` equal parts split separately, so the
    local output is ``[part_0 of this rank; ..; part_k-1 of this rank]`` (SwiGLU's
    ``[gate; up]`` stays a ``[gate; up]`` locally). ``gather_output`` returns the full
    output in the global layout; otherwise each rank returns its own features.
    """

    partition_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: ProcessGroup,
        bias: bool,
        init_std: float,
        output_chunks: int = 1,
        sequence_parallel: bool = False,
        gather_output: bool = False,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        self.output_chunks = output_chunks
        self.init_std = init_std
        tp = dist.get_world_size(group)
        chunk = _divide(out_features, output_chunks, "output features")
        local = output_chunks * _divide(chunk, tp, f"output features per chunk of {out_features}")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        self.matmul: Matmul | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.matmul is not None:
            # The plain autograd path: under SP the gathered input is kept for the
            # weight gradient (the float8 matmul saves its own float8 copies).
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, self.group)
            else:
                x = copy_to_tensor_parallel_region(x, self.group)
            y = self.matmul(x, self.weight)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
        elif self.sequence_parallel:
            y = _SequenceParallelLinear.apply(
                *to_autocast_dtype(x, self.weight, self.bias), self.group
            )
        else:
            y = F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)
        if not self.gather_output:
            return y
        chunks = y.chunk(self.output_chunks, dim=-1)
        return torch.cat([gather_from_tensor_parallel_region(c, self.group) for c in chunks], -1)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s columns (the input features) split across ranks.

    The input is already split (the output of a column-parallel layer); the partial
    products are all-reduced, or reduce-scattered along the sequence under sequence
    parallelism. The bias is replicated and added once, after the reduction.
    """

    partition_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: ProcessGroup,
        bias: bool,
        init_std: float,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.init_std = init_std
        local = _divide(in_features, dist.get_world_size(group), "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.matmul: Matmul | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight) if self.matmul is None else self.matmul(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_tensor_parallel_region(y, self.group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        if self.bias is None:
            return y
        return y + copy_to_tensor_parallel_region(self.bias, self.group)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary (rows) split across ranks.

    Each rank looks up the tokens in its vocabulary range, writes zeros for the others
    and the ranks' results are summed: all-reduced, or with ``reduce_scatter`` summed
    and split along the sequence (the output is then a sequence shard).
    """

    partition_dim = 0

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        group: ProcessGroup,
        init_std: float,
        reduce_scatter: bool = False,
    ):
        super().__init__()
        self.group = group
        self.reduce_scatter = reduce_scatter
        self.init_std = init_std
        local = _divide(vocab_size, dist.get_world_size(group), "vocab_size")
        self.vocab_start = dist.get_rank(group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, tokens: Tensor) -> Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_tokens = (tokens - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local_tokens, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter:
            return reduce_scatter_to_sequence_parallel_region(x, self.group)
        return reduce_from_tensor_parallel_region(x, self.group)


class VocabParallelOutputHead(nn.Module):
    """The language-model head with the vocabulary split across ranks, and its loss.

    ``loss`` runs :func:`vocab_parallel_cross_entropy` on the local logits, so no rank
    ever holds logits for the full vocabulary; ``forward`` (generation, evaluation)
    gathers them. Under sequence parallelism the input is a sequence shard and is
    all-gathered first. With ``tied_weight`` (the embedding's vocab shard) the head
    uses that parameter, split the same way.
    """

    partition_dim = 0

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        group: ProcessGroup,
        init_std: float,
        tied_weight: nn.Parameter | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.init_std = init_std
        self.tied = tied_weight is not None
        local = _divide(vocab_size, dist.get_world_size(group), "vocab_size")
        if tied_weight is not None:
            if tied_weight.shape != (local, hidden_size):
                raise ValueError(
                    f"tied weight {tuple(tied_weight.shape)} is not this rank's vocab shard "
                    f"({local}, {hidden_size})"
                )
            self.weight = tied_weight
        else:
            self.weight = nn.Parameter(torch.empty(local, hidden_size))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.tied:
            nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def local_logits(self, hidden: Tensor) -> Tensor:
        """Logits of this rank's vocabulary range, ``[B, T, V/tp]``."""
        if self.sequence_parallel:
            return _SequenceParallelLinear.apply(
                *to_autocast_dtype(hidden, self.weight, None), self.group
            )
        return F.linear(copy_to_tensor_parallel_region(hidden, self.group), self.weight)

    def forward(self, hidden: Tensor) -> Tensor:
        return gather_from_tensor_parallel_region(self.local_logits(hidden), self.group)

    def loss(
        self, hidden: Tensor, labels: Tensor, reduction: Literal["mean", "none"] = "mean"
    ) -> Tensor:
        """As :meth:`training.models.layers.OutputHead.loss`; identical on every TP rank."""
        logits = self.local_logits(hidden).float()
        losses = vocab_parallel_cross_entropy(logits, labels, self.group)
        if reduction == "none":
            return losses
        return losses.sum() / (labels != IGNORE_INDEX).sum()


class SequenceParallelRMSNorm(RMSNorm):
    """:class:`RMSNorm` on a sequence shard; the weight's gradient is all-reduced over TP
    (in the weight's dtype: the cast to the input's comes after)."""

    def __init__(self, size: int, *, eps: float, group: ProcessGroup):
        super().__init__(size, eps=eps)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        weight = weight_like(copy_to_tensor_parallel_region(self.weight, self.group), x)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` on a sequence shard; weight and bias gradients are all-reduced over TP."""

    def __init__(self, size: int, *, eps: float, bias: bool, group: ProcessGroup):
        super().__init__(size, eps=eps, bias=bias)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        weight = copy_to_tensor_parallel_region(self.weight, self.group)
        bias = None if self.bias is None else copy_to_tensor_parallel_region(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def sequence_parallel_norm(size: int, spec: NormSpec, group: ProcessGroup) -> nn.Module:
    """The norm of ``spec`` for sequence shards (same parameter names as the plain norm)."""
    if spec.kind == "rmsnorm":
        return SequenceParallelRMSNorm(size, eps=spec.eps, group=group)
    return SequenceParallelLayerNorm(size, eps=spec.eps, bias=spec.bias, group=group)


class ScatterToSequenceParallel(nn.Module):
    """Keep this rank's slice of the sequence of a replicated ``[B, T, H]`` activation."""

    def __init__(self, group: ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        return scatter_to_sequence_parallel_region(x, self.group)


TENSOR_PARALLEL_MODULES = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutputHead,
)


def tensor_parallel_partition(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{parameter name: (split dim, output chunks)}`` for every split parameter of
    ``model`` (replicated ones are absent). A tied head is listed under the
    embedding's name only, as ``named_parameters`` lists it."""
    split: dict[int, tuple[int, int]] = {}
    for module in model.modules():
        if not isinstance(module, TENSOR_PARALLEL_MODULES):
            continue
        chunks = getattr(module, "output_chunks", 1)
        split[id(module.weight)] = (module.partition_dim, chunks)
        bias = getattr(module, "bias", None)
        if bias is not None and module.partition_dim == 0:
            split[id(bias)] = (0, chunks)
    for module in model.modules():  # LoRA adapters (training.finetune.lora)
        for param, dim, chunks in getattr(module, "tensor_parallel_parameters", list)():
            split[id(param)] = (dim, chunks)
    return {
        name: split[id(param)] for name, param in model.named_parameters() if id(param) in split
    }


def squared_grad_norm(
    model: nn.Module,
    group: ProcessGroup | None,
    include: Callable[[str], bool] | None = None,
) -> Tensor:
    """Sum of squared gradients of the whole (unsharded) model, the same on every TP rank
    (``group``; None: no TP); ``include(name)``: only those parameters.

    Split parameters contribute their shard on each rank (summed over the group);
    replicated ones count once. Under FSDP (2-D) the gradients are DTensors and this
    rank's rows count: the result is then this rank's part, to be summed over the
    data-parallel group. Add the other model-parallel dimensions (pipeline stages) before
    the square root for gradient clipping.
    """
    split_names = set(tensor_parallel_partition(model))
    device = next(model.parameters()).device
    split, replicated = [], []
    for name, param in model.named_parameters():
        if param.grad is not None and (include is None or include(name)):
            grad = local_tensor(param.grad)
            (split if name in split_names else replicated).append(grad)
    split_total = _sum_of_squares(split, device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(split_total, group=group)
    return split_total + _sum_of_squares(replicated, device)


def _sum_of_squares(grads: list[Tensor], device: torch.device) -> Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.detach().float().square().sum() for g in grads]).sum()


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ScatterToSequenceParallel",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "VocabParallelEmbedding",
    "VocabParallelOutputHead",
    "sequence_parallel_norm",
    "squared_grad_norm",
    "tensor_parallel_partition",
]
