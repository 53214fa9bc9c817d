"""The ``torch.distributed.pipelining`` schedule over this rank's stage chunks.

Apart from :mod:`training.parallel.pipeline` because importing
``torch.distributed.pipelining`` imports dynamo, which costs every process that imports
the trainer about 1.6 s of CPU; only pipeline-parallel runs import this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from training.parallel.groups import ParallelState


class BusyClock(Protocol):
    def span(self) -> AbstractContextManager[None]: ...


class TimedStage(PipelineStage):
    """A PipelineStage that adds its forward and backward time to a busy clock."""

    def __init__(self, *args, busy: BusyClock, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = busy

    def forward_one_chunk(self, *args, **kwargs):
        with self.busy.span():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.busy.span():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.busy.span():
            return super().backward_weight_one_chunk(*args, **kwargs)


def build_schedule(
    chunks: Sequence[nn.Module],
    virtual_stages: Sequence[int],
    num_virtual: int,
    device: torch.device,
    state: ParallelState,
    busy: BusyClock,
    micro_batches: int,
    loss: Callable[[Tensor, Tensor], Tensor],
    schedule: str,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """1F1B with one stage per rank, interleaved 1F1B with virtual stages, or the
    interleaved zero-bubble schedule (``parallel.pipeline_schedule=zero-bubble``)."""
    stages = [
        TimedStage(chunk, stage, num_virtual, device, group=state.pp_group, busy=busy)
        for stage, chunk in zip(virtual_stages, chunks, strict=True)
    ]
    # scale_grads=False: the loss is already divided by the micro-batch count.
    if schedule == "zero-bubble":
        return ScheduleInterleavedZeroBubble(stages, micro_batches, loss, scale_grads=False)
    if state.sizes.vpp == 1:
        return Schedule1F1B(stages[0], micro_batches, loss, scale_grads=False)
    return ScheduleInterleaved1F1B(stages, micro_batches, loss, scale_grads=False)
