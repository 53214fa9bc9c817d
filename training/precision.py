"""Mixed precision: bf16 autocast, fp16 with dynamic loss scaling, or fp32."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.config import MixedPrecisionConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Precision:
    name: str
    device_type: str
    scaler: torch.amp.GradScaler | None

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


class AgreedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow check is agreed by every rank of the job.

    Tensor- and pipeline-parallel ranks hold different gradient shards, so an inf in
    one shard must skip the step (and shrink the scale) on every rank, or the ranks'
    weights and loss scales drift apart. The check is a one-element MAX all-reduce.
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        for found in per_device.values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return per_device


def resolve_precision(config: MixedPrecisionConfig, device: torch.device) -> Precision:
    """The precision to train in; under torch.distributed the fp16 scaler agrees over all ranks."""
    name = config.dtype
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
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
