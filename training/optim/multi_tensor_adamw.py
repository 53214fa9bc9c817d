"""AdamW's update over every parameter of a group in one Triton kernel.

torch's fused AdamW reaches about 2.6 TB/s of an H200's 4.8 at the 1B shape
(``benchmarks/optimizer_step.py``): it walks the tensors in fixed chunks over several
launches. Here one launch covers a whole parameter group: a table of each tensor's four
addresses (parameter, gradient, both moments) and a list of blocks, each a tensor and an
offset into it, so every program streams one block of the seven fp32 streams (read p, g,
m, v; write p, m, v). The arithmetic is torch's fused kernel's, in fp32, in its order;
gradient clipping comes in as ``grad_scale``, a device scalar every gradient is divided
by, as in :func:`training.optim.adamw.step_with_clipping`.

The default on CUDA where every parameter is a plain fp32 tensor (``optimizer.multi_tensor``
turns it on or off): on an H200 at the 1B shape (benchmarks/RESULTS.md, 2026-11-28 late)
1,024-element blocks of 4 warps take 8.9 ms a step against torch's fused kernel's 11.7
(3.5 TB/s against 2.6), and the 1B step gains 1.6% in bf16 and fp8. Whole blocks move 16
bytes an access (its PTX is checked in the tests); the first, masked kernel's 4-byte
accesses took 18.6 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels ship without Triton
    triton = None

BLOCK = 1024  # elements a program (see the module docstring)
NUM_WARPS = 4


@dataclass(frozen=True)
class BlockTable:
    """Where one launch reads and writes: ``pointers [tensors, 4]`` (p, g, m, v addresses),
    ``numels [tensors]``, and per program its tensor and first element. The table holds
    addresses only: the caller keeps the tensors alive until the launch is queued (the
    allocator orders a later reuse after it); holding them here would keep each step's
    gradients alive into the next (4.2 GB more at the 1B shape, measured)."""

    sizes: tuple[int, ...]
    addresses: tuple[int, ...]
    pointers: Tensor
    numels: Tensor
    block_tensor: Tensor
    block_start: Tensor


def block_table(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor]
) -> BlockTable:
    """The table of one launch over these tensors (each contiguous fp32, on one device)."""
    numels = [p.numel() for p in params]
    blocks = [math.ceil(n / BLOCK) for n in numels]
    index = torch.repeat_interleave(torch.arange(len(params)), torch.tensor(blocks))
    first = torch.cat([torch.arange(b) * BLOCK for b in blocks])
    device = params[0].device
    return readdressed(
        BlockTable(
            sizes=tuple(numels),
            addresses=(),
            pointers=torch.empty(0),
            numels=_to_device(torch.tensor(numels, dtype=torch.int64), device),
            block_tensor=_to_device(index.to(torch.int32), device),
            block_start=_to_device(first.to(torch.int64), device),
        ),
        list(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)),
    )


def readdressed(table: BlockTable, streams: list[tuple[Tensor, ...]]) -> BlockTable:
    """``table`` over tensors of the same sizes at other addresses (gradients set to
    ``None`` and made again land wherever the allocator puts them): only the small address
    table is copied again, the block list stays."""
    addresses = addresses_of(streams)
    pointers = torch.tensor(addresses, dtype=torch.int64).view(-1, 4)
    return BlockTable(
        sizes=table.sizes,
        addresses=addresses,
        pointers=_to_device(pointers, streams[0][0].device),
        numels=table.numels,
        block_tensor=table.block_tensor,
        block_start=table.block_start,
    )


def addresses_of(streams: list[tuple[Tensor, ...]]) -> tuple[int, ...]:
    """The data addresses of each (p, g, m, v) in order."""
    return tuple(t.data_ptr() for group in streams for t in group)


def _to_device(values: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without waiting for the work queued there (a copy
    from pageable memory would wait for the stream to drain)."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def eligible(tensors: list[Tensor]) -> bool:
    """Whether the kernel can take these: contiguous fp32 CUDA tensors or parameters at
    16-byte aligned addresses (the kernel's vector loads), no tensor subclasses (a
    DTensor's address is not its data)."""
    return triton is not None and all(
        type(t) in (Tensor, torch.nn.Parameter)
        and t.is_cuda
        and t.dtype == torch.float32
        and t.is_contiguous()
        and t.data_ptr() % 16 == 0
        for t in tensors
    )


def adamw_update(
    table: BlockTable,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: Tensor | None,
) -> None:
    """One AdamW update, in place, of every tensor in ``table`` (step counted from 1)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    scale = grad_scale if grad_scale is not None else table.numels  # unread when absent
    grid = (table.block_tensor.numel(),)
    _adamw_kernel[grid](
        table.pointers,
        table.numels,
        table.block_tensor,
        table.block_start,
        scale,
        1.0 - lr * weight_decay,
        lr / bias_correction1,
        bias_correction2_sqrt,
        beta1,
        beta2,
        eps,
        HAS_GRAD_SCALE=grad_scale is not None,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        pointers,
        numels,
        block_tensor,
        block_start,
        grad_scale,
        decay_factor,
        step_size,
        bias_correction2_sqrt,
        beta1,
        beta2,
        eps,
        HAS_GRAD_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        tensor = tl.load(block_tensor + block).to(tl.int64)
        start = tl.multiple_of(tl.load(block_start + block), BLOCK)
        numel = tl.load(numels + tensor)
        # Addresses 16-byte aligned (``eligible``) and blocks whole: vector loads and stores.
        param_ptr = tl.multiple_of(
            tl.load(pointers + 4 * tensor).to(tl.pointer_type(tl.float32)), 16
        )
        grad_ptr = tl.multiple_of(
            tl.load(pointers + 4 * tensor + 1).to(tl.pointer_type(tl.float32)), 16
        )
        exp_avg_ptr = tl.multiple_of(
            tl.load(pointers + 4 * tensor + 2).to(tl.pointer_type(tl.float32)), 16
        )
        exp_avg_sq_ptr = tl.multiple_of(
            tl.load(pointers + 4 * tensor + 3).to(tl.pointer_type(tl.float32)), 16
        )
        scale = tl.load(grad_scale) if HAS_GRAD_SCALE else 1.0
        hyper = (decay_factor, step_size, bias_correction2_sqrt, beta1, beta2, eps)
        pointers_of = (param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr)
        if start + BLOCK <= numel:
            _adamw_block(pointers_of, start, numel, scale, hyper, HAS_GRAD_SCALE, False, BLOCK)
        else:  # the tensor's last, partial block
            _adamw_block(pointers_of, start, numel, scale, hyper, HAS_GRAD_SCALE, True, BLOCK)

    @triton.jit
    def _adamw_block(
        pointers_of,
        start,
        numel,
        scale,
        hyper,
        HAS_GRAD_SCALE: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr = pointers_of
        decay_factor, step_size, bias_correction2_sqrt, beta1, beta2, eps = hyper
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel if MASKED else None
        param = tl.load(param_ptr + offsets, mask=mask, eviction_policy="evict_first")
        grad = tl.load(grad_ptr + offsets, mask=mask, eviction_policy="evict_first")
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, eviction_policy="evict_first")
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, eviction_policy="evict_first")
        if HAS_GRAD_SCALE:
            grad = grad / scale
        param = param * decay_factor
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - step_size * (exp_avg / denom)
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)


class MultiTensorAdamW(torch.optim.AdamW):
    """torch's AdamW (the same hyperparameters, state and checkpoints) whose step runs
    :func:`adamw_update`, one launch a parameter group, where the tensors allow
    (:func:`eligible`); elsewhere torch's own step (foreach or single-tensor). Like the
    fused AdamW, it divides every gradient by ``self.grad_scale`` when set (the folded
    clipping of :func:`training.optim.adamw.step_with_clipping`). The step counts stay on
    the host, so the bias corrections cost no device sync."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, foreach=False, fused=False, **kwargs)
        self._tables: dict[int, BlockTable] = {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MultiTensorAdamW.step takes no closure")
        grad_scale = getattr(self, "grad_scale", None)
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if not self._update_group(index, group, params, grad_scale):
                self._fallback_group(group, params, grad_scale)
        return None

    def _update_group(
        self, index: int, group: dict, params: list[Tensor], grad_scale: Tensor | None
    ) -> bool:
        """One launch over ``params``; False where the kernel cannot take them."""
        if group["amsgrad"] or group["maximize"] or group["differentiable"]:
            return False
        states = [self._state_of(p) for p in params]
        moments = [s[key] for s in states for key in ("exp_avg", "exp_avg_sq")]
        if not eligible(params + [p.grad for p in params] + moments):
            return False
        steps = {float(s["step"]) for s in states}
        if len(steps) != 1:  # a parameter that missed steps: torch's per-tensor counts
            return False
        for state in states:
            state["step"] += 1
        streams = [
            (p, p.grad, s["exp_avg"], s["exp_avg_sq"]) for p, s in zip(params, states, strict=True)
        ]
        table = self._tables.get(index)
        if table is None or table.sizes != tuple(p.numel() for p in params):
            table = block_table(*(list(t) for t in zip(*streams, strict=True)))
        elif table.addresses != addresses_of(streams):
            table = readdressed(table, streams)
        self._tables[index] = table
        beta1, beta2 = group["betas"]
        adamw_update(
            table,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=int(steps.pop()) + 1,
            grad_scale=grad_scale,
        )
        return True

    def _state_of(self, param: Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif state["step"].device.type != "cpu":  # from a fused optimizer's checkpoint
            state["step"] = state["step"].cpu()
        return state

    def _fallback_group(self, group: dict, params: list[Tensor], grad_scale: Tensor | None) -> None:
        """torch's AdamW over this group, its foreach step where torch would pick it (FSDP's
        DTensors on CUDA), which takes no ``grad_scale``: the gradients are divided first."""
        if grad_scale is not None:
            torch._foreach_div_([p.grad for p in params], grad_scale)
        saved, self.param_groups = self.param_groups, [{**group, "foreach": None, "fused": None}]
        self.__dict__.pop("grad_scale", None)
        try:
            super().step()
        finally:
            self.param_groups = saved
            if grad_scale is not None:
                self.grad_scale = grad_scale
