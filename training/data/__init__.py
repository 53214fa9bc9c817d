"""Training data: shard sets → fixed-length GPT samples, split, shuffled and blended."""

from training.data.blending import BlendedDataset
from training.data.builder import build_gpt_datasets
from training.data.gpt_dataset import GPTDataset
from training.data.shard_set import ShardSet, ShardSetError, open_shard_set, open_source

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "ShardSet",
    "ShardSetError",
    "build_gpt_datasets",
    "open_shard_set",
    "open_source",
]
