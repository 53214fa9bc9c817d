"""Which device a stage runs on."""

from __future__ import annotations

import torch

from megalith.errors import MegalithError


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU; otherwise any device name torch accepts."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MegalithError(f"device {name!r} was asked for, but no CUDA GPU is available")
    return device
