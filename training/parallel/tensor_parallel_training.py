"""Tensor (and sequence) parallelism in the trainer: build, clip, gather, shard.

- :func:`build_model`: each TP rank builds its shard on the meta device with the
  tensor-parallel backend of ``model.backend`` and materializes it one parameter at a
  time from a replay of the single-device init (:mod:`training.parallel.meta_init`), so
  the initial weights equal one device's and no rank holds the whole model
  (:func:`~training.parallel.te_tensor_parallel.tensor_parallel_backend`: TE's own
  tensor-parallel modules for ``te``).
- :func:`full_model`: the model package holds whole tensors in the single-process
  format; TP shards are gathered to rank 0 (checkpoints are sharded:
  :mod:`training.checkpoint.sharded_files`).
- :func:`shard_loaded`: the inverse for loading, so a checkpoint written at any TP size
  loads at any other.

Data parallelism runs over the data × context group as without TP. FSDP (2-D) shards
each rank's TP-local parameters over that group (``fully_shard`` on its 1-D mesh), so a
rank holds FSDP rows of its TP shard: :func:`clip_grad_norm` sums over both groups and
:func:`full_model` gathers the FSDP rows before the TP shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megalith.config import ModelConfig
from training import models
from training.models import GPTModel, model_from_tensors, resolve_backend
from training.models.backend import LayerBackend
from training.parallel import context_parallel as cp
from training.parallel import data_parallel as dp
from training.parallel.dtensor import local_tensor, whole_tensor
from training.parallel.groups import ParallelState
from training.parallel.meta_init import materialize_shard
from training.parallel.te_tensor_parallel import CommOverlap, tensor_parallel_backend
from training.parallel.tensor_parallel.layers import squared_grad_norm
from training.parallel.tensor_parallel.sharding import (
    check_tensor_parallel,
    partition_spec,
    shard_tensor,
    unshard_tensor,
)


def build_model(
    config: ModelConfig,
    state: ParallelState,
    sequence_parallel: bool,
    device: torch.device,
    overlap: CommOverlap | None = None,
) -> GPTModel | models.T5Model:
    """This rank's model (of ``config.family``): the whole one without TP, else its TP
    shard of it (with context-parallel attention under CP; TE's GEMMs overlapping their
    communication with ``overlap``)."""
    if state.sizes.tp == 1:  # this rank's model is the whole model
        return models.build_model(config, single_device_backend(config, state)).to(device)
    model = models.meta_model(config, sharding_backend(config, state, sequence_parallel, overlap))
    model.to_empty(device=device)
    model.tie_weights()
    # The weights (and the RNG state after) equal one device's: the single-device init
    # is replayed one parameter at a time, each rank keeping its shard (meta_init). TE's
    # tensor-parallel modules own the torch layers' parameters and init too.
    materialize_shard(
        lambda: models.build_model(config, single_device_backend(config, state)),
        model,
        lambda name, whole: shard_loaded(name, whole, config, state),
    )
    return model


def single_device_backend(config: ModelConfig, state: ParallelState) -> LayerBackend:
    """The kernel backend of ``model.backend`` (context-parallel attention around it): the
    whole model's layers, whose init the shards replay."""
    return cp.wrap_backend(resolve_backend(config.backend), state)


def sharding_backend(
    config: ModelConfig,
    state: ParallelState,
    sequence_parallel: bool,
    overlap: CommOverlap | None = None,
) -> LayerBackend:
    """The backend that builds this rank's TP shard (context-parallel attention around
    it); :func:`single_device_backend` without TP."""
    if state.sizes.tp == 1:
        return single_device_backend(config, state)
    check_tensor_parallel(config, state.sizes.tp)
    kernels = resolve_backend(config.backend)
    backend = tensor_parallel_backend(kernels, state.tp_group, sequence_parallel, overlap)
    return cp.wrap_backend(backend, state)


def shard_loaded(
    name: str, tensor: torch.Tensor, config: ModelConfig, state: ParallelState
) -> torch.Tensor:
    """This TP rank's part of a whole saved tensor (a parameter or one of its moments)."""
    spec = partition_spec(name, config)
    if state.sizes.tp == 1 or spec is None or tensor.dim() == 0:
        return tensor
    return shard_tensor(tensor, *spec, state.tp_rank, state.sizes.tp)


def gather_whole(name: str, tensor: torch.Tensor, config: ModelConfig, state: ParallelState):
    """Collective over the TP group: the whole tensor on CPU (every TP rank)."""
    spec = partition_spec(name, config)
    if spec is None or tensor.dim() == 0:
        return tensor.detach().cpu()
    local = tensor.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(state.sizes.tp)]
    dist.all_gather(shards, local, group=state.tp_group)
    return unshard_tensor([s.cpu() for s in shards], *spec)


def _on_first_tp_group(state: ParallelState) -> bool:
    """Whether this rank's TP group holds global rank 0 (TP is innermost: dp/cp/pp rank 0)."""
    return dist.get_rank() < state.sizes.tp


@contextlib.contextmanager
def full_model(model: nn.Module, state: ParallelState, is_main: bool) -> Iterator[Any]:
    """The whole model on rank 0 (None elsewhere); without TP, ``dp.full_model``.

    Collective over the first TP group; under FSDP over every rank, which first gathers
    its TP shard's rows over the data × context group."""
    if state.sizes.tp == 1:
        with dp.full_model(model, is_main) as whole:
            yield whole
        return
    first = _on_first_tp_group(state)
    if not first and not dp.is_sharded(model):
        yield None
        return
    config = model.config
    params = {}
    for name, param in model.named_parameters():
        shard = whole_tensor(param)
        if first:
            params[name] = gather_whole(name, shard, config, state)
    if not is_main:
        yield None
        return
    yield model_from_tensors(config, params, dict(model.named_buffers()))


def clip_grad_norm(model: nn.Module, max_norm: float, state: ParallelState) -> torch.Tensor:
    """Clip by the norm of the whole (unsharded) model's gradients; returns it unclipped.

    Split parameters count their shard on every TP rank, replicated ones once. The
    gradients are already averaged over data parallelism, so only TP reduces here; under
    FSDP (2-D) each rank holds rows of its shard's gradients, so the data × context ranks
    sum their parts too. Sequence-parallel norm gradients were all-reduced over TP in
    backward, before FSDP's reduce-scatter, so they are whole on every TP rank.
    """
    if state.sizes.tp == 1:
        return dp.clip_grad_norm(list(model.parameters()), max_norm, state)
    if state.sizes.pp > 1:
        raise NotImplementedError("grad-norm over pipeline stages is not integrated yet")

    squared = squared_grad_norm(model, state.tp_group)
    if dp.is_sharded(model):
        dist.all_reduce(squared, group=state.dp_cp_group)
    norm = squared.sqrt()
    if max_norm > 0:
        # torch.nn.utils.clip_grad_norm_'s rule, so TP=1 and TP>1 clip alike.
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in model.parameters():
            if param.grad is not None:
                local_tensor(param.grad).mul_(scale)
    return norm
