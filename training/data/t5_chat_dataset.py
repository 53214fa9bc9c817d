"""Chat fine-tuning samples for an encoder-decoder (``model.family: t5``, ``data.format: chat``).

One sample per assistant turn: the encoder reads the conversation before the turn (its
system and user turns, earlier assistant turns, and the ``<|assistant|>`` marker that
opens this one), then EOS, which is what a T5 is given to answer a chat at serving time
(:func:`preprocessing.chat.generation_prompt`, then EOS as every T5 prompt ends); the
decoder predicts the turn: the tokens the chat shard set's loss mask marks (the answer and
its ``<|end|>``), behind the pad id as decoder start. So every assistant token is a target
once, as in a decoder-only chat fine-tune, and nothing else is.

Lengths (every sample the same, padded): ``S`` = ``data.span_corruption.encoder_length``
or ``data.seq_length`` encoder tokens, ``T`` = ``data.span_corruption.decoder_length`` or
``data.seq_length`` decoder tokens. A context longer than ``S - 1`` keeps its last
``S - 1`` tokens (the turn's own marker and the latest turns); an answer longer than ``T``
keeps its first ``T`` tokens. Both counts are logged.

Order: each epoch the split's turns are shuffled (one seeded stream, epoch after epoch), so
sample ``i`` depends only on the data, split, seed and lengths: the same on every rank
and after a resume, as with the other datasets. Items carry the T5 keys
(:data:`~training.data.t5_dataset.T5_KEYS`) and ``loss_mask`` (1 on the targets), which
the trainer counts to weigh each target token the same across the step
(:mod:`training.objectives.sft`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from megalith.config import DataConfig
from training.data.builder import build_gpt_datasets
from training.data.gpt_dataset import SPLIT_NAMES, SplitSamples, _rng, random_permutations
from training.data.index_cache import check_ids, load_or_build
from training.data.shard_set import ShardSet, ShardSetError
from training.data.t5_dataset import IGNORE_INDEX, special_ids, t5_sample

logger = logging.getLogger(__name__)

INDEX_FORMAT = 1
INDEX_NAMES = ("turns", "turn_order")
_TURN_STREAM = 3  # beside the GPT (0, 1), packing (2) streams


@dataclass(frozen=True)
class ChatLengths:
    """Encoder (``S``) and decoder (``T``) tokens of every T5 chat sample."""

    encoder: int
    decoder: int


def chat_lengths(data: DataConfig) -> ChatLengths:
    """``S`` and ``T`` from ``data.span_corruption``'s lengths, else ``data.seq_length``."""
    config = data.span_corruption
    return ChatLengths(
        config.encoder_length or data.seq_length, config.decoder_length or data.seq_length
    )


def assistant_turns(mask: np.ndarray) -> np.ndarray:
    """``[start, stop)`` of each run of 1 in a conversation's loss mask, shape ``[n, 2]``."""
    padded = np.concatenate([[0], (mask > 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return edges.reshape(-1, 2).astype(np.int64)


def find_turns(shard_set: ShardSet, documents: range) -> np.ndarray:
    """``(document, start, stop)`` of every assistant turn of ``documents``, in order."""
    found = [np.zeros((0, 3), dtype=np.int64)]
    for document in documents:
        length = int(shard_set.document_lengths[document])
        spans = assistant_turns(shard_set.document_loss_mask(document, 0, length))
        if spans.size:
            found.append(np.column_stack([np.full(len(spans), document), spans]))
    return np.concatenate(found)


def shuffled_epochs(count: int, num_samples: int, seed: int, split: int) -> np.ndarray:
    """``num_samples`` indices into ``range(count)``: one seeded permutation per epoch."""
    rng = _rng(seed, split, _TURN_STREAM)
    epochs = -(-num_samples // count)
    return np.concatenate([random_permutations(1, count, rng)[0] for _ in range(epochs)])[
        :num_samples
    ]


class T5ChatDataset(SplitSamples):
    """``num_samples`` (context → assistant turn) samples of a chat shard set's split."""

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
        *,
        lengths: ChatLengths,
        eos_id: int,
        pad_id: int,
    ):
        shard_set.require_loss_masks()
        super().__init__(shard_set, split, documents, num_samples, seq_length, seed, cache_dir)
        self.lengths, self.eos_id, self.pad_id = lengths, eos_id, pad_id
        self.description = {
            "kind": "t5-chat-turns",
            "format": INDEX_FORMAT,
            "shard_set": shard_set.fingerprint,
            "split": split,
            "documents": [documents.start, documents.stop],
            "seed": seed,
            "samples": num_samples,
        }
        self._load()
        self._log_truncation()

    def _load(self) -> None:
        arrays = load_or_build(
            self.cache_dir, self.description, INDEX_NAMES, self._build, self._check_indices
        )
        self.turns, self.turn_order = arrays["turns"], arrays["turn_order"]

    def _build(self) -> dict[str, np.ndarray]:
        turns = find_turns(self.shard_set, self.documents)
        if not len(turns):
            raise ShardSetError(
                f"{self.shard_set.root}: the {self.split} split's {len(self.documents)} "
                "conversations hold no assistant turn (loss mask all 0)"
            )
        split = SPLIT_NAMES.index(self.split)
        order = shuffled_epochs(len(turns), self.num_samples, self.seed, split)
        return {"turns": turns, "turn_order": order}

    def _check_indices(self, arrays: dict[str, np.ndarray]) -> None:
        """Cached turns inside this split's documents, and an order over them."""
        turns, order = arrays["turns"], arrays["turn_order"]
        if turns.ndim != 2 or turns.shape[1] != 3 or not len(turns):
            raise ValueError("turns must be a non-empty [n, 3] array")
        check_ids(turns[:, 0], "turns", self.documents.start, self.documents.stop)
        lengths = self.shard_set.document_lengths[turns[:, 0]]
        if (
            (turns[:, 1] < 1).any()
            or (turns[:, 2] <= turns[:, 1]).any()
            or (turns[:, 2] > lengths).any()
        ):
            raise ValueError("turns must lie inside their conversations, after a prompt")
        if order.size < self.num_samples:
            raise ValueError("turn_order is too short")
        check_ids(order, "turn_order", 0, len(turns))

    def _log_truncation(self) -> None:
        starts, stops = self.turns[:, 1], self.turns[:, 2]
        long_contexts = int((starts > self.lengths.encoder - 1).sum())
        long_answers = int((stops - starts > self.lengths.decoder).sum())
        if long_contexts or long_answers:
            logger.warning(
                "%s: of %d %s assistant turns, %d have more context than the encoder's %d "
                "tokens (the oldest tokens are left out) and %d answers are longer than the "
                "decoder's %d tokens (cut)",
                self.shard_set.root,
                len(self.turns),
                self.split,
                long_contexts,
                self.lengths.encoder - 1,
                long_answers,
                self.lengths.decoder,
            )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        document, start, stop = (int(x) for x in self.turns[self.turn_order[index]])
        context = self.shard_set.document_tokens(
            document, max(0, start - (self.lengths.encoder - 1)), start
        )
        answer = self.shard_set.document_tokens(
            document, start, min(stop, start + self.lengths.decoder)
        )
        encoder = np.concatenate([context, [self.eos_id]]).astype(np.int64)
        item = t5_sample(
            encoder,
            answer.astype(np.int64),
            self.lengths.encoder,
            self.lengths.decoder,
            self.pad_id,
        )
        item["loss_mask"] = (item["labels"] != IGNORE_INDEX).float()
        return item


def build_t5_chat_datasets(
    data: DataConfig, num_samples: tuple[int, int, int]
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test chat-turn datasets of a chat shard set (or a blend of them;
    ``None`` for an empty split). EOS and the pad id come from the tokenizer's manifest."""
    ids = special_ids(data, spans=0)
    make = functools.partial(
        T5ChatDataset, lengths=chat_lengths(data), eos_id=ids.eos_id, pad_id=ids.pad_id
    )
    return build_gpt_datasets(data, num_samples, make)
