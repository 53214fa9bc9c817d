"""The meta device without initialisation: :func:`shapes_only`.

On the meta device torch runs random initialisers (``normal_``, ``uniform_``) through its
Python reference implementations, about 2 ms per linear: seconds for a deep model, for
values a meta tensor does not hold. Memory planning, package and checkpoint checks and
the parallel layouts' gathers only need names, shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_INITIALISERS = {
    nn.init.normal_, nn.init.trunc_normal_, nn.init.uniform_, nn.init.constant_,
    nn.init.zeros_, nn.init.ones_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
    nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_,
}  # fmt: skip


class _SkipInitOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


@contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside are on the meta device, their initialisers not run."""
    with torch.device("meta"), _SkipInitOnMeta():
        yield
