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
import torch.nn.functional as F
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


class RankDropout(nn.Module):
    """Dropout with masks independent across the ranks of ``group`` (for activations
    that differ across them, such as sequence shards)."""

    def __init__(self, p: float, group: ProcessGroup):
        super().__init__()
        self.p = p
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        with rank_forked_rng(dist.get_rank(self.group), x.device):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class RankForkedAttention(nn.Module):
    """Core attention whose dropout masks are independent across the ranks of ``group``
    (each rank attends with different heads)."""

    def __init__(self, attention: nn.Module, group: ProcessGroup):
        super().__init__()
        self.attention = attention
        self.group = group

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.training or not getattr(self.attention, "dropout", 0.0):
            return self.attention(q, k, v)
        with rank_forked_rng(dist.get_rank(self.group), q.device):
            return self.attention(q, k, v)
