"""The T5 objectives in the trainer (``model.family: t5``): span corruption, and chat
fine-tuning (:func:`chat_micro_batch_loss`).

Batches come from :class:`~training.data.t5_dataset.SpanCorruptionDataset`: encoder
tokens and mask, decoder input (targets shifted right behind the pad id) and labels
(-100 on padding). The model (:class:`~training.models.t5.T5Model`) returns the mean
cross-entropy over the labels that are not -100.

Normalisation: every sample has the same number of target tokens (the span counts are
fixed by the window length, T5's ``random_spans_noise_mask``), so the mean of the
micro-batch means that gradient accumulation and DDP take *is* the mean over every
target token of the global batch, at any micro-batch size or data-parallel size.

Throughput counts a sample as its encoder plus decoder tokens (``S + T``), and the FLOPs
per such token come from :func:`training.models.flops.encoder_decoder_flops`, so
tokens/s × FLOPs/token is the model's real work and MFU is comparable with GPT runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megalith.config import DataConfig, ModelConfig
from training.data.t5_chat_dataset import chat_lengths
from training.data.t5_dataset import IGNORE_INDEX, T5_KEYS, span_corruption_lengths
from training.models.flops import encoder_decoder_flops
from training.parallel.groups import ParallelState


def micro_batch_loss(model: nn.Module, batch: dict[str, Tensor], device: torch.device) -> Tensor:
    """Mean cross-entropy over the micro-batch's target tokens."""
    encoder, decoder, labels, mask = (batch[key].to(device, non_blocking=True) for key in T5_KEYS)
    return model(encoder, decoder, labels, encoder_mask=mask)


def chat_micro_batch_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    device: torch.device,
    weight: Tensor | None,
    parallel: ParallelState | None = None,
) -> Tensor:
    """Chat turns (:mod:`training.data.t5_chat_dataset`), whose answers differ in length:
    ``sum(target-token losses) · weight`` (the step's global count of target tokens,
    :func:`training.objectives.sft.prefetch_step`), or without a weight their mean in this
    micro-batch, as the decoder-only chat objective."""
    encoder, decoder, labels, mask = (batch[key].to(device, non_blocking=True) for key in T5_KEYS)
    losses = model(encoder, decoder, labels, encoder_mask=mask, loss_reduction="none")
    total = losses.float().sum()  # ignored (padding) labels score 0
    if weight is not None:
        return total * weight
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def sample_lengths(data: DataConfig) -> tuple[int, int]:
    """``(S, T)``: encoder and decoder tokens of every sample (span corruption's, or a chat
    fine-tune's)."""
    lengths = chat_lengths(data) if data.format == "chat" else span_corruption_lengths(data)
    return lengths.encoder, lengths.decoder


def tokens_and_flops(model: ModelConfig, data: DataConfig) -> tuple[int, float]:
    """Tokens a sample counts for (``S + T``) and training FLOPs per such token."""
    encoder, decoder = sample_lengths(data)
    per_sample = encoder_decoder_flops(model, encoder, decoder)
    return encoder + decoder, per_sample / (encoder + decoder)
