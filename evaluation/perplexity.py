"""Perplexity of a model on the valid or test split of a shard set.

Samples come from the same ``GPTDataset`` the trainer validates on (``seq_length + 1``
tokens, crossing document boundaries, every position's next token scored), so the
numbers are comparable with the training log's validation loss. At most one epoch
of the split is read, so a small split is never counted twice.

Chat data (``data.format: chat``) is scored as the fine-tune validates it: packed
conversations that attend only within themselves, and only assistant tokens counted
(:func:`training.objectives.sft.micro_batch_loss`), so a promotion gate compares the answers, not
the prompts every model is given.

A T5 model (``model.family: t5``) is scored on span corruption instead: the same
span-corrupted samples the trainer validates on (``training.data.t5_dataset``, so
``data.span_corruption`` must match training), every target token (sentinels, span
tokens, EOS) scored given the corrupted input.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from evaluation import EvaluationError
from megalith.config import DataConfig
from megalith.storage import sha256_of_file
from preprocessing.manifest import manifest_url
from training.data import open_shard_set
from training.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    plan_epochs,
    split_document_ranges,
)
from training.data.t5_dataset import T5_KEYS
from training.families import model_family
from training.inference.runtime import autocast, model_device
from training.models.package import TrainingData
from training.objectives.sft import micro_batch_loss

logger = logging.getLogger(__name__)

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
    # {"shard_set", "document", "tokens", "nll"} per document a scored token came from;
    # empty where samples are not plain documents of one shard set (blend, chat, T5).
    documents: tuple[dict[str, Any], ...] = ()

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
    family = model_family(model.config)
    scorer = SCORERS[family.name]
    _check_length(model, data)
    window = family.sample_window(data)
    samples = min(max_samples, split_capacity(data, split, tokenizer_id, window))
    counts = [samples if name == split else 0 for name in SPLIT_NAMES]
    dataset = family.build_datasets(data, tuple(counts))[SPLIT_NAMES.index(split)]
    if dataset is None:
        raise EvaluationError(f"the {split} split of {_sources(data)} holds no tokens")

    per_document = DocumentScores() if isinstance(dataset, GPTDataset) else None
    start = time.perf_counter()
    total_loss, total_tokens = 0.0, 0
    for first in range(0, samples, batch_size):
        indices = range(first, min(first + batch_size, samples))
        items = [dataset[i] for i in indices]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        loss_sum, count, losses = scorer.loss_sum(model, batch, data, autocast_dtype)
        if per_document is not None and losses is not None:
            per_document.add(dataset, indices, losses)
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
        scored=scorer.scored(data),
        documents=per_document.results(dataset.shard_set.root) if per_document else (),
    )


class DocumentScores:
    """Summed loss and scored tokens per document: each predicted token counts for the
    document it belongs to (a sample crosses document boundaries)."""

    def __init__(self) -> None:
        self.nll: dict[int, float] = {}
        self.tokens: dict[int, int] = {}

    def add(self, dataset: GPTDataset, indices: range, losses: torch.Tensor) -> None:
        for row, index in enumerate(indices):
            documents = sample_documents(dataset, index)[1:]  # the predicted positions
            ids, inverse = np.unique(documents, return_inverse=True)
            sums = np.bincount(inverse, weights=losses[row].cpu().numpy(), minlength=ids.size)
            counts = np.bincount(inverse, minlength=ids.size)
            for document, nll, count in zip(ids.tolist(), sums, counts, strict=True):
                self.nll[document] = self.nll.get(document, 0.0) + float(nll)
                self.tokens[document] = self.tokens.get(document, 0) + int(count)

    def results(self, shard_set: str) -> tuple[dict[str, Any], ...]:
        return tuple(
            {
                "shard_set": shard_set,
                "document": document,
                "tokens": self.tokens[document],
                "nll": self.nll[document],
            }
            for document in sorted(self.nll)
        )


def sample_documents(dataset: GPTDataset, index: int) -> np.ndarray:
    """The shard-set document id of each of sample ``index``'s ``seq_length + 1`` tokens
    (the positions :meth:`GPTDataset.sample_tokens` reads)."""
    spans = dataset.sample_spans(index)
    return np.concatenate(
        [np.full(stop - start, document, dtype=np.int64) for document, start, stop in spans]
    )


@torch.no_grad()
def token_losses(
    model: nn.Module, tokens: torch.Tensor, autocast_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Next-token cross-entropy ``[B, T]`` (float64) of each position of ``tokens [B, T+1]``."""
    device = model_device(model)
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with autocast(device, autocast_dtype):
        losses = model(inputs, labels, loss_reduction="none")
    return losses.double()


@torch.no_grad()
def assistant_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
) -> tuple[float, int]:
    """Summed cross-entropy of a packed chat batch's assistant tokens and their number."""
    device = model_device(model)
    with autocast(device, autocast_dtype):
        loss_sum = micro_batch_loss(model, batch, device, weight=torch.ones((), device=device))
    return loss_sum.item(), int(batch["loss_mask"].sum())


def held_out_data(
    data: DataConfig, trained_on: TrainingData | None, allow_split_mismatch: bool = False
) -> DataConfig:
    """``data`` with the split the model trained with, so its valid/test documents are the
    ones the model never saw.

    A shard set the model trained on (same manifest sha256) is split as in training unless
    ``data.split`` was set; a set split that moves documents between splits is refused
    unless ``allow_split_mismatch``. Other shard sets keep ``data.split``. A package that
    records no training data keeps ``data.split`` with a warning.
    """
    if trained_on is None:
        logger.warning(
            "warning: the model package records no training data (written before packages "
            "recorded it, or imported): scoring with data.split=%s, which may hold documents "
            "the model trained on",
            list(data.split),
        )
        return data
    shared = _shared_shard_sets(data, trained_on)
    if not shared:
        logger.warning(
            "warning: %s is not a shard set the model trained on (no manifest sha256 "
            "matches the package's record); scoring with data.split=%s",
            _sources(data),
            list(data.split),
        )
        return data
    if "split" not in data.model_fields_set:
        return data.model_copy(update={"split": trained_on.split})
    moved = [
        path
        for path, documents in shared
        if split_document_ranges(documents, data.split)
        != split_document_ranges(documents, trained_on.split)
    ]
    if moved and not allow_split_mismatch:
        raise EvaluationError(
            f"data.split={list(data.split)} is not the split the model trained with "
            f"({list(trained_on.split)}) on {', '.join(moved)}: its valid/test documents "
            "would include training documents. Leave data.split out to use the training "
            "split, or pass --allow-split-mismatch"
        )
    if moved:
        logger.warning(
            "warning: data.split=%s differs from the training split %s on %s "
            "(--allow-split-mismatch): the scored documents may include training documents",
            list(data.split),
            list(trained_on.split),
            ", ".join(moved),
        )
    return data


def _shared_shard_sets(data: DataConfig, trained_on: TrainingData) -> list[tuple[str, int]]:
    """``(path, documents)`` of each evaluated shard set the model trained on."""
    shared = []
    for source in data.training_sources():
        digest = sha256_of_file(manifest_url(source.path), data.storage_options)
        if digest in trained_on.manifest_sha256:
            shard_set = open_shard_set(source.path, data.storage_options, data.cache_dir)
            shared.append((source.path, shard_set.num_documents))
    return shared


def _check_length(model: nn.Module, data: DataConfig) -> None:
    """The samples fit the model's positions (T5 with relative positions has no limit)."""
    config = model.config
    if config.position_embedding == "relative":  # buckets: any length
        return
    length, what = model_family(config).context_length(data)
    max_positions = config.max_position_embeddings
    if length > max_positions:
        raise EvaluationError(
            f"{what} exceeds the model's max_position_embeddings "
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


def _next_token_loss_sum(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    data: DataConfig,
    autocast_dtype: torch.dtype | None,
) -> tuple[float, int, torch.Tensor | None]:
    if data.format == "chat":  # assistant tokens of packed conversations
        return (*assistant_loss_sum(model, batch, autocast_dtype), None)
    losses = token_losses(model, batch["tokens"], autocast_dtype)
    return losses.sum().item(), losses.numel(), losses


def _span_loss_sum(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    data: DataConfig,
    autocast_dtype: torch.dtype | None,
) -> tuple[float, int, torch.Tensor | None]:
    return (*span_loss_sum(model, batch, autocast_dtype), None)


class Scorer(NamedTuple):
    """How perplexity scores a model family's batch: ``(loss sum, tokens, per-token losses
    or None)``, and what the tokens scored are."""

    loss_sum: Callable[
        [nn.Module, dict[str, torch.Tensor], DataConfig, torch.dtype | None],
        tuple[float, int, torch.Tensor | None],
    ]
    scored: Callable[[DataConfig], str]


# By the model.family names training.families registers.
SCORERS: dict[str, Scorer] = {
    "gpt": Scorer(
        _next_token_loss_sum,
        lambda data: "assistant tokens" if data.format == "chat" else "every next token",
    ),
    "t5": Scorer(
        _span_loss_sum,
        lambda data: "assistant turns" if data.format == "chat" else "span targets",
    ),
}


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
