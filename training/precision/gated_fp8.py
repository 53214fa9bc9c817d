"""The gated MLP's float8 casts made by the gated activation itself (SwiGLU/GeGLU between
torchao ``Float8Linear`` layers with tensorwise scaling): ``fc2``'s float8 input forward,
``fc1``'s float8 output gradient backward.

torchao casts a linear's input in three passes: the activation writes ``act(gate) * up``
in bf16, a reduction reads it back for its absolute maximum, a pointwise kernel reads it
again to scale and cast it; in backward the saved bf16 input is cast once more for the
weight gradient. Inductor fuses the first two into the producer when the producer is its
own code, but the gated activation is a Triton op of ours
(:mod:`training.models.gated_grad`), so at Llama 1B the bare amax alone took 5.4 ms of a
182 ms fp8 step (H200 profile, benchmarks/RESULTS.md). Here two passes over ``[gate; up]``
replace all of that: one takes each block's absolute maximum of the product rounded to
the input's dtype, the other recomputes the product and writes it scaled to float8. The
result is the ``Float8TrainingTensor`` torchao would have made (same amax, scale and
rounding), which ``Float8Linear`` takes as already cast and keeps for its weight
gradient, so no bf16 product is written or saved.

Backward, the same for ``fc1``'s output gradient ``[dgate; dup]`` when ``fc1`` is a
``Float8Linear`` too: torchao would cast the gated backward's bf16 result (a write, a
read for its amax, a read to cast it); two passes over ``[gate; up]`` and the incoming
gradient (block amax, then the scaled float8_e5m2 cast) give the float8 gradient that
``fc1``'s backward takes as already cast for its input and weight gradients.

On the CPU (tests) the ops run torch's own arithmetic: the plain gated activation or its
backward, then torchao's cast.

Imported only with fp8 on (torchao is optional): :func:`training.precision.fp8.prepare_fp8`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torchao.float8.config import (
    CastConfig,
    Float8LinearConfig,
    ScalingGranularity,
    ScalingType,
)
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_ops import implements
from torchao.float8.float8_training_tensor import (
    Float8TrainingTensor,
    GemmInputRole,
    LinearMMConfig,
)
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

from training.models import gated_grad
from training.models.gpt import MLP
from training.models.layers import NormLinear, geglu, swiglu

FLOAT8 = torch.float8_e4m3fn  # torchao's tensorwise input dtype
FLOAT8_GRAD = torch.float8_e5m2  # and its gradients' dtype
ACTIVATION_NAMES = {swiglu: "silu", geglu: "gelu_tanh"}
triton = gated_grad.triton


def arm_gated_mlps(model: nn.Module, config: Float8LinearConfig) -> list[str]:
    """Give every gated MLP whose ``fc2`` is a ``Float8Linear`` an activation that returns
    ``fc2``'s float8 input (:class:`GatedFloat8`); returns the MLPs' names. Only where the
    input's cast is dynamic, tensorwise float8_e4m3fn and the same for the weight gradient
    (torchao then reuses the forward's cast there, as this does)."""
    if not reuses_tensorwise_input(config):
        return []
    armed = []
    for name, module in model.named_modules():
        if not isinstance(module, MLP) or not isinstance(module.fc2, Float8Linear):
            continue
        activation = ACTIVATION_NAMES.get(module.activation)
        if activation is not None:
            fc1 = _linear_of(module.fc1)
            casts_grad = isinstance(fc1, Float8Linear) and fc1.bias is None
            casts_grad = casts_grad and reuses_tensorwise_grad(config)
            module.activation = GatedFloat8(
                activation, module.fc2, module.fc1 if casts_grad else None
            )
            armed.append(name)
    return armed


def reuses_tensorwise_input(config: Float8LinearConfig) -> bool:
    """The input cast once, dynamic tensorwise float8_e4m3fn, for the forward matmul and
    the weight gradient."""
    return casts_once(config.cast_config_input, config.cast_config_input_for_grad_weight, FLOAT8)


def reuses_tensorwise_grad(config: Float8LinearConfig) -> bool:
    """The output gradient cast once, dynamic tensorwise float8_e5m2, for both of the
    linear's backward matmuls."""
    grad, for_grad_weight = (
        config.cast_config_grad_output,
        config.cast_config_grad_output_for_grad_weight,
    )
    return casts_once(grad, for_grad_weight, FLOAT8_GRAD)


def casts_once(cast: CastConfig, second_use: CastConfig, dtype: torch.dtype) -> bool:
    """Whether ``cast`` is dynamic, tensorwise, to ``dtype``, and ``second_use`` the same
    (so one cast serves both matmuls)."""
    return (
        cast.scaling_type is ScalingType.DYNAMIC
        and cast.scaling_granularity is ScalingGranularity.TENSORWISE
        and cast.target_dtype == dtype
        and second_use == cast
    )


class GatedFloat8:
    """``act(gate) * up`` as ``fc2``'s float8 input; the plain activation where autograd is
    off (evaluation, inference), the input is a DTensor, or a hook on ``fc2`` sees its
    input too (a LoRA adapter's: it multiplies the input in bf16). With ``fc1`` (a
    ``Float8Linear`` without bias, alone or after a norm) its output gradient comes back
    in float8 too, unless a hook on it (LoRA's) would take that gradient as well."""

    def __init__(self, activation: str, fc2: Float8Linear, fc1: nn.Module | None = None):
        self.activation = activation
        self.fc2 = fc2  # not submodules: the MLP holds them already
        self.fc1 = fc1
        self.mm_config: LinearMMConfig = fc2.linear_mm_config
        # One conversion config for both linears: its scale rounding serves both casts.
        self.round_scales = fc2.config.round_scales_to_power_of_2
        if fc1 is not None:
            self.grad_mm_config: LinearMMConfig = _linear_of(fc1).linear_mm_config
        self.__name__ = f"{activation}_to_float8"  # MLP reads its activation's name

    def __call__(self, x: Tensor) -> Tensor:
        usable = x.requires_grad and torch.is_grad_enabled() and not isinstance(x, DTensor)
        if not usable or _hooked(self.fc2):
            return gated_grad.gated(x, self.activation)
        grad_mm_config = None
        if self.fc1 is not None and not any(_hooked(m) for m in self.fc1.modules()):
            grad_mm_config = self.grad_mm_config
        return _GatedToFloat8.apply(
            x, self.activation, self.mm_config, self.round_scales, grad_mm_config
        )


def _linear_of(fc1: nn.Module) -> nn.Module:
    return fc1.linear if isinstance(fc1, NormLinear) else fc1


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


class _GatedToFloat8(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        activation: str,
        mm_config: LinearMMConfig,
        round_scales: bool,
        grad_mm_config: LinearMMConfig | None,
    ) -> Tensor:
        ctx.save_for_backward(x)
        ctx.activation, ctx.round_scales = activation, round_scales
        ctx.grad_mm_config = grad_mm_config
        amax = gated_amax(x, activation)
        scale = amax_to_scale(amax, FLOAT8, round_scales)
        data = gated_to_float8(x, activation, scale)
        return Float8TrainingTensor(data, scale, x.dtype, mm_config, GemmInputRole.INPUT)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        (x,) = ctx.saved_tensors
        if ctx.grad_mm_config is None:
            return gated_grad.gated_backward(x, grad, ctx.activation), None, None, None, None
        data, scale = gated_backward_to_float8(x, grad, ctx.activation, ctx.round_scales)
        role = GemmInputRole.GRAD_OUTPUT
        dx = Float8TrainingTensor(data, scale, x.dtype, ctx.grad_mm_config, role)
        return dx, None, None, None, None


@implements([torch.ops.megalith.gated_backward.default])
def _gated_backward_of_a_float8_gradient(op, args, kwargs=None) -> Tensor:
    """Dynamo traces an autograd.Function's backward with gradients shaped like its
    outputs, here a ``Float8TrainingTensor``; the gradient that arrives at run time is
    torchao's plain input gradient. So the op takes such a gradient in its original
    precision, and the traced backward is the one call for both."""
    x, grad, activation = args
    return op(x, _plain(grad), activation)


def _plain(grad: Tensor) -> Tensor:
    return grad._data.to(grad._orig_dtype) / grad._scale


@torch.library.custom_op("megalith::gated_amax", mutates_args=())
def gated_amax(x: Tensor, activation: str) -> Tensor:
    """``max |act(gate) * up|`` (fp32 scalar) of the product in ``x``'s dtype."""
    if x.is_cuda and triton is not None:
        return _kernel_amax(x, activation)
    return gated_grad.gated_reference(x, activation).abs().max().float()


@gated_amax.register_fake
def _(x: Tensor, activation: str) -> Tensor:
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("megalith::gated_to_float8", mutates_args=())
def gated_to_float8(x: Tensor, activation: str, scale: Tensor) -> Tensor:
    """``act(gate) * up`` in ``x``'s dtype, times ``scale``, saturated to float8_e4m3fn."""
    if x.is_cuda and triton is not None:
        return _kernel_to_float8(x, activation, scale)
    product = gated_grad.gated_reference(x, activation)
    return to_fp8_saturated(product.float() * scale, FLOAT8)


@gated_to_float8.register_fake
def _(x: Tensor, activation: str, scale: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], x.size(-1) // 2, dtype=FLOAT8)


@torch.library.custom_op("megalith::gated_backward_to_float8", mutates_args=())
def gated_backward_to_float8(
    x: Tensor, grad: Tensor, activation: str, round_scales: bool
) -> tuple[Tensor, Tensor]:
    """``[dgate; dup]`` (the gated backward's result, in ``x``'s dtype) cast as torchao
    casts an output gradient: float8_e5m2 data, saturated, and its fp32 tensorwise scale."""
    if x.is_cuda and triton is not None:
        return _kernel_backward_to_float8(x, grad, activation, round_scales)
    dx = gated_grad.gated_backward(x, grad, activation)
    scale = amax_to_scale(dx.abs().max().float(), FLOAT8_GRAD, round_scales)
    return to_fp8_saturated(dx.float() * scale, FLOAT8_GRAD), scale


@gated_backward_to_float8.register_fake
def _(x: Tensor, grad: Tensor, activation: str, round_scales: bool) -> tuple[Tensor, Tensor]:
    data = torch.empty_like(x, dtype=FLOAT8_GRAD, memory_format=torch.contiguous_format)
    return data, x.new_empty((), dtype=torch.float32)


@implements([torch.ops.megalith.gated_backward_to_float8.default])
def _float8_gradient_of_a_float8_gradient(op, args, kwargs=None) -> tuple[Tensor, Tensor]:
    """As :func:`_gated_backward_of_a_float8_gradient`, for the float8-gradient op."""
    x, grad, activation, round_scales = args
    return op(x, _plain(grad), activation, round_scales)


def _grid(x: Tensor, block: int) -> tuple[int, int, int]:
    """``(rows, column blocks, width)`` of the programs over ``x = [gate; up]``."""
    width = x.size(-1) // 2
    rows = x.numel() // (2 * width) if width else 0
    return rows, triton.cdiv(width, block) if width else 0, width


def _kernel_amax(x: Tensor, activation: str, block: int = 1024) -> Tensor:
    x = x.contiguous()
    rows, blocks, width = _grid(x, block)
    if not rows:
        return x.new_zeros((), dtype=torch.float32)
    partial = x.new_empty(rows, blocks, dtype=torch.float32)
    _gated_amax_kernel[(rows, blocks)](
        x, partial, width, ACTIVATION=gated_grad.ACTIVATIONS.index(activation), BLOCK=block
    )
    return partial.max()


def _kernel_to_float8(x: Tensor, activation: str, scale: Tensor, block: int = 1024) -> Tensor:
    x = x.contiguous()
    rows, blocks, width = _grid(x, block)
    out = x.new_empty(*x.shape[:-1], width, dtype=FLOAT8)
    if rows:
        _gated_to_float8_kernel[(rows, blocks)](
            x, scale, out, width, ACTIVATION=gated_grad.ACTIVATIONS.index(activation),
            BLOCK=block, FLOAT8_MAX=torch.finfo(FLOAT8).max,
        )  # fmt: skip
    return out


def _kernel_backward_to_float8(
    x: Tensor, grad: Tensor, activation: str, round_scales: bool, block: int = 1024
) -> tuple[Tensor, Tensor]:
    x, grad = x.contiguous(), grad.contiguous()
    rows, blocks, width = _grid(x, block)
    data = torch.empty_like(x, dtype=FLOAT8_GRAD, memory_format=torch.contiguous_format)
    if not rows:
        return data, amax_to_scale(x.new_zeros((), dtype=torch.float32), FLOAT8_GRAD)
    kind = gated_grad.ACTIVATIONS.index(activation)
    partial = x.new_empty(rows, blocks, dtype=torch.float32)
    _gated_grad_amax_kernel[(rows, blocks)](x, grad, partial, width, ACTIVATION=kind, BLOCK=block)
    scale = amax_to_scale(partial.max(), FLOAT8_GRAD, round_scales)
    _gated_grad_to_float8_kernel[(rows, blocks)](
        x, grad, scale, data, width, ACTIVATION=kind, BLOCK=block,
        FLOAT8_MAX=torch.finfo(FLOAT8_GRAD).max,
    )  # fmt: skip
    return data, scale


if triton is not None:
    import triton.language as tl

    from training.models.gated_grad import activation_and_slope, this_block

    @triton.jit
    def _rounded_product(X, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
        """This program's block of ``act(gate) * up``, rounded to ``X``'s dtype as the
        plain forward op stores it, back in fp32; its row, columns and their mask."""
        row, cols, ok, gate, up = this_block(X, width, BLOCK)
        act, _ = activation_and_slope(gate, ACTIVATION)
        product = (act * up).to(X.dtype.element_ty).to(tl.float32)
        return row, cols, ok, product

    @triton.jit
    def _gated_amax_kernel(X, PARTIAL, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
        row, cols, ok, product = _rounded_product(X, width, ACTIVATION, BLOCK)
        block_max = tl.max(tl.where(ok, tl.abs(product), 0.0), axis=0)
        tl.store(PARTIAL + row * tl.num_programs(1) + tl.program_id(1), block_max)

    @triton.jit
    def _gated_to_float8_kernel(
        X, SCALE, OUT, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
        FLOAT8_MAX: tl.constexpr,
    ):  # fmt: skip
        row, cols, ok, product = _rounded_product(X, width, ACTIVATION, BLOCK)
        scaled = tl.clamp(product * tl.load(SCALE), -FLOAT8_MAX, FLOAT8_MAX)
        tl.store(OUT + row * width + cols, scaled.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rounded_gradients(X, GRAD, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
        """This program's block of ``dgate`` and ``dup``, rounded to ``X``'s dtype as the
        plain backward op stores them, back in fp32; its row, columns and their mask."""
        row, cols, ok, gate, up = this_block(X, width, BLOCK)
        grad = tl.load(GRAD + row * width + cols, mask=ok, other=0.0).to(tl.float32)
        act, slope = activation_and_slope(gate, ACTIVATION)
        dgate = (grad * up * slope).to(X.dtype.element_ty).to(tl.float32)
        dup = (grad * act).to(X.dtype.element_ty).to(tl.float32)
        return row, cols, ok, dgate, dup

    @triton.jit
    def _gated_grad_amax_kernel(
        X, GRAD, PARTIAL, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr
    ):
        row, cols, ok, dgate, dup = _rounded_gradients(X, GRAD, width, ACTIVATION, BLOCK)
        both = tl.maximum(tl.abs(dgate), tl.abs(dup))
        block_max = tl.max(tl.where(ok, both, 0.0), axis=0)
        tl.store(PARTIAL + row * tl.num_programs(1) + tl.program_id(1), block_max)

    @triton.jit
    def _gated_grad_to_float8_kernel(
        X, GRAD, SCALE, OUT, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
        FLOAT8_MAX: tl.constexpr,
    ):  # fmt: skip
        row, cols, ok, dgate, dup = _rounded_gradients(X, GRAD, width, ACTIVATION, BLOCK)
        scale = tl.load(SCALE)
        out_at = OUT + row * 2 * width + cols
        dgate = tl.clamp(dgate * scale, -FLOAT8_MAX, FLOAT8_MAX)
        tl.store(out_at, dgate.to(OUT.dtype.element_ty), mask=ok)
        dup = tl.clamp(dup * scale, -FLOAT8_MAX, FLOAT8_MAX)
        tl.store(out_at + width, dup.to(OUT.dtype.element_ty), mask=ok)
