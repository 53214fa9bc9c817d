"""The decoder-only family (``model.family: gpt``): Llama- and GPT-2-style models, dense
or mixture-of-experts (training/models/gpt.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from megalith.config import DataConfig, ModelConfig
from training.data import build_gpt_datasets
from training.families.spec import (
    Batch,
    Generator,
    HFExport,
    MemoryModel,
    ModelFamily,
    PipelineSplit,
)
from training.inference import decode
from training.interop import hf
from training.memory import gpt as memory
from training.models.flops import flops_per_token
from training.models.gpt import GPTModel
from training.objectives import sft
from training.parallel import context_parallel as cp
from training.parallel import pipeline
from training.parallel.groups import ParallelState
from training.parallel.pipeline_layout import owner_of_parameter


def micro_batch_loss(
    model: nn.Module, batch: Batch, device: torch.device, state: ParallelState
) -> Tensor:
    """Mean next-token cross-entropy; under context parallelism this rank's share."""
    tokens = batch["tokens"].to(device, non_blocking=True)
    if state.sizes.cp > 1:  # this rank's part of the sequence, loss scaled
        return cp.micro_batch_loss(model, tokens[:, :-1], tokens[:, 1:], state)
    return model(tokens[:, :-1], labels=tokens[:, 1:])


def tokens_and_flops(model: ModelConfig, data: DataConfig) -> tuple[int, float]:
    """``data.seq_length`` tokens a sample; the output head is a real matmul, so it counts
    (the reference MFU figures do); only the embedding lookup is left out."""
    return data.seq_length, flops_per_token(model, data.seq_length, include_output_head=True)


def context_length(data: DataConfig) -> tuple[int, str]:
    return data.seq_length, f"data.seq_length {data.seq_length}"


def hf_export(
    config: ModelConfig, tensors: dict[str, Tensor], tokenizer: Path, dtype: str
) -> HFExport:
    """``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (:mod:`training.interop.hf`)."""
    tok_config, special_ids = hf.tokenizer_files(tokenizer)
    return HFExport(
        tensors=hf.to_hf_tensors(config, tensors),
        config=hf.hf_config(config, dtype, special_ids),
        tokenizer_config=tok_config,
        special_ids=special_ids,
        template=f"{tok_config['bos_token']} $A",
    )


FAMILY = ModelFamily(
    name="gpt",
    model_class=GPTModel,
    build_datasets=build_gpt_datasets,
    context_length=context_length,
    sample_window=lambda data: data.seq_length,
    micro_batch_loss=micro_batch_loss,
    chat_loss=sft.micro_batch_loss,
    tokens_and_flops=tokens_and_flops,
    pipeline=PipelineSplit(
        build_stage=pipeline.build_stage_model,
        chunk=pipeline.StageChunk,
        schedule_inputs=pipeline.schedule_inputs,
        activation_shapes=pipeline.activation_shapes,
        context_parallel_part=pipeline.context_parallel_part,
        owner=lambda name, counts, pp, model: owner_of_parameter(name, counts, pp),
        on_every_stage=lambda name: False,  # the tied embedding's copy is summed apart
        blocks=lambda model: list(model.layers.values()),
    ),
    memory=MemoryModel(
        stage_activations=memory.stage_activations,
        loss_tokens=memory.loss_tokens,
        sample_shape=memory.sample_shape,
    ),
    generator=Generator(
        seq2seq=False,
        prompt_ids=decode.prompt_ids,
        chat_prompt=lambda tokenizer, ids: list(ids),  # the answer follows the template
        answer_text=decode.continuation_text,
        generate=decode.generate,
        generate_batch=decode.generate_batch,
    ),
    hf_export=hf_export,
)
