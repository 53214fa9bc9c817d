"""Where and in what precision inference (evaluation, serving) runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

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


def autocast(
    device: torch.device, dtype: torch.dtype | None, *, cache: bool = True
) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype``, or nothing for ``None`` (full precision). ``cache``
    False: no cache of cast weights (a CUDA graph capture must not keep one)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


# cuDNN's attention builds a new plan for every new key length (about 4 ms a call on an
# H100 with torch 2.11, more than a whole decode step of a 1B model), and a decode loop's
# key length changes every step: decoding uses the other kernels.
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def decoding(
    device: torch.device, dtype: torch.dtype | None, *, cache: bool = True
) -> Iterator[None]:
    """:func:`autocast`, and on CUDA attention without cuDNN's kernel (``DECODE_ATTENTION``).
    The kernel choice is process-wide while it lasts (``sdpa_kernel``): two decode loops at
    once (a reload) may leave it either way, which changes speed, not results."""
    kernels = sdpa_kernel(DECODE_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()
    with autocast(device, dtype, cache=cache), kernels:
        yield
