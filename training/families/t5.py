"""The encoder-decoder family (``model.family: t5``): T5 v1.1 trained on span corruption,
and fine-tuned on chats (the encoder reads the conversation, the decoder writes the turn).

Its parts: the model (training/models/t5.py), the span-corruption samples
(training/data/t5_dataset.py), the chat-turn samples (training/data/t5_chat_dataset.py),
the objectives and throughput count (training/objectives/t5.py), the pipeline stages
(training/parallel/pipeline_t5.py) and the HF export (training/interop/hf_t5.py)."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from megalith.config import DataConfig, ModelConfig
from training.data.t5_chat_dataset import build_t5_chat_datasets, chat_lengths
from training.data.t5_dataset import build_t5_datasets, span_corruption_lengths
from training.families.spec import (
    Generator,
    HFExport,
    MemoryModel,
    ModelFamily,
    PipelineSplit,
    Splits,
)
from training.inference import decode_t5
from training.interop import hf_t5
from training.memory import t5 as memory
from training.models.t5 import T5Model
from training.objectives import t5
from training.parallel import pipeline_t5
from training.parallel.pipeline_layout import owner_of_t5_parameter


def context_length(data: DataConfig) -> tuple[int, str]:
    """The longer of the encoder and decoder lengths: both stacks' positions."""
    length = max(t5.sample_lengths(data))
    return length, f"the T5 sample length {length} (data.span_corruption)"


def build_datasets(data: DataConfig, num_samples: tuple[int, int, int]) -> Splits:
    """Span corruption of pretraining documents, or a chat fine-tune's turns."""
    chat = data.format == "chat"
    return (build_t5_chat_datasets if chat else build_t5_datasets)(data, num_samples)


def sample_window(data: DataConfig) -> int:
    """The raw tokens a sample reads: span corruption's window, or a chat turn's context
    and answer at most."""
    if data.format == "chat":
        lengths = chat_lengths(data)
        return lengths.encoder + lengths.decoder
    return span_corruption_lengths(data).raw


def hf_export(
    config: ModelConfig, tensors: dict[str, Tensor], tokenizer: Path, dtype: str
) -> HFExport:
    """``T5ForConditionalGeneration`` (:mod:`training.interop.hf_t5`)."""
    tok_config, special_ids = hf_t5.t5_tokenizer_files(tokenizer)
    return HFExport(
        tensors=hf_t5.to_hf_t5_tensors(config, tensors),
        config=hf_t5.hf_t5_config(config, dtype, special_ids),
        tokenizer_config=tok_config,
        special_ids=special_ids,
        template=f"$A {tok_config['eos_token']}",  # the encoder input: text, then EOS
    )


FAMILY = ModelFamily(
    name="t5",
    model_class=T5Model,
    build_datasets=build_datasets,
    context_length=context_length,
    sample_window=sample_window,
    micro_batch_loss=t5.micro_batch_loss,
    chat_loss=t5.chat_micro_batch_loss,
    tokens_and_flops=t5.tokens_and_flops,
    pipeline=PipelineSplit(
        build_stage=pipeline_t5.build_t5_stage_model,
        chunk=pipeline_t5.T5StageChunk,
        schedule_inputs=pipeline_t5.t5_schedule_inputs,
        activation_shapes=pipeline_t5.t5_activation_shapes,
        context_parallel_part=pipeline_t5.t5_context_parallel_part,
        owner=lambda name, counts, pp, model: owner_of_t5_parameter(
            name, counts, pp, model.num_layers
        ),
        # Every stage holds both relative-bias tables (pipeline_t5's docstring).
        on_every_stage=lambda name: ".relative_bias." in name,
        blocks=lambda model: [*model.encoder.layers.values(), *model.decoder.layers.values()],
    ),
    memory=MemoryModel(
        stage_activations=memory.stage_activations,
        loss_tokens=memory.loss_tokens,
        sample_shape=memory.sample_shape,
    ),
    generator=Generator(
        seq2seq=True,
        prompt_ids=decode_t5.encoder_ids,
        chat_prompt=decode_t5.with_eos,
        answer_text=decode_t5.answer_text,
        generate=decode_t5.generate_seq2seq,
        generate_batch=decode_t5.generate_seq2seq_batch,
    ),
    hf_export=hf_export,
)
