"""Which transformer layers each pipeline stage holds, and the schedule's ideal bubble.

Torch-free (pure functions of the sizes), so the launcher and ``validate_layout``
check a split before any process starts.

Virtual stages (Megatron's interleaved schedule): with ``pipeline`` ranks and
``virtual_pipeline`` model chunks per rank there are ``pp · v`` virtual stages, run in
order 0, 1, ..., pp·v - 1. Chunk ``c`` of pipeline rank ``r`` is virtual stage
``c · pp + r``, so rank 0 holds virtual stages 0, pp, 2·pp, ... The embedding is on
virtual stage 0 (rank 0), the final norm, output head and loss on the last virtual
stage (rank pp - 1).

``parallel.pipeline_layers`` says how many layers each virtual stage holds:

- ``even`` (default): ``num_layers / (pp · v)`` each.
- ``balanced``: the embedding and the output head with its loss count as one layer
  each (Megatron's ``account_for_embedding/loss_in_pipeline_split``):
  ``(num_layers + 2) / (pp · v)`` per virtual stage, one fewer on the first and on
  the last. Useful when the vocabulary is large next to the hidden size.
- a list of ``pp · v`` layer counts, first virtual stage first, summing to num_layers.

Every virtual stage holds at least one layer. With ``pipeline`` 1 the key is ignored,
so a config resumes in a layout without pipeline parallelism unchanged.

T5 (``model.family: t5``): the layers are the encoder's then the decoder's, counted in
that order (Megatron's encoder-then-decoder split), so ``num_layers + decoder_layers``
are split and a stage may end the encoder and start the decoder. The shared embedding
and the encoder's relative-bias table are owned by the first stage, the encoder's final
norm by the stage of its last layer, the decoder's relative-bias table by the stage of
its first layer, the decoder's final norm and the output head by the last
(``training.parallel.pipeline_t5``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalith.config import ModelConfig

Split = str | list[int]


def layer_counts(num_layers: int, pp: int, vpp: int, split: Split = "even") -> list[int]:
    """Layers per virtual stage (``pp · vpp`` entries); raises ValueError naming the keys."""
    stages = pp * vpp
    if isinstance(split, list):
        counts = list(split)
        if len(counts) != stages:
            raise ValueError(
                f"pipeline_layers has {len(counts)} entries, needs pipeline {pp} · "
                f"virtual_pipeline {vpp} = {stages} (one per virtual stage)"
            )
        if sum(counts) != num_layers:
            raise ValueError(
                f"pipeline_layers {counts} sum to {sum(counts)}, num_layers is {num_layers}"
            )
    elif split == "even":
        if num_layers % stages:
            raise ValueError(
                f"num_layers {num_layers} is not divisible by pipeline {pp} · virtual_pipeline "
                f"{vpp} = {stages} (or set parallel.pipeline_layers)"
            )
        counts = [num_layers // stages] * stages
    elif split == "balanced":
        if (num_layers + 2) % stages:
            raise ValueError(
                f"pipeline_layers balanced: num_layers {num_layers} + 2 (embedding and output "
                f"head) is not divisible by pipeline {pp} · virtual_pipeline {vpp} = {stages}"
            )
        per = (num_layers + 2) // stages
        counts = [per] * stages
        counts[0] -= 1
        counts[-1] -= 1
    else:
        raise ValueError(f"pipeline_layers {split!r}: use even, balanced or a list of counts")
    if min(counts) < 1:
        raise ValueError(
            f"pipeline_layers {split!r} leaves a virtual stage without layers ({counts}); "
            f"num_layers {num_layers} is too few for pipeline {pp} · virtual_pipeline {vpp}"
        )
    return counts


def stage_layers(counts: list[int]) -> list[range]:
    """Global layer indices of each virtual stage."""
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def virtual_stages_of(pp_rank: int, pp: int, vpp: int) -> list[int]:
    """The virtual stages (model chunks) one pipeline rank holds: ``c · pp + rank``."""
    return [chunk * pp + pp_rank for chunk in range(vpp)]


def owner_of_stage(virtual_stage: int, pp: int) -> int:
    return virtual_stage % pp


_LAYER = re.compile(r"layers\.(\d+)\.")


def pipelined_layers(model: ModelConfig) -> int:
    """The layers a pipeline splits: GPT's, or T5's encoder then decoder layers."""
    return model.stacked_layers


def stage_of_layer(layer: int, counts: list[int]) -> int:
    """The virtual stage holding global layer ``layer``."""
    for stage, layers in enumerate(stage_layers(counts)):
        if layer in layers:
            return stage
    raise ValueError(f"layer {layer} is outside the pipeline split {counts}")


_T5_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.")


def owner_of_t5_parameter(name: str, counts: list[int], pp: int, encoder_layers: int) -> int:
    """The pipeline rank that owns (saves, counts in the grad norm) a single-process T5
    parameter name; encoder layer ``i`` is global layer ``i``, decoder layer ``j`` is
    ``encoder_layers + j``. Relative-bias tables are held by every stage, owned here."""
    match = _T5_LAYER.match(name)
    if match is not None:
        side, index = match.group(1), int(match.group(2))
        layer = index if side == "encoder" else encoder_layers + index
    elif name.startswith(("embedding.", "encoder.relative_bias.")):
        return 0
    elif name.startswith("encoder.final_norm."):
        layer = encoder_layers - 1
    elif name.startswith("decoder.relative_bias."):
        layer = encoder_layers
    else:  # decoder.final_norm.*, output.*
        return pp - 1
    try:
        return owner_of_stage(stage_of_layer(layer, counts), pp)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def owner_of_parameter(name: str, counts: list[int], pp: int) -> int:
    """The pipeline rank that holds a single-process parameter name (the first stage for
    the embedding, also when a tied copy lives on the last)."""
    if name.startswith("embedding."):
        return 0
    match = _LAYER.match(name)
    if match is None:  # final_norm.*, output.*
        return pp - 1
    try:
        return owner_of_stage(stage_of_layer(int(match.group(1)), counts), pp)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def bubble_fraction(pp: int, vpp: int, micro_batches: int) -> float:
    """The 1F1B / interleaved-1F1B pipeline bubble as a fraction of the ideal compute time,
    ``(p - 1) / (v · m)`` (Narayanan et al. 2021); 0 without pipeline parallelism."""
    return (pp - 1) / (vpp * micro_batches)


def schedule_problems(pp: int, vpp: int, micro_batches: int, schedule: str = "1f1b") -> list[str]:
    """The micro-batch counts the schedules take: 1F1B needs at least one per stage,
    the interleaved schedule a multiple of the pipeline size (Megatron's rule), zero
    bubble at least one per stage in whole rounds of ``m // pp`` (torch's ZB1P)."""
    where = (
        f"{micro_batches} micro-batches per step (global_batch_size / (micro_batch_size · data))"
    )
    if pp == 1:
        return []
    if schedule == "zero-bubble":
        rounds = max(1, micro_batches // pp)
        if micro_batches < pp or micro_batches % rounds:
            return [
                f"{where} do not suit pipeline_schedule zero-bubble at pipeline {pp}: it needs "
                f"at least {pp} and a multiple of micro-batches // {pp} (e.g. a multiple of {pp})"
            ]
        return []
    if vpp == 1 and micro_batches < pp:
        return [f"{where} are fewer than pipeline {pp}: 1F1B needs at least one per stage"]
    if vpp > 1 and micro_batches % pp:
        return [f"{where} are not a multiple of pipeline {pp} (interleaved schedule)"]
    return []


def layout_problems(num_layers: int, pp: int, vpp: int, split: Split) -> list[str]:
    """What ``validate_layout`` reports about the layer split (nothing with pipeline 1)."""
    if pp == 1:
        return []
    try:
        layer_counts(num_layers, pp, vpp, split)
    except ValueError as error:
        return [str(error)]
    return []
