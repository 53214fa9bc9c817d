"""DTensor and FSDP2 questions answered without importing them where they are not used.

Importing ``torch.distributed.tensor`` (``torch.distributed.fsdp`` imports it too) costs
about a second of CPU in every process, most of it sympy. Runs without FSDP never create
a DTensor, so "is this a DTensor / an FSDP module?" is answered from ``sys.modules``: when
the module has not been imported, nothing can be an instance of its classes. The FSDP code
path imports ``torch.distributed.fsdp`` itself (``data_parallel.shard_model``).
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def is_fsdp_module(value: object) -> bool:
    """Whether ``value`` is a module that ``fully_shard`` wrapped."""
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(value, module.FSDPModule)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective over its mesh); any other tensor as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor
