"""Output layer and cross-entropy fused, chunk by chunk, without the whole fp32 logits.

The plain head computes ``logits = hidden @ W^T`` for every token, casts them to fp32
and takes the cross-entropy: for the ~1B recipe at micro-batch 8 (16,384 tokens, a
32,000-piece vocabulary) that is 1 GiB of bf16 logits, 2 GiB in fp32 and 2 GiB more
for their gradient. Here the tokens go through in chunks of ``chunk_tokens``; each
chunk's logits live only while its loss and its gradients (with respect to the hidden
states and to ``W``) are computed, in the forward pass. The loss is the last operation
of the step, so its incoming gradient is a scalar: backward only scales the stored
gradients. No matmul is added (the Liger-Kernel approach, in plain PyTorch).

Numerics follow the plain head under autocast: matmuls in the autocast dtype, the
softmax and loss in fp32; ``W``'s gradient is accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(weight: Tensor) -> torch.dtype:
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, ignore_index: int
    ) -> Tensor:
        dtype = _compute_dtype(weight)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        count = (labels != ignore_index).sum()
        scale = 1.0 / count.clamp(min=1).float()
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.size(0), chunk_tokens):
                h = hidden[start : start + chunk_tokens].to(dtype)
                target = labels[start : start + chunk_tokens]
                logits = (h @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                valid = target != ignore_index
                picked = target.clamp(min=0).unsqueeze(1)
                total += ((lse - logits.gather(1, picked).squeeze(1)) * valid).sum()
                if not (want_hidden or want_weight):
                    continue
                grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                grad.scatter_add_(1, picked, torch.full_like(grad[:, :1], -1.0))
                grad = (grad * (valid.unsqueeze(1) * scale)).to(dtype)
                if want_hidden:
                    grad_hidden[start : start + chunk_tokens] = grad @ w
                if want_weight:
                    grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        # The mean of no labels at all is NaN, as in F.cross_entropy.
        return total / count.float()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, ignore_index: int
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight^T`` against ``labels`` (``ignore_index``
    skipped), ``chunk_tokens`` tokens at a time; ``hidden [..., h]``, ``labels [...]``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    flat = hidden.reshape(-1, hidden.size(-1))
    return _LinearCrossEntropy.apply(flat, weight, labels.reshape(-1), chunk_tokens, ignore_index)
