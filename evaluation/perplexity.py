"""Perplexity of a model on the valid or test split of a shard set.

Samples come from the same ``GPTDataset`` the trainer validates on (``seq_length + 1``
tokens, crossing document boundaries, every position's next token scored), so the
numbers are comparable with the training log's validation loss. At most one epoch
of the split is read, so a small split is never counted twice.
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

MAX_LOG_PERPLEXITY = 700.0  # math.exp overflows a float a little above 709


@dataclass(frozen=True)
class PerplexityResult:
    split: str
    samples: int
    tokens: int  # scored (predicted) tokens
    loss: float  # mean cross-entropy per token, nats
    perplexity: float
    seconds: float

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
    max_positions = model.config.max_position_embeddings
    if data.seq_length > max_positions:
        raise EvaluationError(
            f"data.seq_length {data.seq_length} exceeds the model's max_position_embeddings "
            f"{max_positions}; set data.seq_length <= {max_positions}"
        )
    samples = min(max_samples, split_capacity(data, split, tokenizer_id))
    counts = [samples if name == split else 0 for name in SPLIT_NAMES]
    dataset = build_gpt_datasets(data, tuple(counts))[SPLIT_NAMES.index(split)]
    if dataset is None:
        raise EvaluationError(f"the {split} split of {_sources(data)} holds no tokens")

    start = time.perf_counter()
    total_loss, total_tokens = 0.0, 0
    for first in range(0, samples, batch_size):
        indices = range(first, min(first + batch_size, samples))
        tokens = torch.stack([dataset[i]["tokens"] for i in indices])
        loss_sum, count = token_loss_sum(model, tokens, autocast_dtype)
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


def split_capacity(data: DataConfig, split: str, tokenizer_id: str | None = None) -> int:
    """Samples in one epoch of ``split`` (summed over a blend's shard sets), at least 1."""
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
            capacity += plan_epochs(tokens, data.seq_length, 1).samples_per_block
    return max(capacity, 1)


def _sources(data: DataConfig) -> str:
    return ", ".join(source.path for source in data.training_sources())
