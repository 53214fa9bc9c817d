"""Per-rank dropout streams (training.parallel.random), in one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from training.parallel.random import rank_forked_rng

CPU = torch.device("cpu")


def mask_then_next_draw(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As one TP peer: a forked dropout mask, then a draw from the default stream."""
    torch.manual_seed(7)
    with rank_forked_rng(rank, CPU):
        mask = F.dropout(torch.ones(64), 0.5, training=True)
    return mask, torch.rand(4)


def test_ranks_draw_different_masks_and_stay_in_step() -> None:
    mask0, after0 = mask_then_next_draw(0)
    mask1, after1 = mask_then_next_draw(1)
    assert not torch.equal(mask0, mask1), "two ranks drew the same dropout mask"
    assert torch.equal(mask0, mask_then_next_draw(0)[0]), "a rank's mask is not reproducible"
    assert torch.equal(after0, after1), "the default stream fell out of step across ranks"


class ForkedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with rank_forked_rng(1, x.device):
            return F.dropout(self.linear(x), 0.3, training=True).relu()


def test_activation_checkpointing_replays_the_forked_masks() -> None:
    block = ForkedBlock()
    x = torch.randn(4, 16, requires_grad=True)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(3)
        block.zero_grad()
        out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        out.square().sum().backward()
        grads.append(block.linear.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_nested_forks_give_every_pair_of_ranks_its_own_masks() -> None:
    """A CP fork around a TP fork: (cp, tp) rank pairs all draw different masks."""
    masks = []
    for cp_rank in range(2):
        for tp_rank in range(2):
            torch.manual_seed(11)
            with rank_forked_rng(cp_rank, CPU), rank_forked_rng(tp_rank, CPU):
                masks.append(F.dropout(torch.ones(256), 0.5, training=True))
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), f"rank pairs {i} and {j} share a mask"
