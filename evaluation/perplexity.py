"""Perplexity of a model on the valid or test split of a shard set.

Samples come from the same ``GPTDataset`` the trainer validates on (``seq_length + 1``
tokens, crossing document boundaries, every position's next token scored), so the
numbers are comparable with the training log's validation loss. At most one epoch
of the split is read, so a small split is never counted twice.

Chat data (``data.format: chat``) is scored as the fine-tune validates it: packed
conversations that attend only within themselves, and only assistant tokens counted
(:func:`training.sft.micro_batch_loss`), so a promotion gate compares the answers, not
the prompts every model is given.

A T5 model (``model.family: t5``) is scored on span corruption instead: the same
span-corrupted samples the trainer validates on (``training.data.t5_dataset``, so
``data.span_corruption`` must match training), every target token (sentinels, span
tokens, EOS) scored given the corrupted input.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from evaluation import EvaluationError
from evaluation.runtime import autocast, model_device
from training.config import DataConfig
from training.data import build_gpt_datasets, open_shard_set
from training.data.gpt_dataset import SPLIT_NAMES, plan_epochs, split_document_ranges
from training.data.t5_dataset import T5_KEYS, build_t5_datasets, span_corruption_lengths
from training.sft import micro_batch_loss

MAX_LOG_PERPLEXITY = 700.0  # math.exp overflows a float a little above 709


@dataclass(frozen=True)
class PerplexityResult:
    split: str
    samples: int
    tokens: int  # scored (predicted) tokens
    loss: float  # mean cross-entropy per token, nats
    perplexity: float
    seconds: float
    scored: str = "every next token"  # or "assistant tokens" (chat), "span targets" (T5)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_perplexity(
    model: nn.Module,
    data: DataConfig,
    *,
    split: str = "valid",
    max_samples: int = 64,
    batch_size: int = 8,
    autocast_dtype: torch.dtype | None = None,
    tokenizer_id: str | None = None,
) -> PerplexityResult:
    """Mean token cross-entropy and its exp over up to ``max_samples`` samples of ``split``.

    ``tokenizer_id`` (the model's) is checked against every shard set's manifest.
    """
    if split not in ("valid", "test"):
        raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
    if max_samples < 1 or batch_size < 1:
        raise ValueError("max_samples and batch_size must be at least 1")
    t5 = model.config.family == "t5"
    _check_length(model, data)
    window = span_corruption_lengths(data).raw if t5 else data.seq_length
    samples = min(max_samples, split_capacity(data, split, tokenizer_id, window))
    counts = [samples if name == split else 0 for name in SPLIT_NAMES]
    build = build_t5_datasets if t5 else build_gpt_datasets
    dataset = build(data, tuple(counts))[SPLIT_NAMES.index(split)]
    if dataset is None:
        raise EvaluationError(f"the {split} split of {_sources(data)} holds no tokens")

    chat = not t5 and data.format == "chat"
    start = time.perf_counter()
    total_loss, total_tokens = 0.0, 0
    for first in range(0, samples, batch_size):
        items = [dataset[i] for i in range(first, min(first + batch_size, samples))]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        if t5:
            loss_sum, count = span_loss_sum(model, batch, autocast_dtype)
        elif chat:
            loss_sum, count = assistant_loss_sum(model, batch, autocast_dtype)
        else:
            loss_sum, count = token_loss_sum(model, batch["tokens"], autocast_dtype)
        total_loss += loss_sum
        total_tokens += count
    loss = total_loss / total_tokens
    return PerplexityResult(
        split=split,
        samples=samples,
        tokens=total_tokens,
        loss=loss,
        perplexity=math.exp(loss) if loss < MAX_LOG_PERPLEXITY else math.inf,
        seconds=time.perf_counter() - start,
        scored="span targets" if t5 else "assistant tokens" if chat else "every next token",
    )


@torch.no_grad()
def token_loss_sum(
    model: nn.Module, tokens: torch.Tensor, autocast_dtype: torch.dtype | None = None
) -> tuple[float, int]:
    """Summed next-token cross-entropy of ``tokens [B, T+1]`` and the number of scored tokens."""
    device = model_device(model)
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with autocast(device, autocast_dtype):
        losses = model(inputs, labels, loss_reduction="none")
    return losses.double().sum().item(), labels.numel()


@torch.no_grad()
def assistant_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
) -> tuple[float, int]:
    """Summed cross-entropy of a packed chat batch's assistant tokens and their number."""
    device = model_device(model)
    with autocast(device, autocast_dtype):
        loss_sum = micro_batch_loss(model, batch, device, weight=torch.ones((), device=device))
    return loss_sum.item(), int(batch["loss_mask"].sum())


def _check_length(model: nn.Module, data: DataConfig) -> None:
    """The samples fit the model's positions (T5 with relative positions has no limit)."""
    config = model.config
    if config.family == "t5":
        if config.position_embedding != "rope":
            return
        lengths = span_corruption_lengths(data)
        length, key = max(lengths.encoder, lengths.decoder), "the T5 sample length"
    else:
        length, key = data.seq_length, "data.seq_length"
    max_positions = config.max_position_embeddings
    if length > max_positions:
        raise EvaluationError(
            f"{key} {length} exceeds the model's max_position_embeddings "
            f"{max_positions}; set data.seq_length <= {max_positions}"
        )


@torch.no_grad()
def span_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
) -> tuple[float, int]:
    """Summed cross-entropy of a T5 batch's target tokens and their number."""
    device = model_device(model)
    encoder, decoder, labels, mask = (batch[key].to(device) for key in T5_KEYS)
    with autocast(device, autocast_dtype):
        losses = model(encoder, decoder, labels, encoder_mask=mask, loss_reduction="none")
    scored = labels != -100
    return losses.double()[scored].sum().item(), int(scored.sum())


def split_capacity(
    data: DataConfig, split: str, tokenizer_id: str | None = None, seq_length: int | None = None
) -> int:
    """Samples of ``seq_length`` (default data.seq_length) tokens in one epoch of ``split``
    (summed over a blend's shard sets), at least 1."""
    capacity = 0
    for source in data.training_sources():
        shard_set = open_shard_set(source.path, data.storage_options, data.cache_dir)
        if tokenizer_id is not None and shard_set.tokenizer_id != tokenizer_id:
            raise EvaluationError(
                f"{source.path} was tokenized with tokenizer {shard_set.tokenizer_id[:16]}…, "
                f"the model uses {tokenizer_id[:16]}…; perplexities would be meaningless"
            )
        documents = split_document_ranges(shard_set.num_documents, data.split)[
            SPLIT_NAMES.index(split)
        ]
        tokens = int(shard_set.document_lengths[documents.start : documents.stop].sum())
        if tokens:
            capacity += plan_epochs(tokens, seq_length or data.seq_length, 1).samples_per_block
    return max(capacity, 1)


def _sources(data: DataConfig) -> str:
    return ", ".join(source.path for source in data.training_sources())
