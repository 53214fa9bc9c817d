"""The batch-summed gradient of a shared attention bias (T5's relative positions):
the plain-torch definition against autograd, and the Triton kernel against both on the
CPU through Triton's interpreter (where Triton is installed; on a GPU the kernel runs in
``tests/test_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import run_in_interpreter

from training.models import bias_grad


def autograd_case(causal: bool, queries: int, keys: int, seed: int = 0):
    """Attention with one bias for the batch, its gradient from autograd, and what
    :func:`bias_grad.bias_grad_reference` needs to compute it again. ``causal`` folds the
    mask into the bias as the model does (the most negative value where a key is hidden)."""
    torch.manual_seed(seed)
    batch, heads, head_dim = 3, 2, 16
    q = torch.randn(batch, heads, queries, head_dim, dtype=torch.float64)
    k = torch.randn(batch, heads, keys, head_dim, dtype=torch.float64)
    v = torch.randn(batch, heads, keys, head_dim, dtype=torch.float64)
    bias = torch.randn(heads, queries, keys, dtype=torch.float64, requires_grad=True)
    scale = head_dim**-0.5
    masked = bias
    if causal:
        keep = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
        masked = bias.masked_fill(~keep, torch.finfo(torch.float32).min)
    scores = scale * q @ k.transpose(-1, -2) + masked
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    inputs = (q, k, v, out.detach(), grad_out, lse.detach(), masked.detach())
    return inputs, scale, bias.grad


@pytest.mark.parametrize(
    ("causal", "queries", "keys"), [(False, 40, 40), (True, 24, 24), (False, 20, 70)]
)
def test_reference_bias_gradient_is_autograds(causal: bool, queries: int, keys: int) -> None:
    inputs, scale, want = autograd_case(causal, queries, keys)
    got = bias_grad.bias_grad_reference(*inputs, scale=scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


KERNEL_CHECK = """
import torch
from tests.test_bias_grad import autograd_case
from training.models import bias_grad
for causal, queries, keys in [(False, 40, 40), (True, 24, 24), (False, 20, 70), (True, 70, 70)]:
    inputs, scale, want = autograd_case(causal, queries, keys)
    inputs = [t.float() for t in inputs]
    got = bias_grad.bias_grad(*inputs, scale=scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    print("ok", causal, queries, keys)
"""


def test_triton_kernel_matches_autograd_in_the_interpreter() -> None:
    assert run_in_interpreter(KERNEL_CHECK).count("ok") == 4
