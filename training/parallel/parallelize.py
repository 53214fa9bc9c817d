"""One step from a config to this rank's model, ready to train: :func:`parallelize`.

The trainer calls it once. It applies, in this order:

1. **Pipeline split** (``parallel.pipeline`` > 1): this rank's stages
   (:class:`~training.parallel.pipeline.PipelineParallel`, which builds them through
   step 2 and keeps this rank's layers); with FSDP the stages are sharded after steps 3
   and 4, one unit per block and each stage chunk the root of the rest
   (:meth:`~training.parallel.pipeline.PipelineParallel.shard_data_parallel`).
2. **Tensor / sequence / context / expert parallelism**: the model is built on the meta
   device with the sharding backend (tensor-parallel linears and vocabulary, context-
   parallel attention around the kernel backend) and materialized shard by shard from a
   replay of the single-device init (:mod:`training.parallel.meta_init`), so its weights
   equal one process's and no rank holds the whole model; EP ranks keep their experts
   (:mod:`training.parallel.expert_parallel_training`).
3. **fp8**: linears swapped for torchao's float8 ones, or the TE recipe armed
   (:mod:`training.precision.fp8`); after the sharding because it converts the layers
   the sharding chose, before data parallelism because DDP/FSDP capture the parameters,
   and before fine-tuning because the swap makes new linear modules (with the same
   parameters), which would leave behind adapters attached to the old ones.
4. **Fine-tuning**: base weights loaded into the shards (same names in float8 linears),
   LoRA adapters added beside the base linears, in bf16 under autocast.
5. **Activation checkpointing** is not a wrapping step: the blocks apply it themselves
   (``model.activation_checkpointing``, :mod:`training.models.gpt`), so it wraps the
   fp8 layers as they are.
6. **Data parallelism**: DDP over data × context, or FSDP2 sharding in place (the
   optimizer is built after, on the parameters FSDP leaves); with TP, FSDP shards each
   rank's TP-local parameters (2-D). FSDP alone (no TP or EP, torch kernels; fp8 or
   not, full or LoRA fine-tuning or neither) builds on the meta device, converts to
   float8 there (step 4) or adds LoRA adapters there (step 3), shards, then materializes
   only this rank's rows of each parameter from the replayed single-device init
   (:func:`build_fsdp_on_meta`); a fine-tune then reads only its rows of each base
   tensor over them and draws its adapters' rows from their seeded init (step 4, after
   the sharding here), so no device holds the whole model; the other FSDP layouts still
   build the whole (TP shard of the) model first.
7. **compile** last, around the DDP/FSDP module: dynamo's DDP optimizer then splits the
   graph at the gradient buckets so that communication still overlaps the backward.
   With ``parallel.async_tensor_parallel`` (set up first, before anything compiles)
   Inductor also fuses the sequence-parallel collectives into the TP matmuls
   (:func:`enable_async_tensor_parallel`).

The kernel backend (``model.backend``: torch | te | auto) chooses the layers' kernels only;
:func:`~training.models.kernel_backend_name` settles ``auto`` for the run's precision and
width, :func:`~training.models.resolve_backend` builds it and the sharding backends wrap it
(:func:`~training.parallel.te_tensor_parallel.tensor_parallel_backend` picks TE's own
tensor-parallel modules for ``te``). What cannot be combined yet is refused before any
process starts, in :mod:`training.parallel.support`.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch._inductor.config as inductor_config
import torch.distributed._symmetric_memory as symmetric_memory
from torch import nn

from megalith.config import LoRAConfig, MegalithConfig, MixedPrecisionConfig, ModelConfig
from megalith.errors import MegalithError
from training import models
from training.families.spec import ModelFamily
from training.finetune.lora import add_adapters, is_adapter_param
from training.finetune.session import FineTune
from training.models import kernel_backend_name, resolve_backend, slow_backend_warning
from training.models.layers import cache_rope_tables
from training.parallel import context_parallel as cp
from training.parallel import data_parallel as dp
from training.parallel import expert_parallel_training as ep
from training.parallel.groups import ParallelState
from training.parallel.meta_init import MaterializeStats, materialize_shard
from training.parallel.pipeline import PipelineParallel
from training.parallel.shard_specs import assemble, model_specs
from training.parallel.te_tensor_parallel import (
    CommOverlap,
    comm_overlap,
    initialize_comm_overlap,
)
from training.precision.fp8 import check_device, prepare_fp8
from training.precision.mixed import Precision

logger = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """This rank's model as the trainer uses it."""

    model: nn.Module  # the parameters, state dict and optimizer target (unwrapped)
    dp_model: nn.Module  # DDP/FSDP around ``model`` (or ``model``)
    forward_model: nn.Module  # what a step calls: ``dp_model``, compiled when asked
    pipeline: PipelineParallel | None  # this rank's stages and their schedule


def parallelize(
    config: MegalithConfig,
    model_config: ModelConfig,
    state: ParallelState,
    device: torch.device,
    precision: Precision,
    family: ModelFamily,
    finetune: FineTune | None = None,
) -> ParallelModel:
    """This rank's model of ``model_config``, sharded and wrapped in the order the module
    docstring gives."""
    backend = kernel_backend_name(model_config, config.mixed_precision)  # auto: torch or te
    warning = slow_backend_warning(model_config, config.mixed_precision)
    if warning and state.rank == 0:
        logger.warning(warning)
    model_config = model_config.model_copy(update={"backend": backend})
    if config.parallel.async_tensor_parallel:
        enable_async_tensor_parallel(state, device, model_config)
    overlap = enable_comm_overlap(config, model_config, state, device, precision)
    if state.sizes.pp > 1:  # gradients are averaged after the schedule, not by DDP
        pipeline = PipelineParallel(config, model_config, state, device, precision, family.pipeline)
        # The stage chunks share the stage model's blocks: converting it converts them.
        prepare_fp8(pipeline.model, config.mixed_precision, precision, not _fsdp(config, state))
        if finetune is not None:  # this stage's layers of the base, before the optimizer
            finetune.prepare(pipeline.model, state)
        if _fsdp(config, state):
            pipeline.shard_data_parallel()
        return ParallelModel(pipeline.model, pipeline.model, pipeline.model, pipeline)
    if _fsdp_builds_on_meta(config, model_config, state):
        lora = finetune.lora if finetune is not None else None
        model, _ = build_fsdp_on_meta(
            model_config, state, device, config.mixed_precision, precision, lora
        )
        if finetune is not None:  # the base's rows over the replayed init's, adapters' rows
            finetune.prepare(model, state)
        forward_model = _compiled(model, config, device) if config.training.compile else model
        return ParallelModel(model, model, forward_model, None)
    sequence_parallel = config.parallel.sequence_parallel
    model = ep.build_model(model_config, state, sequence_parallel, device, overlap)
    # Same parameters, new linears.
    prepare_fp8(model, config.mixed_precision, precision, not _fsdp(config, state))
    if finetune is not None:  # base weights and adapters: before DDP and the optimizer
        finetune.prepare(model, state)
    ep.exclude_experts_from_ddp(model, state)
    if _fsdp(config, state):
        ep.shard_experts(model, state)  # their own FSDP units, before the blocks'
    dp_model = dp.wrap_model(model, state, config.parallel, device)
    forward_model = _compiled(dp_model, config, device) if config.training.compile else dp_model
    return ParallelModel(model, dp_model, forward_model, None)


def _fsdp(config: MegalithConfig, state: ParallelState) -> bool:
    """Whether FSDP shards the parameters over data-parallel ranks."""
    return config.parallel.data_parallel_mode == "fsdp" and dp.data_parallel_size(state) > 1


def _compiled(model: nn.Module, config: MegalithConfig, device: torch.device) -> nn.Module:
    cache_rope_tables(model, config.data.seq_length, device)
    mode = config.training.compile_mode
    return torch.compile(model, backend=config.training.compile_backend, mode=mode)


def enable_async_tensor_parallel(
    state: ParallelState, device: torch.device, model_config: ModelConfig
) -> None:
    """Turn on Inductor's micro-pipelined TP for what this process compiles: each
    all-gather -> matmul and matmul -> reduce-scatter of the sequence-parallel linears
    (:mod:`training.parallel.tensor_parallel.mappings`) becomes a fused op that moves one
    shard while it multiplies another, over symmetric memory. ``support`` has checked the
    settings; the device and the resolved kernel backend are known only here."""
    if device.type != "cuda":
        raise MegalithError(
            f"parallel.async_tensor_parallel needs CUDA; this rank runs on {device}"
        )
    if resolve_backend(model_config.backend).name == "te":
        raise MegalithError(
            "parallel.async_tensor_parallel with model.backend resolving to te: TE overlaps its "
            "own TP communication; set model.backend=torch"
        )
    group = state.tp_group
    assert group is not None
    name = group.group_name
    if not symmetric_memory.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():  # deprecated, and a no-op, from torch 2.13
            warnings.simplefilter("ignore", FutureWarning)
            symmetric_memory.enable_symm_mem_for_group(name)
    inductor_config._micro_pipeline_tp = True


def enable_comm_overlap(
    config: MegalithConfig,
    model_config: ModelConfig,
    state: ParallelState,
    device: torch.device,
    precision: Precision,
) -> CommOverlap | None:
    """Allocate TE's userbuffers for ``parallel.tp_comm_overlap`` (None when off), before
    any engine is built; ``support`` has checked the settings, the device and the
    resolved kernel backend are known only here."""
    overlap = comm_overlap(config, model_config, state.sizes)
    if overlap is None:
        return None
    if device.type != "cuda":
        raise MegalithError(
            f"parallel.tp_comm_overlap needs CUDA and Transformer Engine; this rank runs on {device}"
        )
    kernels = resolve_backend(model_config.backend)  # te (support), and importable here
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        logger.warning(
            "parallel.tp_comm_overlap: CUDA_DEVICE_MAX_CONNECTIONS is not 1 in this process "
            "(megalith train sets it; set it before CUDA starts when building the Trainer "
            "yourself): TE's collectives may queue behind the GEMMs they should overlap"
        )
    initialize_comm_overlap(
        kernels.te(), overlap, state.sizes.tp, config.mixed_precision.fp8, precision.dtype
    )
    return overlap


def _fsdp_builds_on_meta(
    config: MegalithConfig,
    model_config: ModelConfig,
    state: ParallelState,
) -> bool:
    """Whether this rank's FSDP model is built on meta (the layouts whose materialization
    is wired and tested so far). Either kernel backend: TE's modules own the torch
    backend's parameters and init (their engines are built on the first CUDA forward)."""
    return _fsdp(config, state) and state.sizes.tp == 1 and state.sizes.ep == 1


def build_fsdp_on_meta(
    model_config: ModelConfig,
    state: ParallelState,
    device: torch.device,
    mixed_precision: MixedPrecisionConfig | None = None,
    precision: Precision | None = None,
    lora: LoRAConfig | None = None,
) -> tuple[nn.Module, MaterializeStats]:
    """The model built on meta, its linears made float8 when ``mixed_precision.fp8`` asks
    (torchao keeps the parameters, so the replay fills them alike), sharded by FSDP2, then
    each parameter's local rows materialized from a replay of the single-device init: the
    weights and the RNG state after equal one process's, and at most one whole parameter
    exists at a time.

    With ``lora``, adapters are added on meta (the base frozen) before the sharding and
    left uninitialised: the fine-tune fills their rows (:meth:`FineTune.prepare`). They
    share their block's FSDP unit with the frozen base weights: FSDP2 reduce-scatters only
    the gradients that exist and requires one dtype of the trainable parameters alone, so
    a unit may mix frozen and trainable ones, and the adapters' rows are all-gathered
    with the weights they adapt (no second all-gather per block, none replicated)."""
    backend = cp.wrap_backend(resolve_backend(model_config.backend), state)
    model = models.meta_model(model_config, backend)  # shapes only: the replay initializes
    ep.balance_over_context(model, state)
    if mixed_precision is not None and mixed_precision.fp8:
        check_device(device)  # prepare_fp8 sees meta parameters, not the device
        prepare_fp8(model, mixed_precision, precision)
    if lora is not None:
        add_adapters(model, lora)
    dp.shard_model(model, state)
    model.to_empty(device=device)
    specs = model_specs(model, state)
    params = dict(model.named_parameters())
    stats = materialize_shard(
        lambda: models.build_model(model_config, backend),
        model,
        lambda name, whole: assemble(specs[name], whole, params[name]),
        elsewhere=is_adapter_param,
    )
    return model, stats
