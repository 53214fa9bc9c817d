"""Mixed precision: bf16 autocast, fp16 with dynamic loss scaling, or fp32; float8
matmuls on top of bf16 come from :mod:`training.precision.fp8`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalith.config import MixedPrecisionConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Precision:
    name: str
    device_type: str
    scaler: torch.amp.GradScaler | None
    # Entered inside autocast around every forward (Transformer Engine's fp8 autocast);
    # set by training.precision.fp8.prepare_fp8 after the model is built.
    fp8_context: Callable[[], contextlib.AbstractContextManager] | None = None
    # The SDPA kernel order (model.attention_backend), entered around every forward too:
    # the forward's kernel choice fixes the backward's, and torch.compile traces under it.
    attention_context: Callable[[], contextlib.AbstractContextManager] | None = None
    # Casts the weights' float8 copies again (mixed_precision.fp8_weight_cache): called
    # after the weights change, before the next forward; set by prepare_fp8.
    refresh_fp8_weights: Callable[[], None] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        extras = [c for c in (self.fp8_context, self.attention_context) if c is not None]
        if self.name == "fp32" and not extras:
            return contextlib.nullcontext()
        if not extras:
            return torch.autocast(self.device_type, dtype=self.dtype)
        return self._autocast_with(extras)

    @contextlib.contextmanager
    def _autocast_with(self, extras: list[Callable[[], contextlib.AbstractContextManager]]):
        with contextlib.ExitStack() as stack:
            if self.name != "fp32":
                stack.enter_context(torch.autocast(self.device_type, dtype=self.dtype))
            for context in extras:
                stack.enter_context(context())
            yield


class AgreedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow check is agreed by every rank of the job.

    Tensor- and pipeline-parallel ranks, and FSDP's data-parallel ranks, hold different
    gradient shards, so an inf in one shard must skip the step (and shrink the scale) on
    every rank, or the ranks' weights and loss scales drift apart. The check is a
    one-element MAX all-reduce. (FSDP's gradients are DTensors, whose unscale already
    reduces the check over their shards: tests/test_precision.py.)
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        for found in per_device.values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return per_device


def resolve_precision(config: MixedPrecisionConfig, device: torch.device) -> Precision:
    """The precision to train in; under torch.distributed the fp16 scaler agrees over all ranks.
    ``auto`` is bf16 on CUDA and, with ``fp8`` (float8 matmuls need bf16 around them),
    on CPU too; fp32 otherwise."""
    name = config.dtype
    if name == "auto":
        name = "bf16" if device.type == "cuda" or config.fp8 else "fp32"
    scaler = None
    if name == "fp16":
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        scaler_class = AgreedGradScaler if distributed else torch.amp.GradScaler
        scaler = scaler_class(
            device.type,
            init_scale=config.initial_loss_scale,
            growth_interval=config.loss_scale_growth_interval,
        )
    return Precision(name=name, device_type=device.type, scaler=scaler)
