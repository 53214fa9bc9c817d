"""Fixed-length GPT samples drawn from one shard set's split, Megatron style.

The split's documents are shuffled anew each epoch and the epochs are laid end to end
as one token stream. Sample ``s`` of the stream is tokens ``[s*L, s*L + L + 1)``
(``L = seq_length``): samples cross document boundaries and consecutive samples share
one token, so inputs and labels both have ``L`` tokens.

Samples are shuffled in blocks: block ``b`` holds stream samples
``[b*S, (b+1)*S)``, where ``S`` is the number of samples an epoch yields (or a few
epochs, when the split is shorter than one sample), and a seeded permutation orders
them. Every permutation comes from its own seeded stream, so the sample at a global
index depends on the data, split, seed and seq_length only, not on how many
samples were asked for: asking for more samples later extends the sequence without
changing its start, and training resumes anywhere by global sample index.

Three arrays, built with vectorised numpy and cached as .npy (see ``index_cache``):
``document_index`` (document id at each stream position), ``sample_index``
(``[position, offset]`` where each stream sample starts) and ``shuffle_index``
(stream sample at each global index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from training.data.index_cache import check_ids, load_or_build
from training.data.shard_set import ShardSet

INDEX_FORMAT = 1
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
SPLIT_NAMES = ("train", "valid", "test")
_DOCUMENT_STREAM, _SAMPLE_STREAM = 0, 1
_RANDOM_CHUNK = 1 << 22  # random keys drawn at once


def split_document_ranges(num_documents: int, shares: tuple[float, ...]) -> list[range]:
    """Contiguous document ranges per split, Megatron's rounding (shares need not sum to 1)."""
    total = float(sum(shares))
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share / total * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [0] + [b - excess for b in bounds[1:]]
    return [range(max(a, 0), max(b, 0)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class EpochPlan:
    epochs_per_block: int
    samples_per_block: int
    blocks: int

    @property
    def epochs(self) -> int:
        return self.epochs_per_block * self.blocks


def plan_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> EpochPlan:
    # A block of k epochs has k*T tokens and yields (k*T - 1) // L samples of L + 1 tokens.
    per_block = max(1, math.ceil((seq_length + 1) / tokens_per_epoch))
    samples = (per_block * tokens_per_epoch - 1) // seq_length
    return EpochPlan(per_block, samples, math.ceil(num_samples / samples))


def random_permutations(rows: int, size: int, rng: np.random.RandomState) -> np.ndarray:
    """``rows`` independent permutations of ``range(size)``, shape ``[rows, size]``.

    Argsort of uniform keys, drawn row by row from one legacy RandomState (whose stream
    numpy keeps fixed across releases), so row ``r`` does not depend on ``rows``.
    """
    out = np.empty((rows, size), dtype=np.int64)
    step = max(1, _RANDOM_CHUNK // max(size, 1))
    for first in range(0, rows, step):
        keys = rng.random_sample((min(step, rows - first), size))
        out[first : first + len(keys)] = np.argsort(keys, axis=1, kind="stable")
    return out


def _rng(seed: int, split: int, stream: int) -> np.random.RandomState:
    return np.random.RandomState([seed % 2**32, split, stream])


def build_sample_indices(
    document_lengths: np.ndarray,
    first_document: int,
    num_samples: int,
    seq_length: int,
    seed: int,
    split: int,
) -> dict[str, np.ndarray]:
    """The three index arrays for a split whose documents have ``document_lengths``."""
    plan = plan_epochs(int(document_lengths.sum()), seq_length, num_samples)
    num_documents = document_lengths.size
    if plan.blocks == 0:
        empty = np.zeros(0, dtype=np.int64)
        return {
            "document_index": empty,
            "sample_index": empty.reshape(0, 2),
            "shuffle_index": empty,
        }

    order = random_permutations(plan.epochs, num_documents, _rng(seed, split, _DOCUMENT_STREAM))
    order = order.reshape(-1)
    id_type = np.int32 if first_document + num_documents < 2**31 else np.int64
    document_index = (order + first_document).astype(id_type)

    lengths = document_lengths[order]
    ends = np.cumsum(lengths)
    starts = np.arange(plan.blocks * plan.samples_per_block + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")  # skips empty documents
    offset = starts - (ends[position] - lengths[position])
    sample_index = np.stack([position, offset], axis=1)

    blocks = random_permutations(
        plan.blocks, plan.samples_per_block, _rng(seed, split, _SAMPLE_STREAM)
    )
    blocks += np.arange(plan.blocks, dtype=np.int64)[:, None] * plan.samples_per_block
    shuffle_index = blocks.reshape(-1)
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }


class SplitSamples(Dataset):
    """Samples of ``seq_length + 1`` tokens from documents ``documents`` of a shard set, by
    index arrays cached under ``cache_dir`` (``INDEX_NAMES``, loaded by ``_load``)."""

    INDEX_NAMES: tuple[str, ...] = ()

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
        lengths = shard_set.document_lengths[documents.start : documents.stop]
        if documents.step != 1 or not len(lengths) or not lengths.sum():
            raise ValueError(f"{shard_set.root}: {split} split {documents} holds no tokens")
        self.shard_set = shard_set
        self.split = split
        self.documents = documents
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.seed = seed
        self.cache_dir = Path(cache_dir)

    @property
    def document_lengths(self) -> np.ndarray:
        return self.shard_set.document_lengths[self.documents.start : self.documents.stop]

    def _load(self) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.num_samples

    # DataLoader workers started by spawn pickle the dataset: re-map the cached indices
    # instead of copying them.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in self.INDEX_NAMES:
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()


class GPTDataset(SplitSamples):
    """``num_samples`` samples of ``seq_length + 1`` tokens from documents ``documents`` of a shard set."""

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
        super().__init__(shard_set, split, documents, num_samples, seq_length, seed, cache_dir)
        lengths = self.document_lengths
        self.plan = plan_epochs(int(lengths.sum()), seq_length, num_samples)
        self.description = {
            "kind": "gpt-samples",
            "format": INDEX_FORMAT,
            "shard_set": shard_set.fingerprint,
            "split": split,
            "documents": [documents.start, documents.stop],
            "seq_length": seq_length,
            "seed": seed,
            # The indices depend on num_samples only through the number of blocks.
            "blocks": self.plan.blocks,
        }
        self._load()

    def _load(self) -> None:
        split_id = SPLIT_NAMES.index(self.split)
        lengths = self.document_lengths
        arrays = load_or_build(
            self.cache_dir,
            self.description,
            INDEX_NAMES,
            lambda: build_sample_indices(
                lengths,
                self.documents.start,
                self.num_samples,
                self.seq_length,
                self.seed,
                split_id,
            ),
            self._check_indices,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _check_indices(self, arrays: dict[str, np.ndarray]) -> None:
        """Cached indices that ``sample_tokens`` can follow: shuffled samples inside the
        sample index, samples in order spanning at most ``seq_length + 1`` positions,
        offsets inside their documents, documents inside this split."""
        documents, samples, order = (arrays[name] for name in INDEX_NAMES)
        check_ids(documents, "document_index", self.documents.start, self.documents.stop)
        if samples.ndim != 2 or samples.shape[1] != 2 or order.size < self.num_samples:
            raise ValueError(f"sample_index {samples.shape}, shuffle_index {order.shape}")
        check_ids(samples[:, 0], "sample_index positions", 0, max(documents.size, 1))
        check_ids(order, "shuffle_index", 0, max(samples.shape[0] - 1, 0))
        steps = np.diff(samples[:, 0])
        if steps.size and (steps.min() < 0 or steps.max() > self.seq_length + 1):
            raise ValueError("sample_index positions go back or skip past a sample's length")
        lengths = self.shard_set.document_lengths[documents[samples[:, 0]]]
        if (samples[:, 1] < 0).any() or (samples[:, 1] >= lengths).any():
            raise ValueError("sample_index offsets lie past their documents")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.from_numpy(self.sample_tokens(index))}

    def sample_tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens at global ``index``, as int64."""
        parts = [
            self.shard_set.document_tokens(document, start, stop)
            for document, start, stop in self.sample_spans(index)
        ]
        return np.concatenate(parts).astype(np.int64)

    def sample_spans(self, index: int) -> list[tuple[int, int, int]]:
        """``(document, start, stop)`` token ranges that make up the sample at global
        ``index``, in order (its ``seq_length + 1`` tokens)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        sample = int(self.shuffle_index[index])
        first, first_offset = (int(v) for v in self.sample_index[sample])
        last, last_offset = (int(v) for v in self.sample_index[sample + 1])
        spans = []
        for position in range(first, last + 1):
            document = int(self.document_index[position])
            start = first_offset if position == first else 0
            stop = (
                last_offset + 1
                if position == last
                else int(self.shard_set.document_lengths[document])
            )
            spans.append((document, start, stop))
        return spans
