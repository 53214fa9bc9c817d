"""Attention with a learned bias shared by the whole batch (T5's relative positions), as
one custom op for CUDA: torch's fused attention kernels for the output and for the
gradients of queries, keys and values, and :func:`bias_grad.bias_grad` for the bias's
gradient summed over the batch in one pass.

Through ``F.scaled_dot_product_attention`` such a bias must be expanded to ``[B, heads, T,
S]``, only the memory-efficient kernel takes it with a gradient, and it writes that
gradient for every sample before autograd sums it. The op is opaque to ``torch.compile``
(no graph break) and is used only where :func:`usable` says it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from training.models import bias_grad

# Which of torch's fused kernels computes the output and dq, dk, dv (the bias is an input
# to both, without a gradient): "cudnn" or "efficient" (memory-efficient).
KERNELS = ("cudnn", "efficient")
_kernel = "cudnn"


def set_kernel(name: str) -> None:
    """Choose the fused kernel behind the op (benchmarks compare them)."""
    global _kernel
    if name not in KERNELS:
        raise ValueError(f"shared-bias attention kernel must be one of {KERNELS}, got {name!r}")
    _kernel = name


# Below this many scores a head (T · S) the op lost to SDPA with the bias broadcast: at
# T5-base's decoder, 114 × 114, 1.09-1.55 ms against 0.68-0.76 (H100, three calls of
# benchmarks/shared_bias_attention.py, 2026-11-28); its encoder, 512 × 512, takes the op.
MIN_SCORES = 256 * 256


def usable(q: Tensor, bias: Tensor) -> bool:
    """The op runs (and pays for) these ``q [B, heads, T, D]`` and ``bias [1, heads, T,
    S]``: CUDA, bf16/fp16, the bias in the queries' dtype, a head size the bias kernel
    takes, at least :data:`MIN_SCORES` scores a head."""
    return (
        q.is_cuda
        and bias.size(-2) * bias.size(-1) >= MIN_SCORES
        and q.dtype in (torch.bfloat16, torch.float16)
        and bias.dtype == q.dtype
        and bias.dim() == 4
        and bias.size(0) == 1
        and bias_grad.kernel_available(q)
    )


def shared_bias_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, *, scale: float) -> Tensor:
    """``softmax(scale·q kᵀ + bias) v`` for ``q [B, heads, T, D]``, ``k, v [B, heads, S,
    D]``, ``bias [1, heads, T, S]`` (a mask folded in as the most negative value)."""
    out, _ = torch.ops.megalith.shared_bias_attention(q, k, v, bias, scale)
    return out


def _aligned(bias: Tensor, batch: int) -> Tensor:
    """``bias`` expanded over the batch, its rows padded to a multiple of 16 elements
    (the memory-efficient kernel's alignment; SDPA pads masks the same way)."""
    keys = bias.size(-1)
    pad = -keys % 16
    if pad:
        bias = F.pad(bias, (0, pad))[..., :keys]
    elif bias.stride(-1) != 1:  # T5's bias arrives permuted from its [T, S, heads] gather
        bias = bias.contiguous()
    return bias.expand(batch, -1, -1, -1)


def _heads_inside(x: Tensor) -> Tensor:
    """``x [B, heads, T, D]`` laid out as ``[B, T, heads, D]`` (as the model reads the
    attention's output back): one fixed layout, so the fake kernels can state it."""
    if x.transpose(1, 2).is_contiguous():
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_heads_inside(like: Tensor) -> Tensor:
    batch, heads, length, head_dim = like.shape
    return like.new_empty(batch, length, heads, head_dim).transpose(1, 2)


def _dropout_state(device: torch.device) -> tuple[Tensor, Tensor]:
    # Without dropout the kernels never read the philox seed and offset.
    empty = torch.empty((), dtype=torch.int64, device=device)
    return empty, empty


@torch.library.custom_op("megalith::shared_bias_attention", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    mask = _aligned(bias, q.size(0))
    if _kernel == "cudnn":
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, True, 0.0, False, False, scale=scale
        )
    else:
        result = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, False, scale=scale
        )
    return _heads_inside(result[0]), result[1].contiguous()


@_forward.register_fake
def _(q, k, v, bias, scale):
    batch, heads, queries = q.shape[:3]
    # The kernel's own log-sum-exp layout: cuDNN [B, heads, T, 1]; memory-efficient
    # [B, heads, T rounded up to 32].
    shape = (
        (batch, heads, queries, 1) if _kernel == "cudnn" else (batch, heads, -(-queries // 32) * 32)
    )
    return _empty_heads_inside(q), q.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("megalith::shared_bias_attention_backward", mutates_args=())
def _backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grad_out = _heads_inside(grad_out)  # the output's layout, as the kernels expect
    mask = _aligned(bias, q.size(0))
    seed, offset = _dropout_state(q.device)
    if _kernel == "cudnn":
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, seed, offset, mask, None, None,
            q.size(2), k.size(2), 0.0, False, scale=scale,
        )  # fmt: skip
    else:
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, mask, out, lse, seed, offset, 0.0,
            [True, True, True, False], False, scale=scale,
        )  # fmt: skip
    rows_lse = lse.reshape(q.size(0), q.size(1), -1)[..., : q.size(2)]
    grad_bias = bias_grad.bias_grad(q, k, v, out, grad_out, rows_lse, bias[0], scale=scale)
    dq, dk, dv = (_heads_inside(g) for g in grads[:3])
    # In the bias's own layout, as the fake kernel's empty_like states it.
    grad_bias = grad_bias[None]
    if grad_bias.stride() != bias.stride():
        grad_bias = torch.empty_like(bias).copy_(grad_bias)
    return dq, dk, dv, grad_bias


@_backward.register_fake
def _(grad_out, q, k, v, bias, out, lse, scale):
    grads = (_empty_heads_inside(t) for t in (q, k, v))
    return *grads, torch.empty_like(bias)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, out, lse)
    ctx.scale = scale


def _autograd_backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, bias, out, lse = ctx.saved_tensors
    grads = _backward(grad_out, q, k, v, bias, out, lse, ctx.scale)
    return *grads, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)
