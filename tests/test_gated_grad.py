"""Gated activations as one-pass kernels (training/models/gated_grad.py): the autograd
wiring and the ops' fake kernels under torch.compile on the CPU, the Triton kernels
against autograd through Triton's interpreter (where Triton is installed), and
the model's MLP taking the op. On a GPU: ``tests/test_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from test_model import build, tiny, tokens
from triton_helpers import run_in_interpreter

from training.models import GPTModel, gated_grad
from training.models.layers import geglu, swiglu


def case(rows: int = 6, width: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(rows, 2 * width, dtype=torch.float64) * 3, torch.randn(rows, width)


def reference_grad(x: torch.Tensor, grad: torch.Tensor, activation: str) -> torch.Tensor:
    leaf = x.detach().clone().requires_grad_(True)
    gated_grad.gated_reference(leaf, activation).backward(grad.to(leaf.dtype))
    return leaf.grad


@pytest.mark.parametrize("activation", gated_grad.ACTIVATIONS)
def test_the_function_and_its_op_match_autograd_compiled(activation: str) -> None:
    """The autograd.Function (forward and backward custom ops) traced by dynamo and AOT
    autograd (the ops' fake kernels state their outputs) gives autograd's values."""
    x, grad = case()

    def loss(x: torch.Tensor) -> torch.Tensor:
        return (gated_grad._Gated.apply(x, activation) * grad.to(x.dtype)).sum()

    leaf = x.clone().requires_grad_(True)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    value = compiled(leaf)
    value.backward()
    want_value = (gated_grad.gated_reference(x, activation) * grad.double()).sum()
    torch.testing.assert_close(value, want_value)
    torch.testing.assert_close(leaf.grad, reference_grad(x, grad, activation))


def test_the_model_takes_the_op_only_where_its_kernel_runs() -> None:
    """On the CPU (no kernel) ``swiglu``/``geglu`` are the plain formulas, bit for bit."""
    x, _ = case()
    assert not gated_grad.kernel_usable(x.requires_grad_(True))
    assert torch.equal(swiglu(x), gated_grad.gated_reference(x, "silu"))
    assert torch.equal(geglu(x), gated_grad.gated_reference(x, "gelu_tanh"))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_compiled_model_through_the_op_matches_the_plain_formula(recompute, monkeypatch) -> None:
    """A Llama-style model compiled (dynamo and AOT autograd) with the op forced on the
    CPU (its backward by aten's activation gradients): under each activation
    checkpointing mode, the loss and every gradient are the plain formula's."""

    def loss_and_grads(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = torch.compile(model, backend="aot_eager")(tokens(), tokens(seed=3))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    config = tiny("llama", activation_checkpointing=recompute)
    want_loss, want = loss_and_grads(build(config))
    forced = [0]

    def usable(x: torch.Tensor) -> bool:
        forced[0] += 1
        return x.requires_grad and torch.is_grad_enabled()

    monkeypatch.setattr(gated_grad, "kernel_usable", usable)
    torch._dynamo.reset()
    loss, grads = loss_and_grads(build(config))
    assert forced[0] > 0
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


KERNEL_CHECK = """
import torch
from tests.test_gated_grad import case, reference_grad
from training.models import gated_grad
for activation in gated_grad.ACTIVATIONS:
    for rows, width, block in [(6, 40, 16), (3, 64, 64), (5, 7, 1024)]:
        x, grad = case(rows, width)
        got = gated_grad._kernel_forward(x.float(), activation, block=block)
        want = gated_grad.gated_reference(x, activation)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        got = gated_grad._kernel_backward(x.float(), grad.float(), activation, block=block)
        want = reference_grad(x, grad, activation)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        print("ok", activation, rows, width)
"""


def test_triton_kernels_match_autograd_in_the_interpreter() -> None:
    """Both kernels against the plain formula and its autograd, with widths that fill,
    split and underfill the kernels' column block."""
    assert run_in_interpreter(KERNEL_CHECK).count("ok") == 6
