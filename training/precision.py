"""Mixed precision: bf16 autocast, fp16 with dynamic loss scaling, or fp32."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

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


def resolve_precision(config: MixedPrecisionConfig, device: torch.device) -> Precision:
    name = config.dtype
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    scaler = None
    if name == "fp16":
        scaler = torch.amp.GradScaler(
            device.type,
            init_scale=config.initial_loss_scale,
            growth_interval=config.loss_scale_growth_interval,
        )
    return Precision(name=name, device_type=device.type, scaler=scaler)
