"""GPU-only checks (skipped without CUDA): bf16 training steps and CPU/GPU agreement.

Last passed: 2026-11-25 on one NVIDIA H100 80GB (torch 2.11.0+cu130), 4 passed, through
``bash benchmarks/gpu_tests.sh`` (benchmarks/RESULTS.md, "Tests that need a GPU").
"""

from __future__ import annotations

import pytest
import torch

from megalith.config import ModelConfig
from training.models import GPTModel

pytestmark = pytest.mark.gpu


def small_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2)
    fields.update(vocab_size=512, max_position_embeddings=256, **overrides)
    return ModelConfig(**fields)


def test_bf16_forward_matches_fp32_on_gpu() -> None:
    torch.manual_seed(0)
    model = GPTModel(small_config()).cuda()
    tokens = torch.randint(0, 512, (4, 128), device="cuda")
    with torch.no_grad():
        reference = model(tokens)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fast = model(tokens)
    error = (fast - reference).norm() / reference.norm()
    assert error < 2e-2, f"bf16 logits differ from fp32 by {error:.3g}"


def test_gpu_logits_match_cpu() -> None:
    torch.manual_seed(0)
    model = GPTModel(small_config()).eval()
    tokens = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        cpu = model(tokens)
        gpu = model.cuda()(tokens.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3)


def test_fused_adamw_training_reduces_loss_on_gpu() -> None:
    torch.manual_seed(0)
    model = GPTModel(small_config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    tokens = torch.randint(0, 512, (8, 65), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_checkpoint_rng_record_restores_this_devices_generator() -> None:
    """v2 checkpoints keep the current device's CUDA generator (every rank's is alike) and
    restore it onto the current device."""
    from training.checkpoint.sharded_files import restore_rng, rng_record

    torch.cuda.manual_seed(3)
    torch.rand(5, device="cuda")  # advance it
    record = rng_record()
    want = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(99)
    restore_rng(record)
    torch.testing.assert_close(torch.rand(5, device="cuda"), want)
