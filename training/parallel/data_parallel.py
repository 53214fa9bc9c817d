"""Data parallelism over the data×context ranks: DDP, a ZeRO-1 distributed optimizer, FSDP2.

``ddp``: torch DDP; gradients are all-reduced in buckets of ``ddp_bucket_mb`` while
backward is still running, and not at all on accumulation micro-steps (``no_sync``).

``distributed_optimizer``: the same DDP gradients, and the AdamW state sharded over
the data-parallel ranks (ZeRO-1). Each parameter has one owner rank, which keeps
its moments and updates it; after the step every owner broadcasts what it updated.
Sharded checkpoints (``training.checkpoint.sharded_files``) have each owner write its
parameters' state, so a checkpoint loads into any data-parallel size. (torch's
ZeroRedundancyOptimizer consolidates by pickling; this one only moves tensors.)

``fsdp``: FSDP2 (``fully_shard`` per transformer block, then the root): parameters,
gradients and optimizer state sharded (ZeRO-3), all-gathered for each block's forward
and backward, gradients reduce-scattered. Each rank saves its rows of every tensor in a
sharded checkpoint; the model package gathers the full weights to rank 0. With tensor
parallelism (2-D) the model FSDP shards is the rank's TP shard: see
:mod:`training.parallel.tensor_parallel_training` for the grad norm and the gather.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from megalith.config import OptimizerConfig, ParallelConfig
from megalith.errors import MegalithError
from training.checkpoint.format import optimizer_group_indices
from training.models import build_model
from training.models.flops import param_groups
from training.models.moe import is_expert_param
from training.optim.adamw import adamw
from training.optim.adamw import build_optimizer as build_adamw
from training.parallel.dtensor import is_dtensor, is_fsdp_module, whole_tensor
from training.parallel.groups import ParallelState

DATA_PARALLEL_MODES = ("ddp", "distributed_optimizer", "fsdp")


def data_parallel_size(state: ParallelState) -> int:
    """How many ranks average their gradients (data × context)."""
    return state.sizes.dp * state.sizes.cp


def token_weight(count: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The weight of one loss token in a step of which this rank holds ``count`` tokens:
    ``DP · CP / the count over data × context``, so that summed token losses times it,
    averaged over those ranks as the gradients are, give the step's token mean."""
    count = count.to(torch.float64)
    if data_parallel_size(state) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=state.dp_cp_group)
    return (data_parallel_size(state) / count.clamp(min=1.0)).float()


def check_mode(parallel: ParallelConfig) -> None:
    if parallel.data_parallel_mode not in DATA_PARALLEL_MODES:
        raise MegalithError(
            f"parallel.data_parallel_mode={parallel.data_parallel_mode} is not implemented yet; "
            f"use one of {', '.join(DATA_PARALLEL_MODES)}"
        )


def wrap_model(
    model: nn.Module, state: ParallelState, parallel: ParallelConfig, device: torch.device
) -> nn.Module:
    """The module to call for forward and backward: DDP over data × context, the model
    sharded in place by FSDP2, or the model itself. Build the optimizer afterwards
    (FSDP2 replaces the parameters)."""
    check_mode(parallel)
    if data_parallel_size(state) == 1:
        return model
    if parallel.data_parallel_mode == "fsdp":
        return shard_model(model, state)
    ignore_in_ddp(model, derived_buffers(model))
    return DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        process_group=state.dp_cp_group,
        bucket_cap_mb=parallel.ddp_bucket_mb,
        gradient_as_bucket_view=True,
        **_no_buffer_sync(),
    )


def ignore_in_ddp(model: nn.Module, names: list[str]) -> None:
    """Leave these parameters or buffers out of DDP's broadcasts and reductions, beside
    those already left out (torch's setter replaces the list)."""
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    names = ignored + [name for name in names if name not in ignored]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def derived_buffers(model: nn.Module) -> list[str]:
    """The non-persistent buffers: made on each rank from its own parameters or settings
    (RoPE tables, float8 weight copies), so DDP has nothing to broadcast (and gloo cannot
    broadcast float8)."""
    names = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        names += [prefix + name for name in module._non_persistent_buffers_set]
    return names


def _no_buffer_sync() -> dict[str, bool]:
    """No buffer broadcast before each forward: the buffers (RoPE tables, float8 weight
    copies) are made alike on every rank. torch 2.13 renamed the option (the old name
    warns)."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient reduction on an accumulation micro-step (not the last one)."""
    if skip and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if skip and is_fsdp_module(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def all_reduce_mean(value: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The mean of a tensor over the data × context ranks (loss and metrics)."""
    if data_parallel_size(state) == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=state.dp_cp_group)
    return value / data_parallel_size(state)


def all_reduce_coalesced(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, divide_by: int = 1
) -> None:
    """Sum ``tensors`` over ``group`` in place (divided by ``divide_by``), one collective
    per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if divide_by != 1:
            flat /= divide_by
        for tensor, value in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            tensor.copy_(value)


def clip_grad_norm(
    parameters: list[nn.Parameter], max_norm: float, state: ParallelState
) -> torch.Tensor:
    """Clip by the norm over the whole model; returns the norm before clipping.

    Under DDP every rank holds the full, averaged gradients, so the local norm is the
    global one. Model-parallel layouts (TP, PP) add a reduction over their groups here.
    """
    if state.sizes.tp > 1 or state.sizes.pp > 1:
        raise NotImplementedError("grad-norm over tensor/pipeline shards is not integrated yet")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else math.inf)
    # FSDP: the norm of sharded gradients is a DTensor (already reduced over the shards).
    return whole_tensor(norm)


def grad_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The norm of the gradients of ``parameters`` (held whole on this rank), unclipped."""
    return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])


# --- FSDP2 ------------------------------------------------------------------------------


def shard_model(model: nn.Module, state: ParallelState) -> nn.Module:
    """FSDP2 over data × context: one unit per transformer block (a T5's encoder blocks,
    then its decoder blocks), the rest in the root (embedding, final norms, relative-bias
    tables and a tied output head share the root's all-gather)."""
    # Imported here, not at the top: DTensor and sympy cost ~1 s of CPU in every process
    # (see training/parallel/dtensor.py), and only FSDP runs need them.
    from torch.distributed.fsdp import fully_shard

    mesh = state.dp_cp_mesh
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP sharded ``model``'s parameters (DTensors)."""
    return any(is_dtensor(p) for p in model.parameters())


@contextlib.contextmanager
def full_model(model: nn.Module, is_main: bool) -> Iterator[nn.Module | None]:
    """The model with whole weights, for checkpoints and the model package.

    Unsharded models are yielded as they are. For FSDP this is collective: every rank
    gathers each parameter, and rank 0 gets a CPU copy of the model (None elsewhere).
    """
    if not is_sharded(model):
        yield model
        return
    full = {n: _gather(p, is_main) for n, p in model.named_parameters()}
    if not is_main:
        yield None
        return
    with torch.device("meta"):
        copy = build_model(model.config, backend=model.backend)
    copy.to_empty(device="cpu")
    copy.tie_weights()
    with torch.no_grad():
        for name, param in copy.named_parameters():
            param.copy_(full[name])
        source_buffers = dict(model.named_buffers())
        for name, buffer in copy.named_buffers():
            buffer.copy_(source_buffers[name])
    yield copy


def _gather(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """Collective for a DTensor: the whole tensor on CPU where ``keep``."""
    whole = whole_tensor(tensor)
    return whole.detach().cpu() if keep else None


# --- The distributed optimizer (ZeRO-1) ------------------------------------------------


def build_optimizer(
    model: nn.Module,
    config: OptimizerConfig,
    device: torch.device,
    state: ParallelState,
    parallel: ParallelConfig,
) -> tuple[Any, list[str]]:
    """AdamW (sharded over data-parallel ranks in ``distributed_optimizer`` mode) and the
    parameter names in its state order (for checkpoints)."""
    check_mode(parallel)
    if parallel.data_parallel_mode != "distributed_optimizer" or data_parallel_size(state) == 1:
        return build_adamw(model, config, device)
    groups = param_groups(model, config.weight_decay)
    names_by_param = {id(p): name for name, p in model.named_parameters()}
    names = [names_by_param[id(p)] for group in groups for p in group["params"]]

    def local_adamw(local_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return adamw(local_groups, config, device)

    replicas = [_replica_group(name, state) for name in names]
    return DistributedOptimizer(groups, local_adamw, state.dp_cp_group, replicas), names


def _replica_group(name: str, state: ParallelState) -> dist.ProcessGroup:
    """The ranks holding the same copy of parameter ``name``: the data × context ranks,
    or under expert parallelism, for an expert weight, its expert-data-parallel ranks."""
    if state.sizes.ep > 1 and is_expert_param(name):
        return state.edp_group
    return state.dp_cp_group


def partition(sizes: list[int], ranks: int) -> list[int]:
    """The owner of each parameter: largest first onto the least-loaded rank (deterministic)."""
    loads = [0] * ranks
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


class DistributedOptimizer:
    """ZeRO-1 over a process group: each rank steps an inner optimizer on the parameters
    it owns, then every owner broadcasts its updated parameters. ``replicas`` (one group
    per parameter, default ``group``): the ranks holding the same copy of it, among
    which it has its owner (expert weights under EP: their expert-data-parallel ranks).

    Offers what the trainer and GradScaler use of an optimizer: ``param_groups`` (set
    the learning rate here), ``zero_grad``, ``step``, ``load_state_dict`` (the full,
    single-process format).
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")  # AdamW's, amsgrad off

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        group: dist.ProcessGroup,
        replicas: list[dist.ProcessGroup] | None = None,
    ):
        self.group = group
        self.params = [p for g in groups for p in g["params"]]
        self.replicas = replicas or [group] * len(self.params)
        self.owners = [0] * len(self.params)
        for replica in _distinct(self.replicas):  # each group's parameters, partitioned
            positions = [i for i, r in enumerate(self.replicas) if r is replica]
            sizes = [self.params[i].numel() for i in positions]
            for i, owner in zip(positions, partition(sizes, replica.size()), strict=True):
                self.owners[i] = owner
        mine = {id(p) for i, p in enumerate(self.params) if self.owns(i)}
        local_groups = [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in groups]
        self.optim = make_optimizer(local_groups)
        # The global view: the inner groups' hyperparameters over every parameter.
        self.param_groups = [
            {**inner, "params": list(outer["params"])}
            for inner, outer in zip(self.optim.param_groups, groups, strict=True)
        ]

    def owns(self, position: int) -> bool:
        """Whether this rank keeps the state of, and updates, parameter ``position``."""
        return self.owners[position] == self.replicas[position].rank()

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update(_hyperparameters(outer))
        self.optim.step()
        self._broadcast_params()

    def _broadcast_params(self) -> None:
        for replica, owner, params in self._buckets():
            if replica.size() == 1:
                continue
            flat = _flatten_dense_tensors([p.data for p in params])
            dist.broadcast(flat, group_src=owner, group=replica)
            if owner != replica.rank():
                for param, value in zip(
                    params, _unflatten_dense_tensors(flat, params), strict=True
                ):
                    param.data.copy_(value)

    def _buckets(self) -> Iterator[tuple[dist.ProcessGroup, int, list[torch.Tensor]]]:
        """Parameters grouped by replica group, owner and dtype, in an order every rank
        agrees on."""
        replicas = _distinct(self.replicas)
        order = {id(r): i for i, r in enumerate(replicas)}
        buckets: dict[tuple[int, int, str], list[torch.Tensor]] = {}
        for replica, owner, param in zip(self.replicas, self.owners, self.params, strict=True):
            buckets.setdefault((order[id(replica)], owner, str(param.dtype)), []).append(param)
        for (which, owner, _), params in sorted(buckets.items(), key=lambda item: item[0]):
            yield replicas[which], owner, params

    # --- checkpoints: the single-process AdamW format (sharded checkpoints write each
    # rank's own share: training.checkpoint.sharded_writer) -----------------------------------

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(
            "DistributedOptimizer has no single-process state_dict: sharded checkpoints save "
            "each rank's share (training.checkpoint.sharded_writer)"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the full single-process state; each rank keeps the share it owns."""
        saved_groups = state_dict["param_groups"]
        if [g["params"] for g in saved_groups] != optimizer_group_indices(self):
            raise MegalithError("optimizer state does not match the parameter groups")
        local_state: dict[int, Any] = {}
        local_groups: list[dict[str, Any]] = []
        position = 0
        for saved in saved_groups:
            local_indices = []
            for index in saved["params"]:
                if not self.owns(index):
                    continue
                if index in state_dict["state"]:
                    local_state[position] = state_dict["state"][index]
                local_indices.append(position)
                position += 1
            local_groups.append({**_hyperparameters(saved), "params": local_indices})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        for outer, saved in zip(self.param_groups, saved_groups, strict=True):
            outer.update(_hyperparameters(saved))


def _distinct(groups: list[dist.ProcessGroup]) -> list[dist.ProcessGroup]:
    """Each group once, in order of first appearance (the same on every rank)."""
    seen: dict[int, dist.ProcessGroup] = {}
    for group in groups:
        seen.setdefault(id(group), group)
    return list(seen.values())


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
