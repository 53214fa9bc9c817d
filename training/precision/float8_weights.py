"""Float8 weights cast once a step, not in every forward and backward
(``mixed_precision.fp8_weight_cache``, torchao's tensorwise recipe).

A torchao ``Float8Linear`` under ``torch.compile`` reads its fp32 weight three times a
micro-batch: for the weight's absolute maximum, to cast it for the forward matmul, and
(the partitioner keeps only the scale) to cast it again for the input-gradient matmul.
The weights change only at the optimizer step, so :class:`CachedWeightFloat8Linear` takes
its float8 weight from buffers that :meth:`Float8WeightCache.refresh` fills once a step:
the same amax, scale and saturated cast as torchao's (its own functions), so the
matmuls see the same bits. Backward reuses the forward's float8 weight (torchao keeps a
float8 operand as it is) and the weight gradient goes to the fp32 parameter as before.

The cache must be refreshed after every change of the weights and before the next
forward: the trainer refreshes at the start of each step and of each evaluation, which
covers initialization, a resumed checkpoint and the optimizer. Not used where the weights
are DTensors (FSDP: its all-gathers move the fp32 shards) or in the tensor-parallel
linears (their own float8 matmul).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torchao.float8.config import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import (
    Float8TrainingTensor,
    GemmInputRole,
    LinearMMConfig,
)
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

from training.precision.gated_fp8 import FLOAT8, casts_once


def caches_weights(config: Float8LinearConfig) -> bool:
    """Whether the recipe casts a weight once, dynamic tensorwise float8_e4m3fn, for both
    matmuls that read it (the forward and the input gradient)."""
    return casts_once(config.cast_config_weight, config.cast_config_weight_for_grad_input, FLOAT8)


class _CachedWeight(torch.autograd.Function):
    """Forward: the cached float8 weight (transposed, as torchao passes it) in place of
    ``weight_t``; backward: the gradient to ``weight_t`` unchanged (as torchao's own cast)."""

    @staticmethod
    def forward(
        ctx, weight_t: Tensor, data: Tensor, scale: Tensor, mm_config: LinearMMConfig
    ) -> Tensor:
        return Float8TrainingTensor(
            data.t(), scale, weight_t.dtype, mm_config, GemmInputRole.WEIGHT
        )

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return grad, None, None, None


class CachedWeightFloat8Linear(Float8Linear):
    """torchao's ``Float8Linear`` whose float8 weight comes from the ``weight_float8`` and
    ``weight_scale`` buffers (not saved in the state dict)."""

    def forward(self, input: Tensor) -> Tensor:
        if torch.is_autocast_enabled():
            input = input.to(torch.get_autocast_gpu_dtype())
        weight_t = _CachedWeight.apply(
            self.weight.t(), self.weight_float8, self.weight_scale, self.linear_mm_config
        )
        output = matmul_with_hp_or_float8_args.apply(
            input, weight_t, self.linear_mm_config, self.config
        )
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    @classmethod
    def from_linear(cls, linear: Float8Linear) -> CachedWeightFloat8Linear:
        """The same module with the cache buffers, on its device. The class is swapped in
        place, so the parameters stay the objects the optimizer and checkpoints name."""
        linear.__class__ = cls
        weight = linear.weight
        empty = torch.empty(weight.shape, dtype=FLOAT8, device=weight.device)
        linear.register_buffer("weight_float8", empty, persistent=False)
        linear.register_buffer(
            "weight_scale", torch.ones((), device=weight.device), persistent=False
        )
        return linear


class Float8WeightCache:
    """The cached linears of a model and the refresh that fills their buffers."""

    def __init__(self, linears: list[CachedWeightFloat8Linear], compiled: bool) -> None:
        self.linears = linears
        self._cast: Callable[..., None] = torch.compile(_cast_all) if compiled else _cast_all

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast every weight as torchao would now (call after the weights change)."""
        if self.linears:
            self._cast(
                [m.weight for m in self.linears],
                [m.weight_float8 for m in self.linears],
                [m.weight_scale for m in self.linears],
                [m.config.round_scales_to_power_of_2 for m in self.linears],
            )


def _cast_all(
    weights: list[Tensor], datas: list[Tensor], scales: list[Tensor], round_scales: list[bool]
) -> None:
    for weight, data, scale, round_scale in zip(weights, datas, scales, round_scales, strict=True):
        new_scale = tensor_to_scale(weight, FLOAT8, round_scales_to_power_of_2=round_scale)
        scale.copy_(new_scale)
        data.copy_(to_fp8_saturated(weight.to(torch.float32) * new_scale, FLOAT8))


def cache_weights(model: nn.Module, compiled: bool) -> Float8WeightCache:
    """Make every plain-weighted ``Float8Linear`` of ``model`` whose recipe allows it
    (:func:`caches_weights`) take its float8 weight from a cache; the cache."""
    linears = [
        CachedWeightFloat8Linear.from_linear(m)
        for m in model.modules()
        if type(m) is Float8Linear
        and caches_weights(m.config)
        and type(m.weight) in (Tensor, nn.Parameter)
        and m.weight.device.type != "meta"
    ]
    return Float8WeightCache(linears, compiled)
