"""What autograd keeps for backward: the activation-memory tests assert it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def saved_for_backward() -> Iterator[list[torch.Tensor]]:
    """The tensors autograd saves for backward while the block runs (outside checkpointed
    regions: those keep their own), as zero-cost metadata copies (shape, dtype)."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def total_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
