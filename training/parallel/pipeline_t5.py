"""T5 (encoder-decoder) pipeline stages: what :mod:`training.parallel.pipeline` needs
beyond GPT's stage model, chunk and batch inputs.

Split (Megatron's encoder-then-decoder): the encoder's layers then the decoder's are one
list of ``num_layers + decoder_layers`` global layers, divided by
``parallel.pipeline_layers`` like GPT's (:mod:`training.parallel.pipeline_layout`); a
virtual stage may end the encoder and start the decoder. Parameter names stay the
single-process ones (``encoder.layers.{i}``, ``decoder.layers.{j}``).

What travels between stages is always the pair ``(encoder side, decoder side)``, both
``[B, length / sp, H]`` and contiguous:

- encoder stages: ``(encoder hidden, decoder embeddings)``;
- decoder stages: ``(encoder output, decoder hidden)``; the last stage returns the
  decoder's normed hidden states to the schedule's loss (the output head).

The shared embedding lives on the first stage only: it embeds the decoder tokens too
and the embeddings ride along the encoder stages to the stage that starts the decoder
(the brief's second option, instead of Megatron's copy of the table on the decoder's
first stage). There is then no second copy to keep equal and no gradient to sum over
embedding holders; the price is one ``[B, T, H]`` tensor more per transfer through the
encoder stages (T5's targets are short: T ≈ S / 4 at the usual 15% noise). A stage
that only passes a tensor on returns a clone of it (pipelining's backward expects
outputs that autograd produced, not its own input buffers).

The encoder mask ``[B, S]`` (bool, False on padding) goes to every stage as a keyword
input of the schedule (``torch.distributed.pipelining`` splits keyword inputs into the
same micro-batches and hands them to every stage; every pipeline rank reads the same
batches). Each stage builds its float attention masks (relative bias, padding,
causality) from it with :meth:`T5Model.encoder_attention_mask` and
:meth:`T5Model.decoder_attention_masks`, so no ``[heads, S, S]`` bias crosses a link.
For that every stage keeps both relative-bias tables (``buckets × heads``, tiny); like
GPT's tied embedding their gradients are summed over the pipeline group before the step
(zero where a stage has no layer of that stack), so the copies stay equal, and the
grad norm and checkpoints count the owner's
(:func:`~training.parallel.pipeline_layout.owner_of_t5_parameter`).

Dropout: the stages draw their masks in another order than one process (the decoder
embeddings are dropped out before the encoder layers run), so with ``model.dropout > 0``
runs match one process in distribution only; the parity tests use dropout 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from training.data.t5_dataset import T5_KEYS, encoder_mask_on
from training.models.t5 import ContextShard, T5Model
from training.parallel import context_parallel as cp
from training.parallel.groups import ParallelState
from training.parallel.pipeline_layout import stage_layers, virtual_stages_of


def build_t5_stage_model(
    model: T5Model, state: ParallelState, counts: list[int]
) -> tuple[T5Model, list[list[int]]]:
    """Keep this rank's encoder and decoder layers (and the parts their stages need) of a
    whole (or TP-sharded) T5, in place; returns it and each chunk's global layers."""
    sizes = state.sizes
    ranges = stage_layers(counts)
    chunks = [list(ranges[s]) for s in virtual_stages_of(state.pp_rank, sizes.pp, sizes.vpp)]
    keep = {i for chunk in chunks for i in chunk}
    encoder_layers = model.config.num_layers
    model.encoder.layers = nn.ModuleDict(
        {str(i): model.encoder.layers[i] for i in sorted(keep) if i < encoder_layers}
    )
    model.decoder.layers = nn.ModuleDict(
        {
            str(i - encoder_layers): model.decoder.layers[i - encoder_layers]
            for i in sorted(keep)
            if i >= encoder_layers
        }
    )
    if not state.is_first_stage:
        model.embedding = None
    if encoder_layers - 1 not in keep:
        model.encoder.final_norm = None
    if not state.is_last_stage:
        model.decoder.final_norm = None
        model.output = None
    return model, chunks


class T5StageChunk(nn.Module):
    """One virtual stage of a T5: [embedding of both token streams] → its encoder blocks
    → [encoder final norm] → its decoder blocks → [decoder final norm]. Takes and
    returns ``(encoder side, decoder side)`` (module docstring); the first stage takes
    ``(encoder_tokens, decoder_tokens)``, the last returns the decoder hidden states."""

    def __init__(
        self,
        model: T5Model,
        layers: list[int],
        first: bool,
        last: bool,
        autocast: Callable[[], contextlib.AbstractContextManager],
        sequence_shards: int,
        context_shards: int = 1,
    ):
        super().__init__()
        encoder_layers = model.config.num_layers
        self.embedding = model.embedding if first else None
        self.encoder_blocks = nn.ModuleList(
            model.encoder.layers[str(i)] for i in layers if i < encoder_layers
        )
        self.decoder_blocks = nn.ModuleList(
            model.decoder.layers[str(i - encoder_layers)] for i in layers if i >= encoder_layers
        )
        self.ends_encoder = encoder_layers - 1 in layers
        self.last = last
        # Registered (not the whole stacks, which hold other chunks' layers) so that the
        # chunk's parameters() (zero bubble's weight gradients) are exactly those it uses,
        # the relative-bias tables its masks read included.
        self.encoder_bias = model.encoder.relative_bias if self.encoder_blocks else None
        self.decoder_bias = model.decoder.relative_bias if self.decoder_blocks else None
        self.encoder_norm = model.encoder.final_norm if self.ends_encoder else None
        self.encoder_dropout = model.encoder.dropout
        self.decoder_norm = model.decoder.final_norm if last else None
        self.decoder_dropout = model.decoder.dropout
        self.output = model.output if last else None
        self.rope = model.rope
        self._encoder_mask = model.encoder_attention_mask
        self._decoder_masks = model.decoder_attention_masks
        self._run_block = model._run_block  # activation checkpointing as configured
        self._autocast = autocast
        self._sequence_shards = sequence_shards  # TP size under sequence parallelism
        self._context_shards = context_shards  # CP size: a rank holds 1/CP of each sequence

    def forward(
        self,
        source: Tensor,
        target: Tensor,
        *,
        encoder_mask: Tensor | None = None,
        encoder_positions: Tensor | None = None,
        decoder_positions: Tensor | None = None,
    ):
        """Under context parallelism ``encoder_positions [B, S/CP]`` and
        ``decoder_positions [B, T/CP]`` are the global positions of this rank's part of
        the sequences (:func:`t5_context_parallel_part`); ``encoder_mask`` stays whole
        (None: no sample pads)."""
        device = source.device
        with self._autocast():
            shards = self._context_shards
            if self.embedding is None:  # activations, split over TP ranks under SP
                shards *= self._sequence_shards
            source_length, target_length = source.size(1) * shards, target.size(1) * shards
            if self.embedding is not None:  # token ids of both stacks
                source, target = self.embedding(source, 0), self.embedding(target, 0)
            shard = None
            if encoder_positions is not None:
                shard = ContextShard(
                    encoder_positions[0], decoder_positions[0], source_length, target_length
                )
            source_rows = source_length // self._context_shards
            target_rows = target_length // self._context_shards
            passed_source, passed_target = True, True
            if self.encoder_blocks:
                mask = self._encoder_mask(source_rows, encoder_mask, device, shard)
                rope = self._rope(source_rows, device, encoder_positions)
                for block in self.encoder_blocks:
                    source = self._run_block(block, source, rope, attn_mask=mask)
                passed_source = False
            if self.ends_encoder:
                source = self.encoder_dropout(self.encoder_norm(source))
                passed_source = False
            if self.decoder_blocks:
                self_mask, cross_mask = self._decoder_masks(
                    target_rows, encoder_mask, device, 0, shard
                )
                rope = self._rope(target_rows, device, decoder_positions)
                for block in self.decoder_blocks:
                    target = self._run_block(block, target, source, rope, self_mask, cross_mask)
                passed_target = False
            if self.last:
                return self.decoder_dropout(self.decoder_norm(target))
        # Only tensors autograd made leave a stage (a received buffer is cloned).
        if passed_source:
            source = source.clone()
        if passed_target and self.embedding is None:
            target = target.clone()
        return source, target

    def _rope(self, length: int, device: torch.device, positions: Tensor | None = None):
        if self.rope is None:
            return None
        return self.rope(0, length, device, None if positions is None else positions[0])


def t5_context_parallel_part(
    args: tuple[Tensor, ...], kwargs: dict[str, Tensor], labels: Tensor, state: ParallelState
) -> tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]:
    """A T5's schedule inputs for this CP rank: its load-balanced part of the encoder and
    decoder tokens and of the labels, the whole encoder mask, and for every stage the
    part's global positions in both sequences (batch-first, so the schedule splits them
    into micro-batches like the rest)."""
    cp_size, cp_rank = state.sizes.cp, state.cp_rank
    encoder, decoder = args
    rows = encoder.size(0)
    positions = {
        name: cp.positions(x.size(1), cp_size, cp_rank, x.device).expand(rows, -1).contiguous()
        for name, x in (("encoder_positions", encoder), ("decoder_positions", decoder))
    }
    local = [cp.split_sequence(x, cp_size, cp_rank).contiguous() for x in (*args, labels)]
    return (local[0], local[1]), {**kwargs, **positions}, local[2]


def t5_schedule_inputs(
    batches: list[dict[str, Tensor]], device: torch.device
) -> tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]:
    """One step's micro-batches as the schedule's whole-batch inputs: the first stage's
    ``(encoder_tokens, decoder_tokens)``, every stage's ``encoder_mask`` keyword (left
    out where no sample pads, :func:`~training.data.t5_dataset.encoder_mask_on`) and the
    last stage's ``labels`` (contiguous, see the pipeline module's docstring)."""
    host = [torch.cat([b[key] for b in batches]) for key in T5_KEYS]
    encoder, decoder, labels = (x.to(device, non_blocking=True).contiguous() for x in host[:3])
    mask = encoder_mask_on(host[3], device)
    return (encoder, decoder), ({} if mask is None else {"encoder_mask": mask}), labels


def t5_activation_shapes(
    batch: dict[str, Tensor], hidden_size: int, sequence_shards: int
) -> list[tuple[int, ...]]:
    """The shapes one micro-batch's ``(encoder side, decoder side)`` has between stages."""
    encoder, decoder = batch["encoder_tokens"], batch["decoder_tokens"]
    return [
        (encoder.size(0), encoder.size(1) // sequence_shards, hidden_size),
        (decoder.size(0), decoder.size(1) // sequence_shards, hidden_size),
    ]


def relative_bias_tables(model: T5Model) -> list[nn.Parameter]:
    """The relative-bias tables every stage holds (empty with RoPE positions)."""
    stacks = (model.encoder, model.decoder)
    return [s.relative_bias.weight for s in stacks if s.relative_bias is not None]
