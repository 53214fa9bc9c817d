"""Weighted blending of several datasets into one sample sequence.

At every global index the blend takes the next sample of the dataset whose realised
count is furthest behind its weight. "Behind" is measured relative to the weight:
dataset ``i`` with ``c`` samples taken so far is due at time ``(c + 1/2) / w_i``, and
the dataset due first goes next (ties to the lower index). That is Megatron's greedy
rule measured in time rather than in samples, and it is what makes the sequence
computable without a C++ loop: it is the merge of every dataset's due times, i.e. a
sort. After any ``n`` samples each dataset has ``w_i * n`` of them to within about one.

The due times are sorted window by window, so memory stays bounded and the first
``n`` entries never depend on how many were asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from training.data.index_cache import check_ids, load_or_build

BLEND_FORMAT = 1
BLEND_NAMES = ("dataset_index", "dataset_sample_index")
_WINDOW = 1 << 20  # time units (about that many samples) sorted at once


def normalized(weights: Sequence[float]) -> np.ndarray:
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or not weights.size or (weights <= 0).any():
        raise ValueError(f"blend weights must be positive, got {weights.tolist()}")
    return weights / weights.sum()


def _first_due(weights: np.ndarray, time: float) -> np.ndarray:
    """Per dataset, the first sample number whose due time ``(k + 1/2) / w`` is >= ``time``."""
    return np.maximum(0, np.ceil(weights * time - 0.5)).astype(np.int64)


def blending_indices(weights: Sequence[float], num_samples: int) -> dict[str, np.ndarray]:
    """Which dataset (``dataset_index``) and which of its samples (``dataset_sample_index``)
    each global index takes."""
    weights = normalized(weights)
    dataset_index = np.empty(num_samples, dtype=np.int16)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    filled, start = 0, 0.0
    while filled < num_samples:
        stop = start + _WINDOW
        first, end = _first_due(weights, start), _first_due(weights, stop)
        numbers = [np.arange(a, b) for a, b in zip(first, end, strict=True)]
        due = np.concatenate([(k + 0.5) / w for k, w in zip(numbers, weights, strict=True)])
        order = np.argsort(due, kind="stable")[: num_samples - filled]
        owner = np.repeat(np.arange(weights.size, dtype=np.int16), end - first)
        dataset_index[filled : filled + order.size] = owner[order]
        dataset_sample_index[filled : filled + order.size] = np.concatenate(numbers)[order]
        filled += order.size
        start = stop
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


def load_blending_indices(
    weights: Sequence[float], num_samples: int, cache_dir: str | Path
) -> dict[str, np.ndarray]:
    description = {
        "kind": "blend",
        "format": BLEND_FORMAT,
        "weights": normalized(weights).tolist(),
        "num_samples": num_samples,
    }
    return load_or_build(
        cache_dir,
        description,
        BLEND_NAMES,
        lambda: blending_indices(weights, num_samples),
        lambda arrays: _check_blend(arrays, len(weights), num_samples),
    )


def _check_blend(arrays: dict[str, np.ndarray], num_datasets: int, num_samples: int) -> None:
    """Cached blending indices: a known dataset per sample, and each dataset's samples
    numbered below the count the blend takes from it."""
    datasets, samples = arrays["dataset_index"], arrays["dataset_sample_index"]
    check_ids(datasets, "dataset_index", 0, num_datasets)
    check_ids(samples, "dataset_sample_index", 0, max(num_samples, 1))
    if datasets.size < num_samples or samples.size != datasets.size:
        raise ValueError(f"dataset_index {datasets.shape}, dataset_sample_index {samples.shape}")
    taken = np.bincount(datasets, minlength=num_datasets)
    if datasets.size and (samples >= taken[datasets]).any():
        raise ValueError("dataset_sample_index numbers more samples than the blend takes")


def samples_per_dataset(dataset_index: np.ndarray, num_datasets: int) -> list[int]:
    return np.bincount(dataset_index, minlength=num_datasets).tolist()


class BlendedDataset(Dataset):
    """Global index → (dataset, sample) through cached blending indices."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float],
        num_samples: int,
        cache_dir: str | Path,
    ):
        self.datasets = list(datasets)
        self.weights = normalized(weights).tolist()
        self.num_samples = num_samples
        self.cache_dir = Path(cache_dir)
        if len(self.datasets) != len(self.weights):
            raise ValueError(f"{len(self.datasets)} datasets but {len(self.weights)} weights")
        self._load()
        needed = samples_per_dataset(self.dataset_index, len(self.datasets))
        for dataset, count in zip(self.datasets, needed, strict=True):
            if len(dataset) < count:
                raise ValueError(f"blend needs {count} samples from a dataset of {len(dataset)}")

    def _load(self) -> None:
        indices = load_blending_indices(self.weights, self.num_samples, self.cache_dir)
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["dataset_index"], state["dataset_sample_index"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()
