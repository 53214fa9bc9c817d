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
from megalith.errors import MegalithError
from training.data.t5_chat_dataset import chat_lengths
from training.data.t5_dataset import (
    IGNORE_INDEX,
    T5_KEYS,
    encoder_mask_on,
    span_corruption_lengths,
)
from training.models.flops import encoder_decoder_flops
from training.models.t5 import ContextShard
from training.parallel import context_parallel as cp
from training.parallel.groups import ParallelState


def micro_batch_loss(
    model: nn.Module, batch: dict[str, Tensor], device: torch.device, state: ParallelState
) -> Tensor:
    """Mean cross-entropy over the micro-batch's target tokens; under context parallelism
    this rank's share (:func:`context_parallel_losses`)."""
    if state.sizes.cp > 1:
        losses = context_parallel_losses(model, batch, device, state)
        count = (batch["labels"] != IGNORE_INDEX).sum().to(losses.device).clamp(min=1)
        return losses.sum() * state.sizes.cp / count
    encoder, decoder, labels = (batch[key].to(device, non_blocking=True) for key in T5_KEYS[:3])
    return model(
        encoder, decoder, labels, encoder_mask=encoder_mask_on(batch["encoder_mask"], device)
    )


def context_parallel_losses(
    model: nn.Module, batch: dict[str, Tensor], device: torch.device, state: ParallelState
) -> Tensor:
    """This context-parallel rank's target-token losses ``[B, T / CP]`` (0 on padding):
    each rank feeds its load-balanced chunks of the encoder and decoder sequences
    (:mod:`training.parallel.context_parallel`), the whole padding mask and a
    :class:`~training.models.t5.ContextShard` with their global positions, so every
    attention is exact over the keys it gathers. As for GPT, ``CP · sum / whole count``
    summed over the CP ranks is one device's mean, and the gradient average over data ×
    context leaves one device's gradient."""
    encoder, decoder, labels = (batch[key].to(device, non_blocking=True) for key in T5_KEYS[:3])
    cp_size, cp_rank = state.sizes.cp, state.cp_rank
    source, target = encoder.size(1), decoder.size(1)
    if source % (2 * cp_size) or target % (2 * cp_size):
        raise MegalithError(
            f"parallel.context={cp_size} with a T5 needs the encoder length {source} "
            "(data.span_corruption.encoder_length, else data.seq_length) and the decoder "
            f"length {target} (data.span_corruption.decoder_length) to be multiples of "
            f"2 · context = {2 * cp_size}: set data.span_corruption.decoder_length (and "
            "encoder_length) to such multiples"
        )
    shard = ContextShard(
        cp.positions(source, cp_size, cp_rank, device),
        cp.positions(target, cp_size, cp_rank, device),
        source,
        target,
    )
    parts = (cp.split_sequence(x, cp_size, cp_rank) for x in (encoder, decoder, labels))
    mask = encoder_mask_on(batch["encoder_mask"], device)
    return model(*parts, encoder_mask=mask, loss_reduction="none", shard=shard)


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
    micro-batch, as the decoder-only chat objective (under context parallelism, this
    rank's share of either)."""
    labels = batch["labels"]
    cp_size = 1 if parallel is None else parallel.sizes.cp
    if cp_size == 1:
        encoder, decoder, labels, mask = (batch[k].to(device, non_blocking=True) for k in T5_KEYS)
        losses = model(encoder, decoder, labels, encoder_mask=mask, loss_reduction="none")
    else:  # this rank's part of the answers (prefetch_step counted its part of the mask)
        losses = context_parallel_losses(model, batch, device, parallel)
    total = losses.float().sum()  # ignored (padding) labels score 0
    if weight is not None:
        return total * weight
    return total * cp_size / (labels != IGNORE_INDEX).sum().to(total.device).clamp(min=1)


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
