"""fc2's float8 input made by the gated activation (training/precision/gated_fp8.py): the
same Float8TrainingTensor, outputs and weight gradients as torchao's own casts of the
plain activation, on the CPU (the ops' torch bodies), under torch.compile, through the
Triton kernels in Triton's interpreter, and armed by the fp8 conversion only where
torchao's recipe reuses the input's cast. On a GPU: ``tests/test_gpu.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from triton_helpers import count_calls, run_in_interpreter

float8 = pytest.importorskip("torchao.float8")

from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import (  # noqa: E402
    Float8TrainingTensor,
    GemmInputRole,
)

from training.models import gated_grad  # noqa: E402
from training.models.layers import swiglu  # noqa: E402
from training.precision import gated_fp8  # noqa: E402
from training.precision.fp8 import convert_linears, torchao_config  # noqa: E402

WIDTH, OUT, ROWS, HIDDEN = 32, 16, 48, 16  # float8 matmuls need dimensions divisible by 16


def fc2_pair(seed: int = 0) -> tuple[Float8Linear, Float8Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(WIDTH, OUT, bias=False)
    config = torchao_config("tensorwise")
    return (
        Float8Linear.from_float(copy.deepcopy(linear), config=config),
        Float8Linear.from_float(copy.deepcopy(linear), config=config),
    )


def inputs(seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return (torch.randn(ROWS, 2 * WIDTH) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("activation", gated_grad.ACTIVATIONS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_float8_input_is_torchaos_cast_of_the_activation(
    activation: str, compiled: bool
) -> None:
    """``fc2(GatedFloat8(x))`` against ``fc2(act(gate) * up)`` with torchao casting: the
    same float8 data and scale, the same output and weight gradient to the bit (the input
    for the weight gradient is the forward's cast in both), and the input gradient of the
    gated backward op."""
    plain_fc2, fc2 = fc2_pair()
    x = inputs()
    reference_x, armed_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    armed = gated_fp8.GatedFloat8(activation, fc2)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return plain_fc2(gated_grad.gated_reference(x, activation))

    def ours(x: torch.Tensor) -> torch.Tensor:
        return fc2(armed(x))

    if compiled:
        plain, ours = (torch.compile(f, backend="aot_eager", fullgraph=True) for f in (plain, ours))
    expected, got = plain(reference_x), ours(armed_x)
    assert torch.equal(got, expected)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    assert torch.equal(fc2.weight.grad, plain_fc2.weight.grad)
    torch.testing.assert_close(armed_x.grad, reference_x.grad)

    cast = armed(x.clone().requires_grad_(True))
    assert isinstance(cast, Float8TrainingTensor) and cast._data.dtype == torch.float8_e4m3fn
    torchaos = hp_tensor_to_float8_dynamic(
        gated_grad.gated_reference(x, activation), torch.float8_e4m3fn, fc2.linear_mm_config
    )
    assert torch.equal(cast._scale, torchaos._scale)
    assert torch.equal(cast._data.view(torch.uint8), torchaos._data.view(torch.uint8))


def fc1_pair(seed: int = 2) -> tuple[Float8Linear, Float8Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(HIDDEN, 2 * WIDTH, bias=False)
    config = torchao_config("tensorwise")
    return tuple(Float8Linear.from_float(copy.deepcopy(linear), config=config) for _ in "ab")


def hidden(seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(ROWS, HIDDEN).to(torch.bfloat16)


@pytest.mark.parametrize("activation", gated_grad.ACTIVATIONS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fc1s_output_gradient_comes_back_as_torchaos_float8_cast(
    activation: str, compiled: bool
) -> None:
    """``fc2(GatedFloat8(fc1(h)))`` with ``fc1`` armed: its output gradient reaches
    ``fc1``'s backward already in float8 (``gated_backward_to_float8``, the data and scale
    torchao casts from the gated backward's result), and the output and every gradient
    (both weights', the input's) are those of torchao casting the plain MLP."""
    (plain_fc1, fc1), (plain_fc2, fc2) = fc1_pair(), fc2_pair()
    armed = gated_fp8.GatedFloat8(activation, fc2, fc1)
    h = hidden()
    leaves = h.clone().requires_grad_(True), h.clone().requires_grad_(True)

    def plain(h: torch.Tensor) -> torch.Tensor:
        return plain_fc2(gated_grad.gated_reference(plain_fc1(h), activation))

    arrived: list[type] = []

    def ours(h: torch.Tensor) -> torch.Tensor:
        x = fc1(h)
        if not compiled:
            x.register_hook(lambda grad: arrived.append(type(grad)))
        return fc2(armed(x))

    if compiled:
        plain, ours = (torch.compile(f, backend="aot_eager", fullgraph=True) for f in (plain, ours))
    expected, got = plain(leaves[0]), ours(leaves[1])
    assert torch.equal(got, expected)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    assert torch.equal(fc2.weight.grad, plain_fc2.weight.grad)
    assert torch.equal(fc1.weight.grad, plain_fc1.weight.grad)
    assert torch.equal(leaves[1].grad, leaves[0].grad)
    assert arrived == ([] if compiled else [Float8TrainingTensor])

    x = fc1(h).detach()
    upstream = torch.randn(ROWS, WIDTH).to(torch.bfloat16)
    data, scale = gated_fp8.gated_backward_to_float8(x, upstream, activation, False)
    torchaos = hp_tensor_to_float8_dynamic(
        gated_grad.gated_backward(x, upstream, activation), torch.float8_e5m2,
        fc1.linear_mm_config, gemm_input_role=GemmInputRole.GRAD_OUTPUT,
    )  # fmt: skip
    assert data.dtype == torch.float8_e5m2 and torch.equal(scale, torchaos._scale)
    assert torch.equal(data.view(torch.uint8), torchaos._data.view(torch.uint8))


def test_a_hook_on_fc1_gets_its_gradient_in_bf16() -> None:
    """A hook on ``fc1`` (a LoRA adapter's) adds a branch that also takes ``fc1``'s output
    gradient, which only torchao's linear takes in float8: the gradient then stays bf16
    and every gradient is the plain MLP's."""
    (plain_fc1, fc1), (plain_fc2, fc2) = fc1_pair(), fc2_pair()
    torch.manual_seed(4)
    adapter = nn.Linear(HIDDEN, 2 * WIDTH, bias=False).to(torch.bfloat16)
    for linear in (plain_fc1, fc1):
        linear.register_forward_hook(lambda module, args, out: out + adapter(args[0]))
    armed = gated_fp8.GatedFloat8("silu", fc2, fc1)
    h = hidden()
    leaves = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    expected = plain_fc2(gated_grad.gated_reference(plain_fc1(leaves[0]), "silu"))
    x = fc1(leaves[1])
    arrived: list[type] = []
    x.register_hook(lambda grad: arrived.append(type(grad)))
    got = fc2(armed(x))
    grad = torch.randn_like(expected)
    expected.backward(grad)
    adapter_grad, adapter.weight.grad = adapter.weight.grad, None
    got.backward(grad)
    assert arrived == [torch.Tensor]
    assert torch.equal(adapter.weight.grad, adapter_grad)
    assert torch.equal(fc1.weight.grad, plain_fc1.weight.grad)
    assert torch.equal(leaves[1].grad, leaves[0].grad)


def test_without_autograd_the_activation_stays_plain() -> None:
    """Evaluation and inference (no gradient) take the plain activation: no float8 tensor
    leaves the MLP where nothing will differentiate it."""
    _, fc2 = fc2_pair()
    armed = gated_fp8.GatedFloat8("silu", fc2)
    x = inputs()
    with torch.no_grad():
        assert torch.equal(armed(x), gated_grad.gated(x, "silu"))
    assert not isinstance(armed(x), Float8TrainingTensor)  # x needs no gradient


@pytest.mark.parametrize(("recipe", "armed"), [("tensorwise", True), ("rowwise", False)])
def test_the_fp8_conversion_arms_every_gated_mlp_where_the_recipe_reuses_the_cast(
    recipe: str, armed: bool
) -> None:
    """Tensorwise casts the input once for the forward and the weight gradient: every
    gated MLP is armed and the model's loss and gradients are torchao's own. Rowwise
    scales differ per use: nothing is armed."""
    from test_model import build, tiny, tokens

    config = tiny(hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=1)
    reference, model = build(config), build(config)
    convert_linears(reference, recipe)
    convert_linears(model, recipe)
    mlps = [block.mlp for block in model.transformer_blocks()]
    assert all(isinstance(m.activation, gated_fp8.GatedFloat8) == armed for m in mlps)
    if not armed:
        return
    for block in reference.transformer_blocks():
        block.mlp.activation = swiglu  # disarmed: torchao casts the plain activation
    x = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = reference(x, x), model(x, x)
    assert torch.equal(got, expected)
    expected.backward()
    got.backward()
    for (name, a), (_, b) in zip(
        reference.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


CHECK = """
import torch
from training.models import gated_grad
from training.precision import gated_fp8
from torchao.float8.float8_utils import amax_to_scale

for activation in gated_grad.ACTIVATIONS:
    torch.manual_seed(0)
    x = (torch.randn(5, 2 * 1100) * 3).to(torch.bfloat16)  # two column blocks, the second partial
    product = gated_grad._kernel_forward(x, activation).float()
    amax = gated_fp8._kernel_amax(x, activation)
    assert torch.equal(amax, product.abs().max()), (amax, product.abs().max())
    scale = amax_to_scale(amax, torch.float8_e4m3fn) * 4  # some values saturate
    # The interpreter's own float8 conversion is not the GPU's (it rounds ties away and
    # can lose an exponent): the kernel writes fp32 here, the GPU test checks the cast.
    scaled = torch.empty_like(product)
    gated_fp8._gated_to_float8_kernel[(5, 2)](
        x, scale, scaled, 1100, ACTIVATION=gated_grad.ACTIVATIONS.index(activation),
        BLOCK=1024, FLOAT8_MAX=448.0,
    )
    assert torch.equal(scaled, (product * scale).clamp(-448, 448))
    assert scaled.abs().max() == 448

    grad = torch.randn(5, 1100).to(torch.bfloat16)
    dx = gated_grad._kernel_backward(x, grad, activation).float()
    kind = gated_grad.ACTIVATIONS.index(activation)
    partial = torch.empty(5, 2)
    gated_fp8._gated_grad_amax_kernel[(5, 2)](x, grad, partial, 1100, ACTIVATION=kind, BLOCK=1024)
    assert torch.equal(partial.max(), dx.abs().max()), (partial.max(), dx.abs().max())
    scale = amax_to_scale(partial.max(), torch.float8_e5m2) * 4
    scaled = torch.empty_like(dx)
    gated_fp8._gated_grad_to_float8_kernel[(5, 2)](
        x, grad, scale, scaled, 1100, ACTIVATION=kind, BLOCK=1024, FLOAT8_MAX=57344.0
    )
    assert torch.equal(scaled, (dx * scale).clamp(-57344, 57344))
    assert scaled.abs().max() == 57344
print("ok")
"""


def test_the_kernels_give_the_ops_amax_and_scaling_in_the_interpreter() -> None:
    """The amax kernels' blocks and the cast kernels' scaled, saturated values against the
    plain forward kernel's product and the plain backward kernel's ``[dgate; dup]``
    (Triton's interpreter on the CPU)."""
    assert run_in_interpreter(CHECK).strip() == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", gated_grad.ACTIVATIONS)
def test_on_cuda_the_kernels_make_torchaos_casts_compiled(activation: str, monkeypatch) -> None:
    """Compiled on a GPU, ``fc2(GatedFloat8(fc1(h)))``: each kernel runs once a step, and
    the output and every gradient (both weights', the input's) are those of torchao
    casting the plain one-pass activation and its backward (a width of 1,040: divisible
    by 16 as float8 matmuls need, and the kernels' second column block only partly full,
    which checks their masking)."""
    kernels = "_kernel_amax", "_kernel_to_float8", "_kernel_backward_to_float8"
    calls = count_calls(monkeypatch, gated_fp8, *kernels)
    torch.manual_seed(0)
    hidden, width, out = 512, 1040, 512
    config = torchao_config("tensorwise")
    pairs = []
    for features in ((hidden, 2 * width), (width, out)):
        linear = nn.Linear(*features, bias=False, device="cuda")
        pairs.append([Float8Linear.from_float(copy.deepcopy(linear), config=config) for _ in "ab"])
    (plain_fc1, fc1), (plain_fc2, fc2) = pairs
    armed = gated_fp8.GatedFloat8(activation, fc2, fc1)
    h = torch.randn(4096, hidden, device="cuda").bfloat16()
    grad = torch.randn(4096, out, device="cuda").bfloat16()
    leaves = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = torch.compile(lambda h: plain_fc2(gated_grad.gated(plain_fc1(h), activation)))
        expected = plain(leaves[0])
        got = torch.compile(lambda h: fc2(armed(fc1(h))))(leaves[1])
    expected.backward(grad)
    got.backward(grad)
    assert calls == dict.fromkeys(calls, 1)
    assert torch.equal(got, expected)
    assert torch.equal(fc2.weight.grad, plain_fc2.weight.grad)
    assert torch.equal(fc1.weight.grad, plain_fc1.weight.grad)
    assert torch.equal(leaves[1].grad, leaves[0].grad)
