"""Which dtypes a model really computed in: the precision tests assert them."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def module_output_dtypes() -> Iterator[dict[str, set[torch.dtype]]]:
    """The dtypes of the tensors each module class returned while the block ran."""
    seen: dict[str, set[torch.dtype]] = defaultdict(set)

    def record(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            seen[type(module).__name__].add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()
