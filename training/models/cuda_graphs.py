"""CUDA graphs over the transformer blocks (``training.cuda_graphs``).

Transformer Engine's modules cost the host 0.7-1.6 ms per call, so at the 7B layer
shape one GPU waits for the host 130 ms of a 565 ms step, and a tensor-parallel rank,
with half the GPU work and all of the host's, 128 of 365 (benchmarks/RESULTS.md,
"Transformer Engine's communication overlap"). :func:`capture_block_graphs` records
each block's forward and backward once, before training, with Transformer Engine's
``make_graphed_callables`` (what Megatron-core's ``cuda_graph`` uses); every training
micro-batch then replays them: one launch per block and direction.

A replay runs exactly what the capture saw: the micro-batch's shape, the parameter
tensors (the optimizer and checkpoint loading update them in place), the fp8 recipe, the
tensor-parallel collectives. Any other forward (validation without gradients, eval mode,
a KV cache, a packed-documents mask, another shape) runs the block as it is. What the
graphs cannot hold at all is refused before any process starts
(:func:`training.parallel.support.cuda_graph_problems`).

The capture runs backward passes over the blocks, so it comes before DDP attaches its
gradient hooks (:func:`training.parallel.parallelize.parallelize`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from training.precision.mixed import Precision

logger = logging.getLogger(__name__)

Rope = tuple[Tensor, Tensor] | None


class BlockCall(nn.Module):
    """``block(x, rope)`` with tensors only as arguments: what the capture records."""

    def __init__(self, block: nn.Module, eager_forward: Callable[..., Tensor]):
        super().__init__()
        self.block = block
        self.eager_forward = eager_forward

    def forward(self, x: Tensor, *rope: Tensor) -> Tensor:
        return self.eager_forward(x, tuple(rope) if rope else None)


class GraphedForward:
    """A block's ``forward``: the replayed graphs for a training micro-batch shaped like
    the capture's, the block's own forward for anything else."""

    def __init__(self, block: nn.Module, graphed: nn.Module, sample: Tensor, rope: Rope):
        self.block, self.graphed = block, graphed
        self.eager_forward = graphed.eager_forward
        self.shape, self.dtype = sample.shape, sample.dtype
        self.rope_shapes = None if rope is None else tuple(t.shape for t in rope)
        self.warned = False
        self.replays_run = 0

    def __call__(
        self,
        x: Tensor,
        rope: Rope,
        kv_cache: Any = None,
        start_pos: int = 0,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        if self.replays(x, rope, kv_cache, start_pos, attn_mask):
            self.replays_run += 1
            return self.graphed(x, *(rope or ()))
        return self.eager_forward(x, rope, kv_cache, start_pos, attn_mask)

    def replays(
        self, x: Tensor, rope: Rope, kv_cache: Any, start_pos: int, attn_mask: Tensor | None
    ) -> bool:
        """Whether this call is the captured one: a training forward of the same shapes."""
        if not (torch.is_grad_enabled() and self.block.training):
            return False
        same = (
            kv_cache is None
            and attn_mask is None
            and start_pos == 0
            and x.shape == self.shape
            and x.dtype == self.dtype
            and (None if rope is None else tuple(t.shape for t in rope)) == self.rope_shapes
        )
        if not same and not self.warned:
            self.warned = True
            logger.warning(
                "training.cuda_graphs: a training forward of shape %s (captured: %s, with a "
                "mask or cache: %s) runs without the graphs",
                tuple(x.shape),
                tuple(self.shape),
                attn_mask is not None or kv_cache is not None,
            )
        return same


def capture_block_graphs(
    model: nn.Module,
    te: Any,
    micro_batch_size: int,
    seq_length: int,
    precision: Precision,
    fp8_recipe: Any = None,
) -> int:
    """Capture every block of ``model`` (this rank's, on CUDA) for training micro-batches of
    ``micro_batch_size x seq_length`` tokens and make the blocks replay them; returns how
    many. ``te``: the ``transformer_engine.pytorch`` namespace; ``fp8_recipe``: TE's recipe
    object when the blocks run in fp8. The model's ``block_inputs`` says what its blocks
    receive."""
    blocks = list(model.transformer_blocks())
    with precision.autocast():
        hidden, rope = model.block_inputs(micro_batch_size, seq_length)
    calls = tuple(BlockCall(block, block.forward) for block in blocks)
    samples = tuple((hidden.detach().clone().requires_grad_(True), *(rope or ())) for _ in calls)
    with _capture_context(precision):
        te.make_graphed_callables(calls, samples, enabled=fp8_recipe is not None, recipe=fp8_recipe)
    for block, call in zip(blocks, calls, strict=True):
        block.forward = GraphedForward(block, call, hidden, rope)
    logger.info(
        "training.cuda_graphs: %d blocks captured for micro-batches of shape %s",
        len(blocks),
        tuple(hidden.shape),
    )
    return len(blocks)


def _capture_context(precision: Precision) -> contextlib.AbstractContextManager:
    """The forward's autocast without its weight-cast cache (a cache entry would outlive
    the capture), and its attention kernel order; TE enters fp8 itself."""
    stack = contextlib.ExitStack()
    if precision.name != "fp32":
        stack.enter_context(
            torch.autocast(precision.device_type, dtype=precision.dtype, cache_enabled=False)
        )
    if precision.attention_context is not None:
        stack.enter_context(precision.attention_context())
    return stack


__all__ = ["BlockCall", "GraphedForward", "capture_block_graphs"]
