"""Scoring continuations with a T5 model (``model.family: t5``), the way it was pretrained.

Span corruption teaches the model to fill a sentinel with the tokens it stands for, and
its last span always ends the window (T5's ``random_spans_noise_mask``). So a
continuation is asked for as the span after the context: the encoder reads
``context <extra_id_0> EOS`` and the decoder, started with the pad id and
``<extra_id_0>``, scores the continuation's tokens. The multiple-choice tasks
(:mod:`evaluation.tasks`) and generation prompts use this form.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from preprocessing.tokenizer import Tokenizer, require_sentinels
from training.data.t5_dataset import IGNORE_INDEX
from training.inference.runtime import autocast, model_device


def span_prompt(tokenizer: Tokenizer, context: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(encoder tokens, decoder start)`` asking for what follows ``context``."""
    sentinel = require_sentinels(tokenizer, 1)[0]
    return [*context, sentinel, tokenizer.eod_id], [_pad_id(tokenizer), sentinel]


@torch.no_grad()
def span_logliks(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    sequences: Sequence[tuple[list[int], int]],
    autocast_dtype: torch.dtype | None = None,
) -> list[float]:
    """For each ``(tokens, n)``: the summed log-probability of its last ``n`` tokens as the
    span after the others (:func:`span_prompt`); rows right-padded, padding masked."""
    device = model_device(model)
    encoder, decoder, labels, mask = span_rows(tokenizer, sequences)
    with autocast(device, autocast_dtype):
        losses = model(
            encoder.to(device),
            decoder.to(device),
            labels.to(device),
            encoder_mask=mask.to(device),
            loss_reduction="none",
        )
    scored = (labels != IGNORE_INDEX).to(device)
    return (-(losses.double() * scored).sum(dim=1)).tolist()


def span_rows(
    tokenizer: Tokenizer, sequences: Sequence[tuple[list[int], int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(encoder, decoder, labels, encoder mask)`` for :func:`span_logliks`: each
    sequence's last ``n`` tokens as the span after the others, rows right-padded."""
    pad = _pad_id(tokenizer)
    prompts = [span_prompt(tokenizer, tokens[:-n]) for tokens, n in sequences]
    encoder_width = max(len(encoder) for encoder, _ in prompts)
    decoder_width = max(
        len(start) + n - 1 for (_, start), (_, n) in zip(prompts, sequences, strict=True)
    )
    encoder = torch.full((len(sequences), encoder_width), pad, dtype=torch.long)
    decoder = torch.full((len(sequences), decoder_width), pad, dtype=torch.long)
    labels = torch.full_like(decoder, IGNORE_INDEX)
    for row, ((source, start), (tokens, n)) in enumerate(zip(prompts, sequences, strict=True)):
        encoder[row, : len(source)] = torch.tensor(source)
        inputs = start + tokens[-n:-1]
        decoder[row, : len(inputs)] = torch.tensor(inputs)
        labels[row, len(start) - 1 : len(start) - 1 + n] = torch.tensor(tokens[-n:])
    mask = torch.arange(encoder_width) < torch.tensor([len(s) for s, _ in prompts])[:, None]
    return encoder, decoder, labels, mask


def _pad_id(tokenizer: Tokenizer) -> int:
    if tokenizer.pad_id is None:
        raise ValueError(f"{tokenizer.model_path}: has no <|pad|> token, which starts T5 decoding")
    return tokenizer.pad_id
