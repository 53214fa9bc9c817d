"""The fused output layer + cross-entropy (``model.loss_chunk_tokens``) against the plain
head: the same loss and gradients, chunk sizes that do and do not divide the tokens,
ignored labels, tied embeddings, bf16 autocast and no-grad evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from saved_tensors_probe import saved_for_backward

from megalith.config import ModelConfig
from training.models.fused_cross_entropy import linear_cross_entropy
from training.models.gpt import GPTModel
from training.models.layers import IGNORE_INDEX


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(
        logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


def loss_and_grads(loss_fn, hidden, weight, labels):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    loss = loss_fn(hidden, weight, labels)
    (2.5 * loss).backward()  # a scale on the way back, as gradient accumulation applies
    return loss.detach(), hidden.grad, weight.grad


def inputs(tokens: int = 24, hidden: int = 16, vocab: int = 50):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens // 2, hidden, generator=generator)
    w = torch.randn(vocab, hidden, generator=generator) * 0.3
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=generator)
    labels[0, :3] = IGNORE_INDEX  # padding / prompt tokens
    return x, w, labels


@pytest.mark.parametrize("chunk", [1, 7, 12, 24, 100])
def test_loss_and_gradients_equal_the_plain_head_in_fp32(chunk: int) -> None:
    x, w, labels = inputs()
    want = loss_and_grads(plain_loss, x, w, labels)
    got = loss_and_grads(
        lambda h, W, y: linear_cross_entropy(h, W, y, chunk, IGNORE_INDEX), x, w, labels
    )
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_autocast_matches_the_plain_head_under_autocast() -> None:
    x, w, labels = inputs(tokens=64, hidden=32, vocab=128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(plain_loss, x, w, labels)
        got = loss_and_grads(
            lambda h, W, y: linear_cross_entropy(h, W, y, 16, IGNORE_INDEX), x, w, labels
        )
    # Both take bf16 matmuls; the plain head rounds W's gradient to bf16 once, the fused
    # one accumulates chunks in fp32: agreement to bf16 precision.
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_no_labels_at_all_is_nan_as_in_cross_entropy() -> None:
    x, w, labels = inputs()
    labels.fill_(IGNORE_INDEX)
    assert torch.isnan(linear_cross_entropy(x, w, labels, 5, IGNORE_INDEX))
    assert torch.isnan(plain_loss(x, w, labels))


def test_a_model_with_chunked_loss_trains_like_the_plain_one() -> None:
    """Whole GPT models (tied embeddings): loss and every parameter's gradient agree, and
    evaluation under no_grad gives the same loss; and the chunked model really is: autograd
    keeps no more than one chunk of logits for backward (the plain one keeps all 48 rows;
    a model ignoring the setting would too)."""
    results = []
    for chunk in (0, 10):
        torch.manual_seed(0)
        config = ModelConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=64, vocab_size=96, max_position_embeddings=16,
            tie_embeddings=True, backend="torch", loss_chunk_tokens=chunk,
        )  # fmt: skip
        model = GPTModel(config)
        tokens = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
        with saved_for_backward() as saved:
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        logits_rows = [t.numel() for t in saved if t.dim() and t.shape[-1] == 96]
        largest = max(logits_rows, default=0)
        assert largest == 3 * 16 * 96 if chunk == 0 else largest <= chunk * 96, (chunk, logits_rows)
        with torch.no_grad():
            evaluated = model(tokens[:, :-1], labels=tokens[:, 1:])
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), evaluated, grads))
    (plain, plain_eval, plain_grads), (fused, fused_eval, fused_grads) = results
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_eval, plain_eval, rtol=1e-5, atol=1e-6)
    assert fused_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(
            fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6,
            msg=lambda m, n=name: f"{n}: {m}",
        )  # fmt: skip


def test_a_bad_chunk_size_is_a_clear_error() -> None:
    x, w, labels = inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        linear_cross_entropy(x, w, labels, 0, IGNORE_INDEX)
