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
from triton_helpers import run_in_interpreter

float8 = pytest.importorskip("torchao.float8")

from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import Float8TrainingTensor  # noqa: E402

from training.models import gated_grad  # noqa: E402
from training.models.layers import swiglu  # noqa: E402
from training.precision import gated_fp8  # noqa: E402
from training.precision.fp8 import convert_linears, torchao_config  # noqa: E402

WIDTH, OUT, ROWS = 32, 16, 48  # float8 matmuls need dimensions divisible by 16


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
print("ok")
"""


def test_the_kernels_give_the_forward_ops_amax_and_scaling_in_the_interpreter() -> None:
    """The amax kernel's blocks and the cast kernel's scaled, saturated values against the
    plain forward kernel's product (Triton's interpreter on the CPU)."""
    assert run_in_interpreter(CHECK).strip() == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", gated_grad.ACTIVATIONS)
def test_on_cuda_the_kernels_make_torchaos_cast_compiled(activation: str, monkeypatch) -> None:
    """Compiled on a GPU: both kernels run once a forward, and output, weight gradient
    and input gradient are those of torchao casting the plain one-pass activation (a
    width of 1,040: divisible by 16 as float8 matmuls need, and the kernels' second
    column block only partly full, which checks their masking)."""
    calls = {"_kernel_amax": 0, "_kernel_to_float8": 0}
    for name in calls:
        kernel = getattr(gated_fp8, name)

        def counted(*args, name=name, kernel=kernel, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        monkeypatch.setattr(gated_fp8, name, counted)
    torch.manual_seed(0)
    width, out = 1040, 512
    linear = nn.Linear(width, out, bias=False, device="cuda")
    config = torchao_config("tensorwise")
    plain_fc2 = Float8Linear.from_float(copy.deepcopy(linear), config=config)
    fc2 = Float8Linear.from_float(copy.deepcopy(linear), config=config)
    armed = gated_fp8.GatedFloat8(activation, fc2)
    x = (torch.randn(4096, 2 * width, device="cuda") * 3).bfloat16()
    grad = torch.randn(4096, out, device="cuda").bfloat16()
    leaves = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = torch.compile(lambda x: plain_fc2(gated_grad.gated(x, activation)))(leaves[0])
        got = torch.compile(lambda x: fc2(armed(x)))(leaves[1])
    expected.backward(grad)
    got.backward(grad)
    assert calls == {"_kernel_amax": 1, "_kernel_to_float8": 1}
    assert torch.equal(got, expected)
    assert torch.equal(fc2.weight.grad, plain_fc2.weight.grad)
    assert torch.equal(leaves[1].grad, leaves[0].grad)
