"""Expert parallelism in the trainer: build, exclude from DDP, reduce, clip, gather, shard.

EP is carved out of the data × context ranks (:mod:`training.parallel.groups`): the
``ep`` ranks of an expert-parallel group each hold ``num_experts / ep`` experts of
every MoE layer and exchange tokens by all-to-all; ranks with the same EP rank form
the expert-data-parallel (``edp``) group and hold the same experts.

- :func:`build_model`: the whole model is built from the seed on every rank (so the
  initial weights equal one device's), then each EP rank keeps its experts.
- Gradients: dense parameters are averaged over data × context by DDP as without EP.
  Expert parameters are left out of DDP (:func:`exclude_experts_from_ddp`); after
  backward :func:`reduce_expert_grads` sums them over ``edp`` and divides by
  data × context, the same scaling DDP applies, because an expert's local gradient
  already sums the tokens that every rank of its EP group sent it.
- :func:`clip_grad_norm`: expert gradients count once across EP ranks.
- The distributed optimizer (ZeRO-1) gives each expert weight an owner among its
  expert-data-parallel ranks, each dense one among the data × context ranks
  (``data_parallel.build_optimizer``). FSDP shards each layer's experts over those ranks
  (:func:`shard_experts`), the rest over data × context.
- :func:`full_model` / :func:`shard_loaded`: the model package holds whole
  single-process tensors (experts gathered over the first EP group to rank 0); whole
  (v1) checkpoints load at any EP size.

Without EP (``parallel.expert`` 1) every function defers to
:mod:`training.parallel.tensor_parallel_training`; an MoE model then trains like a
dense one (experts replicated, averaged by DDP, sharded by the distributed optimizer
or FSDP). What EP cannot run with is refused in :mod:`training.parallel.support`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.config import ModelConfig
from training import models
from training.models import GPTModel, model_from_tensors
from training.models.moe import is_expert_param, moe_layers, tensor_parallel_replicas
from training.parallel import context_parallel as cp
from training.parallel import data_parallel as dp
from training.parallel import tensor_parallel_training as tp
from training.parallel.dtensor import local_tensor, whole_tensor
from training.parallel.groups import ParallelState
from training.parallel.meta_init import materialize_shard
from training.parallel.te_tensor_parallel import CommOverlap
from training.parallel.tensor_parallel.layers import squared_grad_norm


def _expert_parallel(state: ParallelState) -> bool:
    return state.sizes.ep > 1


def build_model(
    config: ModelConfig,
    state: ParallelState,
    sequence_parallel: bool,
    device: torch.device,
    overlap: CommOverlap | None = None,
) -> GPTModel:
    """This rank's model: the whole model (or its TP shard), with only this EP rank's
    experts. Under EP it is built on meta, cut to this rank's experts, and materialized
    from a replay of the single-device init one parameter at a time, so no rank holds
    every expert; with TP, each rank's TP shard of the dense layers."""
    if not _expert_parallel(state):
        model = tp.build_model(config, state, sequence_parallel, device, overlap)
        balance_over_context(model, state)
        return model
    model = models.meta_model(
        config, tp.sharding_backend(config, state, sequence_parallel, overlap)
    )
    for layer in moe_layers(model):
        layer.experts.keep_shard(state.ep_rank, state.sizes.ep)
        layer.ep_group = state.ep_group
    model.to_empty(device=device)
    model.tie_weights()
    materialize_shard(
        lambda: models.build_model(config, tp.single_device_backend(config, state)),
        model,
        lambda name, whole: shard_loaded(name, whole, config, state),
    )
    balance_over_context(model, state)
    return model


def balance_over_context(model: nn.Module, state: ParallelState) -> None:
    """Under context parallelism each MoE layer's load-balancing loss and expert capacity
    cover the whole sequence, its CP group's parts (``training.models.moe``): the layer
    learns the group and where this rank's tokens sit in the sequence. With TP too, each
    CP part is split again over the TP ranks (sequence parallelism): the group is then
    CP × TP and the positions the TP shard of the CP part's."""
    if state.sizes.cp == 1:
        return
    group = state.cp_group
    where = functools.partial(cp.positions, cp_size=state.sizes.cp, cp_rank=state.cp_rank)
    if state.sizes.tp > 1:
        group, where = state.cp_tp_group, _tensor_shard_of(where, state)
    for layer in moe_layers(model):
        layer.split_sequence(group, where)


def _tensor_shard_of(
    positions: Callable[[int], torch.Tensor], state: ParallelState
) -> Callable[[int], torch.Tensor]:
    """``positions`` (a CP part's) cut to this TP rank's contiguous shard of them."""

    def shard(length: int) -> torch.Tensor:
        return positions(length).chunk(state.sizes.tp)[state.tp_rank]

    return shard


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if is_expert_param(name)}


def exclude_experts_from_ddp(model: nn.Module, state: ParallelState) -> None:
    """Under EP, DDP must not average the experts: each EP rank holds different ones.
    Call before wrapping the model in DDP."""
    if _expert_parallel(state):
        dp.ignore_in_ddp(model, list(expert_parameters(model)))


def shard_experts(
    model: nn.Module, state: ParallelState, reshard_after_forward: bool = True
) -> None:
    """Under FSDP, each MoE layer's experts one FSDP unit over their expert-data-parallel
    ranks (before the blocks and the root are sharded over data × context, which then
    leave them out). Their reduce-scatter averages over that group; :func:`reduce_expert_grads`
    then divides by the EP size, for the sum over data × context that DDP's scaling gives.
    (FSDP's own ``set_gradient_divide_factor`` needs NCCL's PREMUL_SUM, which gloo lacks.)"""
    if not _expert_parallel(state):
        return
    from torch.distributed.fsdp import fully_shard  # as data_parallel.shard_model

    mesh = state.expert_mesh["edp"]
    for layer in moe_layers(model):
        fully_shard(layer.experts, mesh=mesh, reshard_after_forward=reshard_after_forward)


def reduce_moe_grads(model: nn.Module, state: ParallelState) -> None:
    """After the step's last micro-batch: the gradients of routers and experts that TP
    ranks hold whole summed over TP (each rank's are its own tokens'; under FSDP each
    rank's rows of them, the same rows on every TP rank), then the experts' over their
    expert-data ranks (:func:`reduce_expert_grads`)."""
    if state.sizes.tp > 1:
        replicas = tensor_parallel_replicas(model)
        grads = [local_tensor(p.grad) for p in replicas if p.grad is not None]
        if grads:
            dp.all_reduce_coalesced(grads, state.tp_group)
    reduce_expert_grads(model, state)


def reduce_expert_grads(model: nn.Module, state: ParallelState) -> None:
    """After the last micro-step's backward: expert gradients summed over the
    expert-data-parallel ranks and divided by data × context (DDP's scaling). Under FSDP
    their reduce-scatter averaged them over expert-data ranks: divided by EP to match."""
    if not _expert_parallel(state):
        return
    grads = [p.grad for p in expert_parameters(model).values() if p.grad is not None]
    if dp.is_sharded(model):
        for grad in grads:
            local_tensor(grad).div_(state.sizes.ep)
        return
    if state.sizes.edp > 1:
        for grad in grads:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=state.edp_group)
    for grad in grads:
        grad.div_(dp.data_parallel_size(state))


def clip_grad_norm(model: nn.Module, max_norm: float, state: ParallelState) -> torch.Tensor:
    """Clip by the global gradient norm; returns it unclipped. Under EP the experts'
    squared norms are summed over the EP group, the replicated rest counted once; under
    FSDP every rank's rows are summed over data × context (expert-data × expert), which
    hold each dense and each expert row once between them. With TP the dense layers'
    split gradients are summed over TP too (the experts are whole on every TP rank)."""
    if not _expert_parallel(state):
        return tp.clip_grad_norm(model, max_norm, state)
    named = {n: p for n, p in model.named_parameters() if p.grad is not None}
    if dp.is_sharded(model):
        squared = squared_grad_norm(model, state.tp_group)  # this rank's rows
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=state.dp_cp_group)
    else:
        dense = squared_grad_norm(model, state.tp_group, include=lambda n: not is_expert_param(n))
        experts = squared_grad_norm(model, state.tp_group, include=is_expert_param)
        dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=state.ep_group)
        squared = dense + experts
    norm = squared.sqrt()
    if max_norm > 0:
        # torch.nn.utils.clip_grad_norm_'s rule, as without EP.
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in named.values():
            local_tensor(param.grad).mul_(scale)
    return norm


# --- whole tensors for checkpoints and the model package ---------------------------------


def shard_loaded(
    name: str, tensor: torch.Tensor, config: ModelConfig, state: ParallelState
) -> torch.Tensor:
    """This rank's part of a whole saved tensor: its TP shard, and under EP its experts."""
    tensor = tp.shard_loaded(name, tensor, config, state)
    if not _expert_parallel(state) or not is_expert_param(name) or tensor.dim() == 0:
        return tensor
    return tensor.chunk(state.sizes.ep, dim=0)[state.ep_rank].clone()


def _on_first_ep_groups(state: ParallelState) -> bool:
    """Whether this rank's EP group is one of the first TP group's (global rank 0's)."""
    coords = state.coords
    return coords.edp == 0 and coords.pp == 0


def whole_experts(name: str, tensor: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Parameter ``name`` with every EP rank's experts (collective over the EP group for
    an expert parameter; any other as it is)."""
    if not _expert_parallel(state) or not is_expert_param(name) or tensor.dim() == 0:
        return tensor
    return _gather_experts(tensor, state)


def _gather_experts(tensor: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Collective over the EP group: every rank's experts concatenated, on CPU."""
    local = tensor.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(state.sizes.ep)]
    dist.all_gather(parts, local, group=state.ep_group)
    return torch.cat([part.cpu() for part in parts], dim=0)


@contextlib.contextmanager
def full_model(model: nn.Module, state: ParallelState, is_main: bool) -> Iterator[Any]:
    """The whole model on rank 0 (None elsewhere). Collective over the first TP group's EP
    groups (the experts gathered over EP, the dense TP shards over TP); under FSDP over
    every rank (each parameter's rows gathered first)."""
    if not _expert_parallel(state):
        with tp.full_model(model, state, is_main) as whole:
            yield whole
        return
    if not dp.is_sharded(model) and not _on_first_ep_groups(state):
        yield None
        return
    params = {
        n: _whole(n, whole_tensor(p), model.config, state) for n, p in model.named_parameters()
    }
    if not is_main:
        yield None
        return
    yield model_from_tensors(model.config, params, dict(model.named_buffers()))


def _whole(name: str, tensor: torch.Tensor, config: ModelConfig, state: ParallelState):
    """This rank's EP/TP part of parameter ``name`` made whole, on CPU (collective over
    the EP group for an expert weight, over the TP group for a dense one)."""
    if is_expert_param(name) and tensor.dim() > 0:
        return _gather_experts(tensor, state)
    if state.sizes.tp > 1:
        return tp.gather_whole(name, tensor, config, state)
    return tensor.detach().cpu()
