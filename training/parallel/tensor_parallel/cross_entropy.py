"""Cross-entropy over logits whose vocabulary is split across tensor-parallel ranks.

Megatron's formulation: with the global maximum ``m`` (all-reduce MAX), the global
sum of ``exp(z - m)`` (all-reduce SUM) and the target's logit ``z_t - m`` (owned by
one rank, all-reduced SUM), the loss is ``log(sum exp(z - m)) - (z_t - m)``. The
gradient with respect to the local logits is ``softmax - onehot(target)`` restricted
to the local vocabulary range, so backward needs no communication. No rank ever holds
logits for the full vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from training.parallel.tensor_parallel.mappings import all_reduce

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group: ProcessGroup) -> Tensor:
        # logits [N, V/tp] (this rank's vocabulary range), labels [N] global ids or -100.
        local_vocab = logits.size(-1)
        vocab_start = dist.get_rank(group) * local_vocab
        logits_max = all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        in_range = (labels >= vocab_start) & (labels < vocab_start + local_vocab)
        local_labels = (labels - vocab_start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
        target_logit = all_reduce(target_logit * in_range, group)

        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        ignored = labels == IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_labels, in_range, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_labels, in_range, ignored = ctx.saved_tensors
        onehot = in_range.to(softmax.dtype).unsqueeze(-1)
        grad = softmax.scatter_add(-1, local_labels.unsqueeze(-1), -onehot)
        grad = grad * grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad, None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group: ProcessGroup) -> Tensor:
    """Per-token cross-entropy, shaped like ``labels`` and 0 where ``labels == -100``.

    ``logits [..., V/tp]`` are this rank's slice of the vocabulary (rank ``r`` holds ids
    ``r·V/tp .. (r+1)·V/tp - 1``); ``labels [...]`` are global ids, the same on every
    rank. The result is the same on every rank. Compute in fp32 (cast the logits).
    """
    losses = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), group
    )
    return losses.view(labels.shape)


__all__ = ["IGNORE_INDEX", "vocab_parallel_cross_entropy"]
