"""``build_gpt_datasets``: a ``DataConfig`` → train / valid / test datasets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from torch.utils.data import Dataset

from megalith.config import DataConfig
from megalith.storage import is_local
from training.data.blending import BlendedDataset, load_blending_indices, samples_per_dataset
from training.data.gpt_dataset import SPLIT_NAMES, GPTDataset, split_document_ranges
from training.data.sft_dataset import SFTDataset
from training.data.shard_set import ShardSet, ShardSetError, default_cache_root, open_source

logger = logging.getLogger(__name__)


def index_cache_dir(data: DataConfig, shard_set: ShardSet) -> Path:
    """data.cache_dir, else beside local data, else the user cache for remote data."""
    if data.cache_dir:
        return Path(data.cache_dir)
    if is_local(shard_set.root):
        return Path(shard_set.root.removeprefix("file://")) / "index-cache"
    return default_cache_root() / "indices"


def build_gpt_datasets(
    data: DataConfig,
    num_samples: tuple[int, int, int],
    split_samples: Callable[..., Dataset] | None = None,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test datasets of ``num_samples`` samples each; ``None`` for an empty split.

    Each item is ``{"tokens": LongTensor[seq_length + 1]}``. With several sources in
    ``data.blend`` every split is a weighted blend of that split of each shard set.
    With ``data.format == "chat"`` the samples are packed conversations with a loss mask
    and document ids (:class:`~training.data.sft_dataset.SFTDataset`). ``split_samples``: another
    :class:`~training.data.gpt_dataset.SplitSamples` constructor for one shard set's split
    (a T5's chat turns), blended the same way.
    """
    sources = data.training_sources()
    shard_sets = [open_source(s, data) for s in sources]
    check_same_tokenizer(shard_sets)
    check_data_format(data, shard_sets)
    weights = [s.weight for s in sources]
    split_samples = split_samples or (SFTDataset if data.format == "chat" else GPTDataset)
    train, valid, test = (
        _build_split(data, shard_sets, weights, split, count, split_samples)
        for split, count in zip(SPLIT_NAMES, num_samples, strict=True)
    )
    return train, valid, test


def check_same_tokenizer(shard_sets: list[ShardSet]) -> None:
    first = shard_sets[0]
    for other in shard_sets[1:]:
        if other.tokenizer_id != first.tokenizer_id:
            raise ShardSetError(
                f"cannot blend shard sets made with different tokenizers: {first.root} "
                f"(tokenizer {first.tokenizer_id[:16]}…) and {other.root} "
                f"(tokenizer {other.tokenizer_id[:16]}…)"
            )


def check_data_format(data: DataConfig, shard_sets: list[ShardSet]) -> None:
    """Chat training needs chat shard sets (loss masks) and pretraining plain ones."""
    for shard_set in shard_sets:
        if shard_set.manifest.data_format != data.format:
            raise ShardSetError(
                f"{shard_set.root} was prepared with data.format={shard_set.manifest.data_format}"
                f" but data.format={data.format}: set data.format to match, or prepare the "
                f"data again with --format {data.format}"
            )


def _build_split(
    data: DataConfig,
    shard_sets: list[ShardSet],
    weights: list[float],
    split: str,
    count: int,
    split_samples: Callable[..., Dataset],
) -> Dataset | None:
    if count <= 0:
        return None
    members = []
    for shard_set, weight in zip(shard_sets, weights, strict=True):
        documents = split_document_ranges(shard_set.num_documents, data.split)[
            SPLIT_NAMES.index(split)
        ]
        if shard_set.document_lengths[documents.start : documents.stop].sum() > 0:
            members.append((shard_set, documents, weight))
        elif len(shard_sets) > 1:
            logger.warning("%s: %s split is empty, left out of the blend", shard_set.root, split)
    if not members:
        return None

    def component(member: tuple[ShardSet, range, float], samples: int) -> Dataset:
        shard_set, documents, _ = member
        return split_samples(
            shard_set,
            split,
            documents,
            samples,
            data.seq_length,
            data.seed,
            index_cache_dir(data, shard_set),
        )

    if len(members) == 1:
        return component(members[0], count)
    member_weights = [weight for _, _, weight in members]
    cache_dir = index_cache_dir(data, members[0][0])
    indices = load_blending_indices(member_weights, count, cache_dir)
    needed = samples_per_dataset(indices["dataset_index"], len(members))
    datasets = [component(m, n) for m, n in zip(members, needed, strict=True)]
    return BlendedDataset(datasets, member_weights, count, cache_dir)
