"""A training step's metrics while its work is still queued on the GPU.

Reading a loss with ``.item()`` waits for everything queued on the stream, so a loop
that reads each step's loss before launching the next leaves the GPU idle while the
host prepares that next step. :class:`PendingMetrics` copies the step's scalars to
pinned host memory behind the step's own kernels and records an event there;
:meth:`PendingMetrics.result` waits for that event alone, so the host can launch step
``k + 1`` before it reads step ``k`` (torchtitan and Megatron keep the host one step
ahead the same way). On the CPU the values are ready at once.
"""

from __future__ import annotations

import torch
from torch import Tensor


class PendingMetrics:
    """Scalars (tensors or plain numbers) readable once the step that made them is done."""

    def __init__(self, values: dict[str, Tensor | float]):
        self._values: dict[str, Tensor | float] = {}
        self._ready: torch.cuda.Event | None = None
        for name, value in values.items():
            if isinstance(value, Tensor):
                value = value.detach()
                if value.is_cuda:
                    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    value = host.copy_(value, non_blocking=True)
                    if self._ready is None:
                        self._ready = torch.cuda.Event()
            self._values[name] = value
        if self._ready is not None:
            self._ready.record()

    def result(self) -> dict[str, float]:
        """The values as floats; waits for the copies, not for later work on the GPU."""
        if self._ready is not None:
            self._ready.synchronize()
        return {
            name: value.item() if isinstance(value, Tensor) else value
            for name, value in self._values.items()
        }
