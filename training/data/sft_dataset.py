"""Packed chat samples for supervised fine-tuning: whole conversations, never cut across samples.

Each epoch the split's conversations are shuffled (one seeded stream, epoch after
epoch, so the sample at a global index depends only on the data, split, seed and
``seq_length``, and training resumes anywhere by global sample index, as with
:class:`~training.data.gpt_dataset.GPTDataset`) and packed greedily in that order into
samples of ``seq_length + 1`` tokens: a conversation that does not fit in what is left
of the current sample starts the next one, and the rest is padding. A conversation
longer than a whole sample is truncated to one sample (its tail is lost; the count is
logged). Samples never span two epochs.

An item is::

    tokens        int64 [L + 1]   conversations then padding (the pad id, else EOD)
    loss_mask     float [L]       for labels tokens[1:]: 1 on assistant tokens of the same
                                  conversation as the input token, 0 elsewhere (padding)
    document_ids  int64 [L]       for inputs tokens[:-1]: 0, 1, ... per conversation; the
                                  padding is one more document

``document_ids`` is what the model needs for block-diagonal causal attention and for
positions that restart at every conversation (``GPTModel.forward(document_ids=...)``).

Two arrays, cached like the GPT indices: ``document_index`` (conversations in packing
order, epochs laid end to end) and ``sample_bounds`` (sample ``s`` holds
``document_index[bounds[s]:bounds[s+1]]``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from training.data.gpt_dataset import SPLIT_NAMES, SplitSamples, _rng, random_permutations
from training.data.index_cache import check_ids, load_or_build
from training.data.shard_set import ShardSet

logger = logging.getLogger(__name__)

INDEX_FORMAT = 1
INDEX_NAMES = ("document_index", "sample_bounds")
_PACKING_STREAM = 2


def pack_greedily(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Sample start offsets (plus the end) for documents of ``lengths`` packed in order."""
    bounds = [0]
    used = 0
    for index, length in enumerate(np.minimum(lengths, capacity).tolist()):
        if used + length > capacity and used > 0:
            bounds.append(index)
            used = 0
        used += length
    bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def build_packed_indices(
    document_lengths: np.ndarray,
    first_document: int,
    num_samples: int,
    capacity: int,
    seed: int,
    split: int,
) -> dict[str, np.ndarray]:
    """Shuffle and pack epoch after epoch until there are ``num_samples`` samples."""
    rng = _rng(seed, split, _PACKING_STREAM)
    orders, bounds, placed = [], [np.zeros(1, dtype=np.int64)], 0
    samples = 0
    while samples < num_samples:
        order = random_permutations(1, document_lengths.size, rng)[0]
        epoch_bounds = pack_greedily(document_lengths[order], capacity)
        orders.append(order + first_document)
        bounds.append(epoch_bounds[1:] + placed)
        placed += order.size
        samples += epoch_bounds.size - 1
    return {
        "document_index": np.concatenate([np.zeros(0, np.int64), *orders]),
        "sample_bounds": np.concatenate(bounds),
    }


class SFTDataset(SplitSamples):
    """``num_samples`` packed samples of ``seq_length + 1`` tokens from a chat shard set's split."""

    INDEX_NAMES = INDEX_NAMES

    def __init__(
        self,
        shard_set: ShardSet,
        split: str,
        documents: range,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | Path,
    ):
        shard_set.require_loss_masks()
        super().__init__(shard_set, split, documents, num_samples, seq_length, seed, cache_dir)
        tokenizer = shard_set.manifest.tokenizer
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eod_id
        self.description = {
            "kind": "sft-packed-samples",
            "format": INDEX_FORMAT,
            "shard_set": shard_set.fingerprint,
            "split": split,
            "documents": [documents.start, documents.stop],
            "seq_length": seq_length,
            "seed": seed,
            "samples": num_samples,
        }
        self._load()
        lengths = self.document_lengths
        truncated = int((lengths > seq_length + 1).sum())
        if truncated:
            logger.warning(
                "%s: %d of %d %s conversations are longer than seq_length + 1 = %d tokens "
                "and are truncated",
                shard_set.root,
                truncated,
                len(lengths),
                split,
                seq_length + 1,
            )

    def _load(self) -> None:
        lengths = self.document_lengths
        arrays = load_or_build(
            self.cache_dir,
            self.description,
            INDEX_NAMES,
            lambda: build_packed_indices(
                lengths,
                self.documents.start,
                self.num_samples,
                self.seq_length + 1,
                self.seed,
                SPLIT_NAMES.index(self.split),
            ),
            self._check_indices,
        )
        self.document_index = arrays["document_index"]
        self.sample_bounds = arrays["sample_bounds"]

    def _check_indices(self, arrays: dict[str, np.ndarray]) -> None:
        """Cached packing that ``sample_arrays`` can follow: documents inside this split,
        bounds in order, each sample at most ``seq_length + 1`` documents."""
        documents, bounds = arrays["document_index"], arrays["sample_bounds"]
        check_ids(documents, "document_index", self.documents.start, self.documents.stop)
        check_ids(bounds, "sample_bounds", 0, documents.size + 1)
        steps = np.diff(bounds)
        if bounds.size < self.num_samples + 1 or (
            steps.size and (steps.min() < 0 or steps.max() > self.seq_length + 1)
        ):
            raise ValueError("sample_bounds are too few, go back or span too many documents")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, mask, documents = self.sample_arrays(index)
        same_document = documents[1:] == documents[:-1]
        return {
            "tokens": torch.from_numpy(tokens),
            "loss_mask": torch.from_numpy((mask[1:] * same_document).astype(np.float32)),
            "document_ids": torch.from_numpy(documents[:-1]),
        }

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens, loss mask and document ids of the ``seq_length + 1`` positions of a sample."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        capacity = self.seq_length + 1
        tokens = np.full(capacity, self.pad_id, dtype=np.int64)
        mask = np.zeros(capacity, dtype=np.uint8)
        documents = np.empty(capacity, dtype=np.int64)
        first, last = (int(b) for b in self.sample_bounds[index : index + 2])
        used = 0
        for number, document in enumerate(self.document_index[first:last].tolist()):
            length = min(int(self.shard_set.document_lengths[document]), capacity)
            tokens[used : used + length] = self.shard_set.document_tokens(document, 0, length)
            mask[used : used + length] = self.shard_set.document_loss_mask(document, 0, length)
            documents[used : used + length] = number
            used += length
        documents[used:] = last - first  # the padding: a document of its own
        return tokens, mask, documents
