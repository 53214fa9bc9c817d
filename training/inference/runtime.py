"""Where and in what precision inference (evaluation, serving) runs."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto``: bf16 autocast on CUDA, fp32 on CPU (as in training)."""
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if name not in AUTOCAST_DTYPES:
        raise ValueError(f"precision {name!r} is not one of auto, {', '.join(AUTOCAST_DTYPES)}")
    return name


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype``, or nothing for ``None`` (full precision)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
