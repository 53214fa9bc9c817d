"""Activation memory of one GPT (decoder-only) pipeline rank, for :mod:`training.memory.estimate`:
``seq_length / CP`` tokens per sample through each of the rank's blocks
(:func:`~training.memory.activations.saved_bytes_per_token`)."""

from __future__ import annotations

from megalith.config import DataConfig, MegalithConfig
from training.memory.activations import saved_bytes_per_token
from training.parallel.groups import ParallelSizes
from training.parallel.pipeline_layout import layer_counts


def _stage_layers(config: MegalithConfig, sizes: ParallelSizes, stage: int) -> int:
    counts = layer_counts(
        config.model.num_layers, sizes.pp, sizes.vpp, config.parallel.pipeline_layers
    )
    return sum(counts[stage + chunk * sizes.pp] for chunk in range(sizes.vpp))


def stage_activations(
    config: MegalithConfig,
    sizes: ParallelSizes,
    stage: int,
    mbs: int,
    recompute: str,
    in_flight: float,
) -> tuple[float, float]:
    """``(activation bytes, one layer's bytes per micro-batch)`` of pipeline rank ``stage``;
    ``in_flight`` micro-batches of its layers."""
    tokens = mbs * config.data.seq_length / sizes.cp
    per_layer = saved_bytes_per_token(config, sizes, recompute) * tokens
    activations = per_layer * _stage_layers(config, sizes, stage) * in_flight
    if recompute != "none":  # one layer rebuilt in full during its backward
        activations += saved_bytes_per_token(config, sizes, "none") * tokens
    return activations, per_layer


def loss_tokens(config: MegalithConfig, sizes: ParallelSizes, mbs: int) -> int:
    """Tokens the output head scores per micro-batch on this rank: its share of the sequence."""
    return mbs * config.data.seq_length // sizes.cp


def sample_shape(data: DataConfig) -> str:
    return str(data.seq_length)
