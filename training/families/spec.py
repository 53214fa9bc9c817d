"""What a model family supplies: :class:`ModelFamily` and the pipeline split it holds.

The stages never branch on ``model.family``; they ask the family's spec
(:func:`training.families.model_family`) for the hook they need. Each hook is a plain
function of the family's own modules; the types below say what the callers pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from megalith.config import DataConfig, MegalithConfig, ModelConfig
from preprocessing.tokenizer import Tokenizer
from training.inference.decode import GenerationResult
from training.parallel.groups import ParallelSizes, ParallelState

Batch = dict[str, Tensor]
Splits = tuple[Dataset | None, Dataset | None, Dataset | None]


@dataclass(frozen=True)
class PipelineSplit:
    """How :class:`training.parallel.pipeline.PipelineParallel` cuts the family's model.

    The layers split are every stack's, in order
    (:func:`~training.parallel.pipeline_layout.pipelined_layers`); parameter names stay
    the single-process ones, so checkpoints and the package do not depend on the layout."""

    # (whole model, state, layers per virtual stage) -> (stage model, each chunk's layers)
    build_stage: Callable[[nn.Module, ParallelState, list[int]], tuple[nn.Module, list[list[int]]]]
    # (stage model, chunk layers, first, last, autocast, sequence-parallel shards, context-
    #   parallel shards) -> one virtual stage
    chunk: Callable[
        [
            nn.Module,
            list[int],
            bool,
            bool,
            Callable[[], contextlib.AbstractContextManager],
            int,
            int,
        ],
        nn.Module,
    ]
    # (first stage's inputs, every stage's keyword inputs, loss target, parallel state) ->
    #   this context-parallel rank's part of them (and its positions for every stage)
    context_parallel_part: Callable[
        [tuple[Tensor, ...], dict[str, Tensor], Tensor, ParallelState],
        tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor],
    ]
    # micro-batches -> (first stage's inputs, every stage's keyword inputs, loss target)
    schedule_inputs: Callable[
        [list[Batch], torch.device], tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]
    ]
    # (one micro-batch, hidden size, sequence shards) -> shapes sent between stages
    activation_shapes: Callable[[Batch, int, int], list[tuple[int, ...]]]
    # (parameter name, layers per virtual stage, pipeline size, model) -> owning pp rank
    owner: Callable[[str, list[int], int, ModelConfig], int]
    # parameter name -> whether every stage holds a copy (gradients summed over the pipeline)
    on_every_stage: Callable[[str], bool]
    # stage model -> its transformer blocks (``training.compile`` compiles each in place)
    blocks: Callable[[nn.Module], list[nn.Module]]


@dataclass(frozen=True)
class Generator:
    """How the family's model writes text (:mod:`training.inference`), for evaluation and
    serving alike."""

    seq2seq: bool  # the prompt is an encoder's input and the answer new text
    # (tokenizer, text) -> a plain prompt's tokens as the family was trained to read them
    prompt_ids: Callable[[Tokenizer, str], list[int]]
    # (tokenizer, a chat's templated prompt ids) -> what the model reads to answer it
    chat_prompt: Callable[[Tokenizer, list[int]], list[int]]
    # (tokenizer, prompt ids, new ids) -> the answer's text
    answer_text: Callable[[Tokenizer, list[int], list[int]], str]
    # (model, tokenizer, texts, sampling, *, batch_size, autocast_dtype) -> every answer
    generate: Callable[..., GenerationResult]
    # (model, tokenizer, prompt ids, samplings, **seeds/autocast_dtype/on_token/stop)
    #   -> (new ids, finish reason, prompt tokens) per prompt: one batch
    generate_batch: Callable[..., list[tuple[list[int], str, int]]]


@dataclass(frozen=True)
class MemoryModel:
    """How :mod:`training.memory.estimate` counts the family's activations; the static
    rows come from the real model and the pipeline split."""

    # (config, sizes, pipeline rank, micro-batch, recompute mode, micro-batches in flight)
    #   -> (activation bytes, the largest layer's bytes per micro-batch)
    stage_activations: Callable[
        [MegalithConfig, ParallelSizes, int, int, str, float], tuple[float, float]
    ]
    # (config, sizes, micro-batch) -> tokens the output head scores on this rank
    loss_tokens: Callable[[MegalithConfig, ParallelSizes, int], int]
    # data -> a sample's tokens as the report shows them
    sample_shape: Callable[[DataConfig], str]


@dataclass(frozen=True)
class HFExport:
    """A package as a Hugging Face model: what :func:`training.interop.export.export_hf` writes."""

    tensors: dict[str, Tensor]
    config: dict[str, Any]  # config.json
    tokenizer_config: dict[str, Any]
    special_ids: dict[str, int]  # generation_config.json's *_token_id
    template: str  # the fast tokenizer's post-processing template


@dataclass(frozen=True)
class ModelFamily:
    """One model family (gpt, t5): everything the stages do differently for it."""

    name: str
    model_class: type[nn.Module]  # built from a ModelConfig (training.models.MODEL_CLASSES)
    # data config, samples per split (train, valid, test) -> the three datasets
    build_datasets: Callable[[DataConfig, tuple[int, int, int]], Splits]
    # data config -> (positions a sample needs, what that length is, for messages)
    context_length: Callable[[DataConfig], tuple[int, str]]
    # data config -> the raw tokens one sample reads from the shards
    sample_window: Callable[[DataConfig], int]
    # (model, micro-batch, device, parallel state) -> the micro-batch's mean loss
    micro_batch_loss: Callable[[nn.Module, Batch, torch.device, ParallelState], Tensor]
    # data.format=chat: (model, micro-batch, device, token weight or None, parallel state)
    #   -> sum of its answer tokens' losses times the weight (training.objectives.sft),
    #   or without one their mean in the micro-batch
    chat_loss: Callable[[nn.Module, Batch, torch.device, Tensor | None, ParallelState], Tensor]
    # (model, data) -> (tokens a sample counts for throughput, training FLOPs per token)
    tokens_and_flops: Callable[[ModelConfig, DataConfig], tuple[int, float]]
    pipeline: PipelineSplit
    memory: MemoryModel
    generator: Generator
    # (model config, whole single-process tensors, tokenizer.model, dtype name) -> HF files
    hf_export: Callable[[ModelConfig, dict[str, Tensor], Path, str], HFExport]
