"""Dropout randomness across model-parallel ranks.

Every rank is seeded alike, so tensor-parallel peers draw the same dropout masks on
the residual stream they all hold (they must: it is one tensor, replicated). Where
peers hold *different* activations (their attention heads; their sequence shards
under sequence parallelism), the same masks would repeat one pattern across heads
or tokens; Megatron forks a per-rank RNG there, from a tracker of named RNG states.

Here a forked region draws one seed from the default generator, identical on every
peer, mixes the rank into it and runs on that for its duration. Compared with a
tracker of saved states:

- the default stream advances by the same draw on every peer, so it stays in step;
- activation checkpointing restores the default RNG state before recomputing a block,
  so the recomputation redraws the same seed and the same masks;
- nothing extra goes into checkpoints: the default RNG state (already saved) fixes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

_SEED_BOUND = 2**31 - 1
_MIX = 1_000_003  # a prime: seeds of different ranks never collide for one draw


@contextlib.contextmanager
def rank_forked_rng(rank: int, device: torch.device) -> Iterator[None]:
    """Run the body on an RNG stream of its own for ``rank``, derived from the default one."""
    seed = int(torch.randint(_SEED_BOUND, (1,)).item())  # the default CPU generator
    forked = seed * _MIX + rank
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.random.default_generator.manual_seed(forked)
        if device.type == "cuda":
            torch.cuda.manual_seed(forked)
        yield


class RankForked(nn.Module):
    """``module`` run, while training, on an RNG stream of this rank's own in ``group``:
    for dropout on activations that differ across the group's ranks (their heads, their
    sequence parts). Forks nest: inside another group's fork the stream is unique to the
    pair of ranks."""

    def __init__(self, module: nn.Module, group: ProcessGroup, random: bool):
        super().__init__()
        self.module = module
        self.group = group
        self.random = random

    def forward(self, x: Tensor, *args: Tensor) -> Tensor:
        if not (self.training and self.random):
            return self.module(x, *args)
        with rank_forked_rng(dist.get_rank(self.group), x.device):
            return self.module(x, *args)


def rank_dropout(p: float, group: ProcessGroup) -> nn.Module:
    """Dropout whose masks are independent across the ranks of ``group``."""
    return RankForked(nn.Dropout(p), group, random=p > 0.0)
