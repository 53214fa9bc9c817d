"""A mixture-of-experts MLP: a top-k router, stacked experts, optional expert parallelism.

``MoELayer`` replaces the dense ``MLP`` of a block when ``model.num_experts`` is set
(every ``moe_layer_frequency``-th block). It keeps the dense MLP's contract,
``x [B, T, H] -> [B, T, H]`` with the pre-MLP norm inside, so the block is unchanged.

Routing (Megatron-core's default, ``moe_router_pre_softmax=False``, as in Mixtral): the
router's logits pick each token's ``moe_top_k`` experts, and the softmax over those k
logits weighs their outputs (equal to softmax over all experts, then top-k,
renormalized). With k = 1 the weight is always 1: the router then learns from the
load-balancing loss alone, as in Megatron.

Load balancing (Switch Transformer / GShard, Megatron's ``aux_loss``)::

    aux = coeff · E · Σ_e f_e · P_e

with ``f_e`` the share of the micro-batch's N·k routing assignments that chose expert
e (counted before capacity dropping) and ``P_e`` the mean over tokens of the softmax
over all E router logits. Balanced routing gives ``aux = coeff``. During training the
layer keeps the value of its last forward in ``aux_loss``; :func:`moe_aux_loss` sums
and clears them for the trainer, which adds the sum to the training loss. Where the
sequence is split over ranks (``sequence_group``: context parallelism, or tensor
parallelism with sequence parallelism) f and P are the whole sequence's, summed over the
parts.
In pipeline stages (``aux_grad_scale``) there is no loss to add it to before the last
stage: :class:`AuxLossGradient` gives it its gradient in backward instead.

Capacity (``moe_capacity_factor``): each expert takes at most
``ceil(N · k / E · factor)`` tokens of the micro-batch; beyond that, the assignments
with the lowest routing weight are dropped (Megatron's "probs" drop policy), and the
token keeps only its other experts' outputs (and the residual). ``None`` is dropless.
Under a split sequence the ranks' assignments are gathered and cut in the whole
micro-batch's token order, so each rank drops what one device would.

Tensor parallelism (Megatron-core's MoE with ``expert_tensor_parallel_size=1``, which
also requires sequence parallelism): each TP rank routes its own sequence shard through
the whole router and experts, replicated over the TP group (``tp_group``); each rank's
gradients are its own tokens', summed over the group once a step, after the last
micro-batch (:func:`tensor_parallel_replicas`; the trainer and the pipeline stages call
``expert_parallel_training.reduce_moe_grads``), as Megatron's expert-data-parallel
reduction does.

Experts are stored stacked, one tensor per weight for all experts of the layer::

    layers.{i}.mlp.norm.weight           [H]          (+ .bias with LayerNorm)
    layers.{i}.mlp.router.weight         [E, H]
    layers.{i}.mlp.experts.fc1_weight    [E, F, H] GELU; [E, 2F, H] SwiGLU as [gate; up]
    layers.{i}.mlp.experts.fc1_bias      [E, F or 2F] with bias
    layers.{i}.mlp.experts.fc2_weight    [E, H, F]
    layers.{i}.mlp.experts.fc2_bias      [E, H]       with bias

(F = ``moe_ffn_hidden_size``.) Expert parallelism splits dim 0: EP rank r of ``ep``
holds experts ``r·E/ep .. (r+1)·E/ep - 1`` (:meth:`Experts.keep_shard`) and tokens
travel to their experts' ranks and back by all-to-all (:class:`AllToAll`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from megalith.config import ModelConfig
from training.models.layers import gelu, scaled_init_std, swiglu
from training.parallel.tensor_parallel.mappings import (
    all_gather,
    all_reduce,
    reduce_from_tensor_parallel_region,
)

EXPERT_PARAM_MARK = ".mlp.experts."


def is_expert_param(name: str) -> bool:
    """Whether a parameter (or ``name/moment``) belongs to the experts, which EP splits."""
    return EXPERT_PARAM_MARK in name or name.startswith("mlp.experts.")


def sequence_shard_positions(length: int, group: dist.ProcessGroup) -> Tensor:
    """The positions of this rank's contiguous shard of a ``length``-token sequence split
    over ``group`` (sequence parallelism)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return torch.arange(rank * length // size, (rank + 1) * length // size)


# --- routing ---------------------------------------------------------------------------


@dataclass
class Routing:
    """Each token's experts ``[N, k]``, their weights ``[N, k]``, which of the
    assignments survive capacity (``keep [N, k]``, None when dropless) and the
    unscaled load-balancing loss."""

    experts: Tensor
    weights: Tensor
    keep: Tensor | None
    balance_loss: Tensor


def load_balancing_loss(
    probs: Tensor, experts: Tensor, num_experts: int, group: dist.ProcessGroup | None = None
) -> Tensor:
    """``E · Σ_e f_e · P_e`` (see the module docstring); ``probs [N, E]``, ``experts [N, k]``.

    With ``group`` (context parallelism: each rank holds an equal part of the sequence)
    ``f`` and ``P`` are over the whole sequence: the parts' counts and probability sums
    are summed over the group, the sums with an identity backward, so each rank's
    gradient is that of its own tokens' probabilities (the trainer scales it by the
    group's size, as DDP averages over it)."""
    num_tokens, top_k = experts.shape
    assignments = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    prob_sums = probs.sum(dim=0)
    if group is not None and dist.get_world_size(group) > 1:
        assignments = all_reduce(assignments, group)
        prob_sums = reduce_from_tensor_parallel_region(prob_sums, group)
        num_tokens *= dist.get_world_size(group)
    share = assignments / (num_tokens * top_k)
    return num_experts * torch.sum(share * prob_sums / num_tokens)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Tokens one expert may take: ``ceil(N · k / E · factor)`` (Megatron's get_capacity)."""
    return math.ceil(num_tokens * top_k / num_experts * factor)


def within_capacity(weights: Tensor, experts: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``keep [N, k]``: per expert, the ``capacity`` assignments of highest weight
    (ties: the earlier token)."""
    flat_experts, flat_weights = experts.reshape(-1), weights.reshape(-1)
    by_weight = torch.argsort(flat_weights.detach(), descending=True, stable=True)
    order = by_weight[torch.argsort(flat_experts[by_weight], stable=True)]
    counts = torch.bincount(flat_experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(order.numel(), device=order.device) - starts[flat_experts[order]]
    keep = torch.empty_like(flat_experts, dtype=torch.bool)
    keep[order] = position < capacity
    return keep.view_as(experts)


def route(
    logits: Tensor,
    top_k: int,
    capacity_factor: float | None = None,
    balance_group: dist.ProcessGroup | None = None,
    token_index: Tensor | None = None,
) -> Routing:
    """Top-k routing of ``logits [N, E]`` (fp32): top-k first, softmax over the chosen k;
    ``balance_group``: see :func:`load_balancing_loss`. With a ``balance_group`` of
    several ranks (context parallelism), ``token_index [N]`` gives each token's place in
    the whole micro-batch, and capacity is decided over the whole sequence as one device
    decides it (:func:`within_capacity_over`)."""
    num_tokens, num_experts = logits.shape
    top_logits, experts = logits.topk(top_k, dim=-1)
    weights = top_logits.softmax(dim=-1)
    balance = load_balancing_loss(logits.softmax(dim=-1), experts, num_experts, balance_group)
    keep = None
    if capacity_factor is not None and token_index is not None:
        keep = within_capacity_over(
            weights, experts, num_experts, capacity_factor, token_index, balance_group
        )
    elif capacity_factor is not None:
        capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
        keep = within_capacity(weights, experts, num_experts, capacity)
    return Routing(experts=experts, weights=weights, keep=keep, balance_loss=balance)


def within_capacity_over(
    weights: Tensor,
    experts: Tensor,
    num_experts: int,
    factor: float,
    token_index: Tensor,
    group: dist.ProcessGroup,
) -> Tensor:
    """``keep [N, k]`` of this rank's part of a sequence split over ``group``: every
    rank's assignments gathered, put in the whole micro-batch's token order
    (``token_index``) and cut to capacity as :func:`within_capacity` does on one device;
    then this rank's rows."""
    num_tokens, top_k = experts.shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    every = [all_gather(t, 0, group) for t in (weights.detach(), experts, token_index)]
    order = torch.argsort(every[2])
    capacity = expert_capacity(num_tokens * world, top_k, num_experts, factor)
    in_order = within_capacity(every[0][order], every[1][order], num_experts, capacity)
    keep = torch.empty_like(in_order)
    keep[order] = in_order
    return keep[rank * num_tokens : (rank + 1) * num_tokens]


class Router(nn.Module):
    """Logits ``x W^T`` in fp32 (bf16 logits make near-ties, and so routing, noisy)."""

    def __init__(self, hidden_size: int, num_experts: int, *, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


# --- experts ---------------------------------------------------------------------------


class Experts(nn.Module):
    """``num_experts`` MLPs (the dense MLP's activation) stored as stacked tensors.

    ``forward(x, counts)`` runs expert ``e`` on the ``counts[e]`` rows of ``x`` that
    follow those of experts ``0..e-1`` (rows sorted by expert): a loop of dense
    matmuls, readable rather than a grouped GEMM.
    """

    def __init__(self, config: ModelConfig, num_experts: int):
        super().__init__()
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        self.gated = config.activation == "swiglu"
        chunks = 2 if self.gated else 1
        self.init_std = config.init_std
        self.out_std = scaled_init_std(config.init_std, config.num_layers)
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, chunks * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.fc1_bias = self.fc2_bias = None
        if config.bias:
            self.fc1_bias = nn.Parameter(torch.empty(num_experts, chunks * ffn))
            self.fc2_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.reset_parameters()

    @property
    def num_local_experts(self) -> int:
        return self.fc1_weight.size(0)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fc1_weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.fc2_weight, mean=0.0, std=self.out_std)
        for bias in (self.fc1_bias, self.fc2_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def keep_shard(self, rank: int, size: int) -> None:
        """Keep only experts ``rank·E/size .. (rank+1)·E/size - 1`` (expert parallelism)."""
        for name, param in list(self.named_parameters(recurse=False)):
            part = param.detach().chunk(size, dim=0)[rank].clone()
            setattr(self, name, nn.Parameter(part, requires_grad=param.requires_grad))

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        activation = swiglu if self.gated else gelu
        outputs = []
        for e, rows in enumerate(x.split(counts)):
            h = F.linear(rows, self.fc1_weight[e], _row(self.fc1_bias, e))
            outputs.append(F.linear(activation(h), self.fc2_weight[e], _row(self.fc2_bias, e)))
        return torch.cat(outputs)


def _row(bias: Tensor | None, e: int) -> Tensor | None:
    return None if bias is None else bias[e]


# --- expert-parallel all-to-all ---------------------------------------------------------


def exchange(
    x: Tensor, output_splits: list[int] | None, input_splits: list[int] | None, group
) -> Tensor:
    """``all_to_all_single`` as a new tensor (no autograd). Under torch.compile the
    functional collective: dynamo's rewrite of the in-place one into functional + copy
    is what gave compiled tensor parallelism wrong results on GPUs (see
    ``training.parallel.tensor_parallel.mappings``)."""
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(
            funcol.all_to_all_single(x.contiguous(), output_splits, input_splits, group)
        )
    rows = sum(output_splits) if output_splits is not None else x.size(0)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with autograd: backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        return exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    return AllToAll.apply(x, output_splits, input_splits, group)


# --- the layer -------------------------------------------------------------------------


class MoELayer(nn.Module):
    """Norm, router, experts; dispatch by sorting assignments by expert, combine by a
    weighted ``index_add`` back onto the tokens."""

    def __init__(self, config: ModelConfig, norm: nn.Module):
        super().__init__()
        if not config.num_experts:
            raise ValueError("MoELayer needs model.num_experts >= 1")
        self.num_experts = config.num_experts
        self.top_k = config.moe_top_k
        self.capacity_factor = config.moe_capacity_factor
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.norm = norm
        self.router = Router(config.hidden_size, self.num_experts, init_std=config.init_std)
        self.experts = Experts(config, self.num_experts)
        self.dropout = nn.Dropout(config.dropout)
        self.ep_group: dist.ProcessGroup | None = None  # set by expert-parallel training
        self.tp_group: dist.ProcessGroup | None = None  # router and experts whole over TP
        # Set where the sequence is split (context parallelism, or tensor parallelism with
        # sequence parallelism: split_sequence): the load balance and capacity are the
        # whole sequence's; sequence_positions(length) gives this rank's tokens' positions.
        self.sequence_group: dist.ProcessGroup | None = None
        self.sequence_positions: Callable[[int], Tensor] | None = None
        self.aux_loss: Tensor | None = None
        # Pipeline stages compute no loss to add the balance to: set, it makes backward
        # give the balance loss this gradient (see AuxLossGradient); the values of the
        # forwards back-propagated go to aux_values, for the step's metric.
        self.aux_grad_scale: float | None = None
        self.aux_values: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.norm(x).reshape(-1, x.size(-1))
        routing = route(
            self.router(hidden),
            self.top_k,
            self.capacity_factor,
            self.sequence_group,
            self._token_index(x) if self.capacity_factor is not None else None,
        )
        aux = None
        if self.training and torch.is_grad_enabled():
            aux = self.aux_loss_coeff * routing.balance_loss
            if self.aux_grad_scale is None:
                self.aux_loss = aux
        tokens = torch.arange(hidden.size(0), device=x.device).repeat_interleave(self.top_k)
        experts, weights = routing.experts.reshape(-1), routing.weights.reshape(-1)
        if routing.keep is not None:
            kept = routing.keep.reshape(-1)
            tokens, experts, weights = tokens[kept], experts[kept], weights[kept]
        order = torch.argsort(experts, stable=True)
        tokens, weights = tokens[order], weights[order]
        counts = torch.bincount(experts, minlength=self.num_experts)
        out = self._run_experts(hidden[tokens], counts)
        # Weighted and summed in fp32 (the weights' dtype), as Megatron's unpermute does.
        out = out * weights.unsqueeze(-1)
        combined = out.new_zeros(hidden.shape).index_add(0, tokens, out)
        out = self.dropout(combined.view(x.shape).to(x.dtype))
        if aux is not None and self.aux_grad_scale is not None:
            out = AuxLossGradient.apply(out, aux, self)
        return out

    def split_sequence(self, group: dist.ProcessGroup, positions: Callable[[int], Tensor]) -> None:
        """This rank routes one part of each sequence split over ``group``;
        ``positions(length)``: where its tokens sit in a ``length``-token sequence. The
        last call holds (context parallelism's CP × TP group replaces the TP group)."""
        self.sequence_group, self.sequence_positions = group, positions

    def replicate_over_tensor_parallel(self, group: dist.ProcessGroup) -> None:
        """Under TP with sequence parallelism: the router and experts whole on each rank
        (their gradients summed over ``group`` once a step), the sequence split over it."""
        self.tp_group = group
        self.split_sequence(group, lambda length: sequence_shard_positions(length, group))

    def _token_index(self, x: Tensor) -> Tensor | None:
        """Where the sequence is split, the place of each of this rank's tokens
        ``x [B, S, H]`` in the whole micro-batch (``b · length + position``); else None."""
        if self.sequence_group is None or self.sequence_positions is None:
            return None
        batch, length = x.size(0), x.size(1) * dist.get_world_size(self.sequence_group)
        rows = torch.arange(batch, device=x.device).unsqueeze(1) * length
        return (rows + self.sequence_positions(length).to(x.device)).reshape(-1)

    def record_aux(self, aux: Tensor) -> None:
        """A back-propagated forward's balance loss (pipeline stages), recorded in
        backward, so that a forward a checkpoint recomputes counts once."""
        self.aux_values.append(aux)

    def _run_experts(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Rows sorted by expert -> expert outputs, same order (through EP ranks if any)."""
        group = self.ep_group
        if group is None or dist.get_world_size(group) == 1:
            return self.experts(rows, counts.tolist())
        ep, local = dist.get_world_size(group), self.experts.num_local_experts
        # How many rows each rank sends to each of our local experts.
        received = exchange(counts, None, None, group)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        received = received.view(ep, local)
        recv_splits = received.sum(dim=1).tolist()
        arrived = all_to_all(rows, recv_splits, send_splits, group)
        # Arrived rows are grouped by source rank, then expert: regroup by expert.
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        out = self.experts(arrived[order], received.sum(dim=0).tolist())
        out = out[torch.argsort(order)]
        return all_to_all(out, send_splits, recv_splits, group)


class AuxLossGradient(torch.autograd.Function):
    """``out`` unchanged; in backward the balance loss ``aux`` gets the gradient
    ``layer.aux_grad_scale``, as if ``scale · aux`` had been added to the loss (Megatron's
    MoEAuxLossAutoScaler): a pipeline stage before the last has no loss to add it to.
    The layer records the value then (:meth:`MoELayer.record_aux`)."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor, layer: MoELayer) -> Tensor:
        ctx.layer, ctx.scale, ctx.aux = layer, layer.aux_grad_scale, aux.detach()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.layer.record_aux(ctx.aux)
        return grad, torch.full_like(ctx.aux, ctx.scale), None


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def tensor_parallel_replicas(model: nn.Module) -> list[nn.Parameter]:
    """The routers' and experts' parameters that TP ranks hold whole while each routes
    its own tokens: their gradients are to be summed over TP."""
    return [
        param
        for layer in moe_layers(model)
        if layer.tp_group is not None
        for module in (layer.router, layer.experts)
        for param in module.parameters()
    ]


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """The sum of the load-balancing losses of the last training forward, cleared
    afterwards; None for a model without MoE layers."""
    layers = moe_layers(model)
    if not layers:
        return None
    losses = [layer.aux_loss for layer in layers if layer.aux_loss is not None]
    for layer in layers:
        layer.aux_loss = None
    return torch.stack(losses).sum() if losses else None
