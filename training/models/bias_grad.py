"""The gradient of an attention bias shared by the whole batch, summed over the batch in
one kernel: T5's relative position bias ``[heads, T, S]`` is added to every sample's
scores, so its gradient is ``sum over b of dS[b]``, where ``dS = P * (dO Vᵀ - D)`` is the
gradient of the scores (``P`` the attention probabilities, ``D`` the row sums of
``dO * O``).

SDPA's only CUDA kernel that returns a bias gradient (the memory-efficient one) writes
``dS`` for every sample, ``[B, heads, T, S]``, which autograd then reduces over the batch.
:func:`bias_grad` recomputes ``P`` and ``dO Vᵀ`` tile by tile and sums the batch in
registers, so nothing of size ``B·heads·T·S`` is written. A mask (the decoder's
causality) is part of the bias, as the model builds it: the most negative value makes
``P`` 0 there.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels ship without Triton
    triton = None


def bias_grad_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    bias: Tensor,
    *,
    scale: float,
) -> Tensor:
    """``dbias [heads, T, S]`` in plain torch, in fp32 (the definition the kernel follows).

    ``q, out, grad_out [B, heads, T, D]``, ``k, v [B, heads, S, D]``, ``lse [B, heads, T]``
    (natural log of each query's softmax denominator), ``bias [heads, T, S]``."""
    q, k, v, out, grad_out = (t.float() for t in (q, k, v, out, grad_out))
    scores = scale * q @ k.transpose(-1, -2) + bias.float()
    probs = torch.exp(scores - lse.float()[..., None])
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (grad_out @ v.transpose(-1, -2) - delta)
    return grad_scores.sum(0)


def kernel_available(q: Tensor) -> bool:
    """Triton can run :func:`bias_grad` for these queries: a CUDA tensor (or the Triton
    interpreter, ``TRITON_INTERPRET=1``, on CPU), head size a power of two from 16."""
    if triton is None:
        return False
    head_dim = q.size(-1)
    power_of_two = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return power_of_two and head_dim <= 128


def bias_grad(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    bias: Tensor,
    *,
    scale: float,
) -> Tensor:
    """:func:`bias_grad_reference`'s ``dbias`` by the Triton kernels, in ``bias``'s dtype."""
    batch, heads, queries, head_dim = q.shape
    keys = k.size(2)
    delta = _row_dots(out, grad_out)
    grad = torch.empty(heads, queries, keys, dtype=bias.dtype, device=q.device)

    def grid(meta):
        return triton.cdiv(queries, meta["BLOCK_M"]), triton.cdiv(keys, meta["BLOCK_N"]), heads

    _bias_grad_kernel[grid](
        q, k, v, grad_out, lse, delta, bias, grad,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(),
        *lse.stride(), *delta.stride(), *bias.stride(), *grad.stride(),
        queries, keys, scale,
        BATCH=batch, HEAD_DIM=head_dim,
    )  # fmt: skip
    return grad


def _row_dots(out: Tensor, grad_out: Tensor, block: int = 64) -> Tensor:
    """``D [B, heads, T]``, the row sums of ``dO * O`` in fp32: once per row here rather
    than once per key tile in the gradient's kernel."""
    batch, heads, queries, head_dim = out.shape
    delta = torch.empty(batch, heads, queries, dtype=torch.float32, device=out.device)
    _row_dot_kernel[(triton.cdiv(queries, block), batch * heads)](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), heads, queries,
        BLOCK=block, HEAD_DIM=head_dim,
    )  # fmt: skip
    return delta


def _tile_configs() -> list:
    """Tiles Triton times on first use at each shape (one under the CPU interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32})]
    shapes = [
        (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3),
        (64, 128, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
    ]  # fmt: skip
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in shapes
    ]


if triton is not None:
    # A [rows, HEAD_DIM] tile of one sample's head, zeros past the sequence.
    @triton.jit
    def _rows(base, rows, dims, row_stride, dim_stride, row_ok):
        pointers = base + rows[:, None] * row_stride + dims[None, :] * dim_stride
        return tl.load(pointers, mask=row_ok[:, None], other=0.0)

    @triton.jit
    def _row_dot_kernel(
        OUT, DO, DELTA, sob, soh, som, sod, sdob, sdoh, sdom, sdod, heads, queries,
        BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        sample, head = tl.program_id(1) // heads, tl.program_id(1) % heads
        dims = tl.arange(0, HEAD_DIM)
        ok = rows < queries
        out = _rows(OUT + sample * sob + head * soh, rows, dims, som, sod, ok)
        grad_out = _rows(DO + sample * sdob + head * sdoh, rows, dims, sdom, sdod, ok)
        dots = tl.sum(out.to(tl.float32) * grad_out.to(tl.float32), axis=1)
        tl.store(DELTA + tl.program_id(1) * queries + rows, dots, mask=ok)

    @triton.autotune(configs=_tile_configs(), key=["queries", "keys", "BATCH", "HEAD_DIM"])
    @triton.jit
    def _bias_grad_kernel(
        Q, K, V, DO, LSE, DELTA, BIAS, GRAD,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sdob, sdoh, sdom, sdod, slb, slh, slm, sdb, sdh, sdm,
        sbh, sbm, sbn, sgh, sgm, sgn,
        queries, keys, scale,
        BATCH: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # exp(x) as exp2(x · log2 e): the scores, the bias and the log-sum-exp scaled once
        # (a mask's most negative bias becomes -inf, so P is 0 there as before).
        log2e: tl.constexpr = 1.4426950408889634
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        head = tl.program_id(2)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < queries
        col_ok = cols < keys
        inside = row_ok[:, None] & col_ok[None, :]
        bias = tl.load(
            BIAS + head * sbh + rows[:, None] * sbm + cols[None, :] * sbn, mask=inside, other=0.0
        ).to(tl.float32)
        bias = bias * log2e
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Tiles past the sequence load zeros and are not stored, so nothing masks them here.
        for b in range(BATCH):
            q = _rows(Q + b * sqb + head * sqh, rows, dims, sqm, sqd, row_ok)
            grad_out = _rows(DO + b * sdob + head * sdoh, rows, dims, sdom, sdod, row_ok)
            k = _rows(K + b * skb + head * skh, cols, dims, skn, skd, col_ok)
            v = _rows(V + b * svb + head * svh, cols, dims, svn, svd, col_ok)
            lse = tl.load(LSE + b * slb + head * slh + rows * slm, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + b * sdb + head * sdh + rows * sdm, mask=row_ok, other=0.0)
            scores = tl.dot(q, tl.trans(k)) * (scale * log2e) + bias
            probs = tl.exp2(scores - lse[:, None] * log2e)
            grad_probs = tl.dot(grad_out, tl.trans(v))
            acc += probs * (grad_probs - delta[:, None])
        tl.store(
            GRAD + head * sgh + rows[:, None] * sgm + cols[None, :] * sgn,
            acc.to(GRAD.dtype.element_ty),
            mask=inside,
        )
